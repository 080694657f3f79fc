"""PrefixJobs: the whole-prefix scheduler bookkeeping, driven with plain keys and block ids."""

from __future__ import annotations

import pytest

from ascend_offload.store.book.prefix_jobs import CopyJob, PrefixJobs
from ascend_offload.store.local import LocalStore

PAGE = 64
BS = 4  # tokens per block


def make(num_pages: int = 16, world_size: int = 2, min_load_blocks: int = 1) -> PrefixJobs:
    index = LocalStore(num_pages * PAGE, PAGE, with_data=False)
    return PrefixJobs(index, block_size=BS, page_bytes=PAGE, world_size=world_size,
                      min_load_blocks=min_load_blocks)


def keys(n: int, prefix: str = "k") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def all_ranks_report(jobs: PrefixJobs, job: CopyJob, *, failed_ranks: int = 0) -> None:
    """Each rank reports separately, as vLLM may deliver them in different steps."""
    for _ in range(jobs.world_size - failed_ranks):
        jobs.report({job.job_id: 1}, {})
    for _ in range(failed_ranks):
        jobs.report({}, {job.job_id: 1})


def store_prefix(jobs: PrefixJobs, n: int) -> None:
    """Save blocks k0..k{n-1} through a request 'writer' and commit them."""
    job = jobs.plan_save("writer", keys(n), list(range(100, 100 + n)))
    assert job is not None
    all_ranks_report(jobs, job)
    assert jobs.finish("writer") is not None


# ------------------------------------------------------------------ saves


def test_save_commits_only_after_every_rank_reported() -> None:
    jobs = make(world_size=2)
    job = jobs.plan_save("r", keys(3), [7, 8, 9])
    assert job is not None
    assert job.block_ids == (7, 8, 9)
    assert list(job.pages) == [jobs.index.pages(k)[0] for k in keys(3)]
    assert jobs.index.stats().pending_objects == 3 and jobs.open_jobs == 1
    jobs.report({job.job_id: 1}, {})  # one rank of two
    assert jobs.index.lookup_prefix(keys(3)) == 0
    assert jobs.index.stats().pending_objects == 3 and jobs.open_jobs == 1
    jobs.report({job.job_id: 1}, {})
    assert jobs.index.lookup_prefix(keys(3)) == 3
    assert jobs.index.stats().pending_objects == 0 and jobs.open_jobs == 0
    assert jobs.totals["saved_blocks"] == 3
    assert jobs.finish("r") == {"loaded_blocks": 0, "saved_blocks": 3, "skipped_blocks": 0,
                                "duplicate_blocks": 0, "remote_blocks": 0}


def test_ranks_reported_together_count_as_their_sum() -> None:
    jobs = make(world_size=4)
    job = jobs.plan_save("r", keys(2), [0, 1])
    assert job is not None
    jobs.report({job.job_id: 3}, {})
    assert jobs.index.lookup_prefix(keys(2)) == 0
    jobs.report({job.job_id: 1}, {})
    assert jobs.index.lookup_prefix(keys(2)) == 2


def test_one_failed_rank_aborts_the_save() -> None:
    jobs = make(num_pages=4, world_size=2)
    job = jobs.plan_save("r", keys(3), [0, 1, 2])
    assert job is not None
    jobs.report({job.job_id: 1}, {job.job_id: 1})
    s = jobs.index.stats()
    assert jobs.index.lookup_prefix(keys(3)) == 0
    assert s.pending_objects == 0 and s.stored_objects == 0 and s.free_pages == 4
    assert jobs.totals["save_failed_jobs"] == 1 and jobs.open_jobs == 0


def test_saves_are_incremental_and_skip_stored_blocks() -> None:
    jobs = make()
    store_prefix(jobs, 2)  # k0, k1 stored by another request
    table = [10, 11, 12, 13, 14, 15]
    first = jobs.plan_save("r", keys(4), table)
    assert first is not None and first.block_ids == (12, 13)  # k0, k1 are duplicates
    assert jobs.saved_upto("r") == 4
    assert jobs.plan_save("r", keys(4), table) is None  # nothing new
    second = jobs.plan_save("r", keys(6), table)
    assert second is not None and second.block_ids == (14, 15)
    counts = jobs.finish("r")
    assert counts is not None
    assert counts["saved_blocks"] == 4 and counts["duplicate_blocks"] == 2


def test_full_store_skips_the_blocks_for_good() -> None:
    jobs = make(num_pages=2)
    pending = jobs.plan_save("a", keys(2, "a"), [0, 1])
    assert pending is not None  # both pages pending: nothing evictable
    assert jobs.plan_save("r", keys(3), [5, 6, 7]) is None
    assert jobs.saved_upto("r") == 3  # not retried next step
    assert jobs.totals["skipped_blocks"] == 3
    assert jobs.index.stats().skipped_stores == 3  # counted per object


# ------------------------------------------------------------------ loads


