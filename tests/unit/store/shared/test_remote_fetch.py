"""Fetches from the shared tier into local pages before a prefix is offered
(store/shared/remote_fetch.py), driven through the whole-prefix book the connector uses."""

from __future__ import annotations

from collections.abc import Sequence

from ascend_offload.store.book.prefix_jobs import PrefixJobs
from ascend_offload.store.local import LocalStore
from ascend_offload.store.shared.remote_fetch import RemoteFetches

BS = 4
PAGE = 64


class Tier:
    """The shared tier as the scheduler sees it: which keys the master has, up or down."""

    def __init__(self, keys: Sequence[str] = ()) -> None:
        self.keys = set(keys)
        self.up = True
        self.asked = 0

    def available(self) -> bool:
        return self.up

    def lookup_prefix(self, keys: Sequence[str]) -> int:
        self.asked += 1
        n = 0
        for k in keys:
            if k not in self.keys:
                break
            n += 1
        return n


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def keys(n: int) -> list[str]:
    return [f"k{i}" for i in range(n)]


def book(tier: Tier, pages: int = 16, world: int = 1, clock: Clock | None = None) -> PrefixJobs:
    index = LocalStore(pages * PAGE, PAGE, with_data=False)
    fetches = RemoteFetches(index, tier, page_bytes=PAGE, world_size=world, timeout_s=5.0,
                            clock=clock or Clock())
    return PrefixJobs(index, block_size=BS, page_bytes=PAGE, world_size=world, min_load_blocks=1,
                      remote=fetches)


def lookup(b: PrefixJobs, rid: str = "r", n: int = 4) -> int | None:
    return b.lookup(rid, 0, n, keys)


def test_remote_prefix_is_fetched_then_offered_locally() -> None:
    tier = Tier(keys(4))
    b = book(tier, world=2)
    f = b.remote
    assert f is not None
    assert lookup(b) is None  # wait: the ranks fetch first
    (job,) = f.take_jobs()
    assert job.keys == tuple(keys(4)) and len(set(job.pages)) == 4
    assert b.index.stats().pending_objects == 4  # reserved, not readable
    assert lookup(b) is None  # still waiting, the master is not asked again
    assert tier.asked == 1
    f.report({job.job_id: 1}, {}, {})
    assert lookup(b) is None  # one rank of two
    f.report({job.job_id: 1}, {}, {})
    assert b.index.lookup_prefix(keys(4)) == 4
    assert lookup(b) == 4 * BS  # a local hit now, pinned
    assert b.index.stats().pinned_objects == 4
    load = b.accept_load("r", 4 * BS, list(range(10, 14)))
    assert load is not None and load.pages == job.pages
    assert b.entry("r").remote_blocks == 4 and b.entry("r").loaded_blocks == 4
    assert f.counters()["remote_fetched_blocks"] == 4


def test_local_prefix_is_continued_from_the_tier() -> None:
    tier = Tier(keys(4))
    b = book(tier)
    h = b.index.allocate(keys(2), [PAGE] * 2)
    assert h is not None
    b.index.commit([x for x in h if x is not None])
    assert lookup(b) is None
    (job,) = b.remote.take_jobs()  # type: ignore[union-attr]
    assert job.keys == ("k2", "k3")
    b.remote.report({job.job_id: 1}, {}, {})  # type: ignore[union-attr]
    assert lookup(b) == 4 * BS


def test_failed_fetch_is_a_miss_and_frees_the_pages() -> None:
    tier = Tier(keys(3))
    b = book(tier, world=2)
    assert lookup(b) is None
    (job,) = b.remote.take_jobs()  # type: ignore[union-attr]
    b.remote.report({job.job_id: 1}, {job.job_id: 1}, {})  # type: ignore[union-attr]
    assert lookup(b) == 0  # recompute; the tier is not asked again for this request
    assert tier.asked == 1
    st = b.index.stats()
    assert st.pending_objects == 0 and st.free_pages == st.total_pages


def test_unsafe_failure_keeps_the_pages_out_of_use() -> None:
    b = book(Tier(keys(2)))
    assert lookup(b) is None
    (job,) = b.remote.take_jobs()  # type: ignore[union-attr]
    b.remote.report({}, {job.job_id: 1}, {job.job_id: 1})  # type: ignore[union-attr]
    assert lookup(b) == 0
    st = b.index.stats()
    assert st.pending_objects == 2 and st.free_pages == st.total_pages - 2
    assert b.remote.counters()["remote_quarantined_pages"] == 2  # type: ignore[union-attr]


def test_wait_ends_at_the_deadline() -> None:
    clock = Clock()
    b = book(Tier(keys(2)), clock=clock)
    assert lookup(b) is None
    clock.t = 4.9
    assert lookup(b) is None
    clock.t = 5.0
    assert lookup(b) == 0  # gave up: recompute; the late report still settles the job
    (job,) = b.remote.take_jobs()  # type: ignore[union-attr]
    b.remote.report({job.job_id: 1}, {}, {})  # type: ignore[union-attr]
    assert b.index.stats().pending_objects == 0
    assert b.remote.counters()["remote_fetch_wait_timeouts"] == 1  # type: ignore[union-attr]


def test_master_down_or_nothing_there_never_waits() -> None:
    tier = Tier(keys(4))
    tier.up = False
    b = book(tier)
    assert lookup(b) == 0 and tier.asked == 0
    b2 = book(Tier([]))
    assert lookup(b2) == 0
    assert b2.remote.take_jobs() == []  # type: ignore[union-attr]


def test_full_local_pages_skip_the_fetch() -> None:
    b = book(Tier(keys(4)), pages=2)
    h = b.index.allocate(["x", "y"], [PAGE] * 2)  # pending saves hold every page
    assert h is not None
    assert lookup(b) == 0
    assert b.remote.take_jobs() == []  # type: ignore[union-attr]


def test_fetch_stops_at_a_block_pending_locally() -> None:
    b = book(Tier(keys(4)))
    assert b.index.allocate(["k2"], [PAGE]) is not None  # another request is saving k2
    assert lookup(b) is None
    (job,) = b.remote.take_jobs()  # type: ignore[union-attr]
    assert job.keys == ("k0", "k1")
    assert b.index.stats().pending_objects == 3  # k0, k1 fetched; k2 the other save


def test_finished_request_leaves_nothing_behind() -> None:
    b = book(Tier(keys(2)))
    assert lookup(b) is None
    b.finish("r")
    (job,) = b.remote.take_jobs()  # type: ignore[union-attr]
    b.remote.report({job.job_id: 1}, {}, {})  # type: ignore[union-attr]
    st = b.index.stats()
    assert st.pinned_objects == 0 and st.pending_objects == 0 and st.stored_objects == 2
    assert b.remote.open_jobs == 0  # type: ignore[union-attr]
