"""Scheduler-side SSD bookkeeping (store/ssd/jobs.py) driven through the whole-prefix
book the connector uses: write-behind spills pin the host object until every rank
wrote; promotes fetch first and offer after; a slot that failed verification on any
rank is a miss from that block on, dropped and counted."""

from __future__ import annotations

from ascend_offload.store.book.prefix_jobs import PrefixJobs
from ascend_offload.store.local import LocalStore
from ascend_offload.store.ssd.index import SsdIndex
from ascend_offload.store.ssd.jobs import SsdJobs

BS = 4
PAGE = 64


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def keys(n: int, p: str = "k") -> list[str]:
    return [f"{p}{i}" for i in range(n)]


def setup(pages: int = 8, slots: int = 16, world: int = 1, inflight: int = 64,
          clock: Clock | None = None) -> tuple[PrefixJobs, SsdJobs]:
    index = LocalStore(pages * PAGE, PAGE, with_data=False)
    jobs = SsdJobs(index, SsdIndex(slots), page_bytes=PAGE, world_size=world, timeout_s=5.0,
                   max_inflight=inflight, clock=clock or Clock())
    book = PrefixJobs(index, block_size=BS, page_bytes=PAGE, world_size=world, min_load_blocks=1, remote=jobs)
    return book, jobs


def save(book: PrefixJobs, jobs: SsdJobs, rid: str, ks: list[str], world: int = 1) -> None:
    """A request saves ``ks`` and every rank reports the copy (committed in the host index)."""
    job = book.plan_save(rid, ks, list(range(len(ks))))
    assert job is not None
    jobs.watch(job.keys)
    book.report({job.job_id: world}, {})


def spill_all(jobs: SsdJobs, world: int = 1) -> list[str]:
    jobs.plan_spills()
    out = []
    for job in jobs.take_spills():
        jobs.report_spills({job.job_id: world}, {})
        out += job.keys
    return out


def test_committed_blocks_are_spilled_behind_and_pinned_until_every_rank_wrote() -> None:
    book, jobs = setup(pages=4, world=2)
    save(book, jobs, "a", keys(2), world=2)
    jobs.plan_spills()
    (job,) = jobs.take_spills()
    assert job.keys == ("k0", "k1") and job.pages == tuple(book.index.pages(k)[0] for k in job.keys)
    assert book.index.stats().pinned_objects == 2
    assert jobs.ssd.lookup_prefix(keys(2)) == 0  # writing: not found yet
    # the host fills up: the pinned objects are never the ones evicted
    save(book, jobs, "b", keys(2, "x"), world=2)
    assert book.index.allocate(keys(3, "y"), [PAGE] * 3) is None  # only x0, x1 could make room
    assert book.index.is_committed("k0") and book.index.is_committed("k1")
    jobs.report_spills({job.job_id: 1}, {})
    assert book.index.stats().pinned_objects == 2 and jobs.ssd.lookup_prefix(keys(2)) == 0
    jobs.report_spills({job.job_id: 1}, {})
    assert book.index.stats().pinned_objects == 0
    assert jobs.ssd.lookup_prefix(keys(2)) == 2
    assert jobs.counters()["ssd_spilled_blocks"] == 2
    assert spill_all(jobs, world=2) == ["x0", "x1"]  # each key is spilled once
    assert spill_all(jobs, world=2) == []


def test_failed_write_on_one_rank_frees_the_slots() -> None:
    book, jobs = setup(world=2)
    save(book, jobs, "a", keys(3), world=2)
    jobs.plan_spills()
    (job,) = jobs.take_spills()
    jobs.report_spills({job.job_id: 1}, {job.job_id: 1})
    assert jobs.ssd.used_slots == 0 and len(jobs.ssd) == 0
    assert book.index.stats().pinned_objects == 0
    c = jobs.counters()
    assert c["ssd_spill_failed"] == 3 and c["ssd_spilled_blocks"] == 0


def test_inflight_spills_are_bounded_and_the_rest_waits() -> None:
    book, jobs = setup(inflight=2)
    save(book, jobs, "a", keys(5))
    jobs.plan_spills()
    (job,) = jobs.take_spills()
    assert len(job.keys) == 2
    jobs.plan_spills()
    assert jobs.take_spills() == []
    jobs.report_spills({job.job_id: 1}, {})
    assert spill_all(jobs) == ["k2", "k3"]
    assert spill_all(jobs) == ["k4"]


def test_lookup_continues_the_host_prefix_on_the_tier_and_offers_only_after_promote() -> None:
    book, jobs = setup(pages=4, slots=16)
    save(book, jobs, "a", keys(4))
    assert spill_all(jobs) == keys(4)
    save(book, jobs, "b", keys(4, "x"))  # pushes k* out of the 4 host pages
    assert book.index.lookup_prefix(keys(4)) == 0
    assert book.lookup("r", 0, 4, lambda n: keys(n)) is None  # ask later: a promote runs
    (job,) = jobs.take_promotes()
    assert job.keys == tuple(keys(4)) and job.slots == tuple(jobs.ssd.slot(k) for k in keys(4))
    assert book.lookup("r", 0, 4, lambda n: keys(n)) is None  # still waiting
    jobs.report_promotes({(job.job_id, 4): 1}, {})
    assert book.lookup("r", 0, 4, lambda n: keys(n)) == 4 * BS
    load = book.accept_load("r", 4 * BS, list(range(10, 14)))
    assert load is not None and load.pages == job.pages
    assert book.finish("r")["remote_blocks"] == 4  # of loaded_blocks: brought in from the tier
    c = jobs.counters()
    assert c["ssd_hit_blocks"] == 4 and c["ssd_promoted_blocks"] == 4 and c["ssd_checksum_failures"] == 0