def test_lookup_pins_the_offer_and_the_load_releases_it_after_all_ranks() -> None:
    jobs = make(world_size=2)
    store_prefix(jobs, 4)
    # 4 stored blocks, 1 computed: offer blocks 1..3
    assert jobs.lookup("r", BS, 4, lambda n: keys(n)) == 3 * BS
    assert jobs.index.stats().pinned_objects == 3
    table = [20, 21, 22, 23, 24]
    job = jobs.accept_load("r", 3 * BS, table)
    assert job is not None
    assert job.block_ids == (21, 22, 23)
    assert list(job.pages) == [jobs.index.pages(k)[0] for k in keys(4)[1:]]
    assert jobs.take_loads() == [job] and jobs.take_loads() == []
    assert jobs.saved_upto("r") == 4  # loaded blocks are not saved again
    jobs.report({job.job_id: 1}, {})
    assert jobs.index.stats().pinned_objects == 3  # one rank still copying
    jobs.report({job.job_id: 1}, {})
    assert jobs.index.stats().pinned_objects == 0
    assert jobs.totals["loaded_blocks"] == 3
    counts = jobs.finish("r")
    assert counts is not None and counts["loaded_blocks"] == 3


def test_failed_load_releases_the_pin_and_is_counted() -> None:
    jobs = make(world_size=2)
    store_prefix(jobs, 2)
    assert jobs.lookup("r", 0, 2, lambda n: keys(n)) == 2 * BS
    job = jobs.accept_load("r", 2 * BS, [0, 1])
    assert job is not None
    all_ranks_report(jobs, job, failed_ranks=1)
    assert jobs.index.stats().pinned_objects == 0
    assert jobs.totals["load_failed_jobs"] == 1
    assert jobs.index.lookup_prefix(keys(2)) == 2  # a failed load leaves the objects stored


def test_short_or_missing_prefix_offers_nothing() -> None:
    jobs = make(min_load_blocks=2)
    store_prefix(jobs, 3)
    built: list[int] = []

    def keys_upto(n: int) -> list[str]:
        built.append(n)
        return keys(n)

    # 3 blocks possible, 2 computed: one block left < min_load_blocks, keys never built
    assert jobs.lookup("r", 2 * BS, 3, keys_upto) == 0 and built == []
    # the store has k0..k2 but the request's 4th key is unknown; computed 2 -> 1 hit block
    assert jobs.lookup("r", 2 * BS, 4, keys_upto) == 0 and built == [4]
    assert jobs.index.stats().pinned_objects == 0
    assert jobs.lookup("r", 0, 4, keys_upto) == 3 * BS
    assert jobs.index.stats().pinned_objects == 3


def test_asking_again_releases_the_earlier_offer() -> None:
    jobs = make()
    store_prefix(jobs, 2)
    assert jobs.lookup("r", 0, 2, lambda n: keys(n)) == 2 * BS
    assert jobs.lookup("r", 0, 1, lambda n: keys(n)) == BS
    assert jobs.index.stats().pinned_objects == 1
    jobs.release_load("r")
    assert jobs.index.stats().pinned_objects == 0


@pytest.mark.parametrize("accepted", [0, BS, 3 * BS])
def test_an_offer_not_taken_as_made_is_released(accepted: int) -> None:
    jobs = make()
    store_prefix(jobs, 2)
    assert jobs.lookup("r", 0, 2, lambda n: keys(n)) == 2 * BS
    assert jobs.accept_load("r", accepted, [0, 1, 2]) is None
    assert jobs.index.stats().pinned_objects == 0
    assert jobs.take_loads() == [] and jobs.totals["loaded_blocks"] == 0


def test_finish_releases_an_untaken_offer_and_forgets_the_request() -> None:
    jobs = make()
    store_prefix(jobs, 2)
    assert jobs.lookup("r", 0, 2, lambda n: keys(n)) == 2 * BS
    assert "r" in jobs
    assert jobs.finish("r") == {"loaded_blocks": 0, "saved_blocks": 0, "skipped_blocks": 0,
                                "duplicate_blocks": 0, "remote_blocks": 0}
    assert "r" not in jobs and jobs.finish("r") is None
    assert jobs.index.stats().pinned_objects == 0


def test_completion_of_an_unknown_job_is_ignored() -> None:
    jobs = make()
    jobs.report({99: 1}, {98: 1})
    assert jobs.open_jobs == 0 and not jobs.totals


def test_counters_sum_requests_and_store_lookups() -> None:
    jobs = make()
    store_prefix(jobs, 2)
    jobs.lookup("r", 0, 3, lambda n: keys(n))
    c = jobs.counters()
    assert c["saved_blocks"] == 2
    assert c["lookups"] == 1 and c["hit_objects"] == 2 and c["miss_objects"] == 1
    g = jobs.store_gauges()
    assert g["stored_objects"] == 2 and g["pinned_objects"] == 2 and g["total_pages"] == 16