def test_corrupt_slot_on_one_rank_is_a_miss_from_that_block_on() -> None:
    book, jobs = setup(pages=8, world=2)
    save(book, jobs, "a", keys(4), world=2)
    spill_all(jobs, world=2)
    book.index.discard(keys(4))  # the host lost them
    assert book.lookup("r", 0, 4, lambda n: keys(n)) is None
    (job,) = jobs.take_promotes()
    jobs.report_promotes({(job.job_id, 4): 1}, {})  # rank 0: all four verified
    jobs.report_promotes({(job.job_id, 1): 1}, {"k1": 1})  # rank 1: k1's slot failed verification
    assert book.lookup("r", 0, 4, lambda n: keys(n)) == 1 * BS  # k0 only; k1.. are recomputed
    assert "k1" not in jobs.ssd and jobs.ssd.is_ready("k2")  # the bad slot is forgotten, not the rest
    assert book.index.stats().pending_objects == 0  # the reserved pages of k1..k3 went back
    c = jobs.counters()
    assert c["ssd_checksum_failures"] == 1 and c["ssd_promoted_blocks"] == 1
    book.release_load("r")
    # another request finds k0 on the host and stops at the dropped k1
    assert book.lookup("s", 0, 4, lambda n: keys(n)) == 1 * BS
    assert jobs.take_promotes() == []


def test_slots_being_read_are_never_evicted_for_a_spill() -> None:
    book, jobs = setup(pages=8, slots=2)
    save(book, jobs, "a", keys(2))
    spill_all(jobs)
    book.index.discard(keys(2))
    assert book.lookup("r", 0, 2, lambda n: keys(n)) is None
    (job,) = jobs.take_promotes()
    save(book, jobs, "b", keys(2, "x"))
    jobs.plan_spills()
    assert jobs.take_spills() == []  # both slots pinned by the promote: nothing to spill into
    assert jobs.counters()["ssd_spill_skipped"] == 2
    jobs.report_promotes({(job.job_id, 2): 1}, {})
    assert book.lookup("r", 0, 2, lambda n: keys(n)) == 2 * BS


def test_a_request_never_waits_past_the_deadline() -> None:
    clock = Clock()
    book, jobs = setup(clock=clock)
    save(book, jobs, "a", keys(2))
    spill_all(jobs)
    book.index.discard(keys(2))
    assert book.lookup("r", 0, 2, lambda n: keys(n)) is None
    (job,) = jobs.take_promotes()
    clock.t = 5.0
    assert book.lookup("r", 0, 2, lambda n: keys(n)) == 0  # recomputed
    assert jobs.counters()["ssd_promote_wait_timeouts"] == 1
    jobs.report_promotes({(job.job_id, 2): 1}, {})  # settles later, for the next request
    assert book.lookup("s", 0, 2, lambda n: keys(n)) == 2 * BS


def test_unknown_reports_are_ignored() -> None:
    _book, jobs = setup()
    jobs.report_spills({99: 1}, {98: 1})
    jobs.report_promotes({(97, 3): 1}, {"nope": 1})
    assert jobs.open_jobs == 0 and jobs.ssd.used_slots == 0


def test_reset_forgets_the_tier_and_a_spill_in_flight_never_becomes_ready() -> None:
    book, jobs = setup(pages=8, slots=4)
    save(book, jobs, "a", keys(2))
    assert spill_all(jobs) == keys(2)
    save(book, jobs, "b", keys(2, "x"))
    jobs.plan_spills()
    (inflight,) = jobs.take_spills()  # x0, x1 being written when the reset comes
    book.reset()
    assert jobs.reset() == 2  # k0, k1 forgotten
    assert jobs.ssd.lookup_prefix(keys(2)) == 0 and jobs.ssd.used_slots == 2  # x0, x1 keep their slots
    jobs.report_spills({inflight.job_id: 1}, {})  # the pre-reset write lands afterwards
    assert "x0" not in jobs.ssd and jobs.ssd.used_slots == 0  # freed, never made ready
    assert jobs.counters()["ssd_spilled_blocks"] == 2  # only the pre-reset k0, k1
    assert book.lookup("r", 0, 2, lambda n: keys(n, "x")) == 0  # no pre-reset block offered
    assert jobs.take_promotes() == []


def test_reset_with_a_promote_open_commits_none_of_its_pages() -> None:
    book, jobs = setup(pages=8, slots=4)
    save(book, jobs, "a", keys(2))
    spill_all(jobs)
    book.index.discard(keys(2))
    assert book.lookup("r", 0, 2, lambda n: keys(n)) is None
    (job,) = jobs.take_promotes()
    book.reset()
    jobs.reset()
    jobs.report_promotes({(job.job_id, 2): 1}, {})  # the ranks read the slots before the reset
    assert book.index.lookup_prefix(keys(2)) == 0  # nothing committed into the new index
    assert book.index.stats().pending_objects == 0  # its reserved pages went back
    assert jobs.counters()["ssd_promoted_blocks"] == 0 and jobs.open_jobs == 0
