"""The SSD tier's internal pins are not uses: a write-behind spill holds its host object
(``SsdJobs.plan_spills``) and a promote holds the host prefix while it reserves pages
(``TierWaits._reserve``), and neither may promote the object in the host eviction
policy. Otherwise every spilled block counts as a hit (ARC: T1 -> T2, scan resistance
gone; LRU: every spill refreshes its block).

The trace is ``bench store``'s scan + loop (``ascend_offload/bench/store_policy.py``)
replayed through the scheduler's host index with the SSD tier's spills running after
every request and completing at once (every rank reported)."""

from __future__ import annotations

from ascend_offload.bench.store_policy import Trace, scan_loop_trace
from ascend_offload.store.local import LocalStore
from ascend_offload.store.ssd.index import SsdIndex
from ascend_offload.store.ssd.jobs import SsdJobs

CAPACITY = 1024


def replay(trace: Trace, eviction: str, ssd: bool) -> float:
    """Host-index block hit rate of ``trace`` (lookups, hit pins, saves), with the SSD
    tier's spills of every committed save when ``ssd``."""
    index = LocalStore(CAPACITY, 1, eviction, with_data=False)
    jobs = None
    if ssd:
        jobs = SsdJobs(index, SsdIndex(4 * CAPACITY, eviction), page_bytes=1, world_size=1,
                       timeout_s=5.0, max_inflight=CAPACITY // 2)
    for _, keys in trace:
        n = index.lookup_prefix(keys)
        if n:
            pin = index.pin(keys[:n])
            if pin is not None:
                index.unpin(pin)
        if n < len(keys):
            tail = keys[n:]
            handles = index.allocate(tail, [1] * len(tail))
            if handles is not None:
                owned = [h for h in handles if h is not None]
                index.commit(owned)
                if jobs is not None:
                    jobs.watch(h.key for h in owned)
        if jobs is not None:  # the step: spills sent, written by every rank at once
            jobs.plan_spills()
            for job in jobs.take_spills():
                jobs.report_spills({job.job_id: 1}, {})
    s = index.stats()
    return s.hit_objects / max(1, s.hit_objects + s.miss_objects)


def test_spills_keep_arcs_scan_resistance() -> None:
    trace = scan_loop_trace(CAPACITY, rounds=12)
    without = replay(trace, "arc", ssd=False)
    with_ssd = replay(trace, "arc", ssd=True)
    assert without > 0.1  # the trace is one ARC resists (LRU keeps nothing of the loop)
    assert abs(with_ssd - without) <= 0.01, (with_ssd, without)


def test_a_spill_does_not_refresh_a_block_in_lru_order() -> None:
    index = LocalStore(2, 1, "lru", with_data=False)
    jobs = SsdJobs(index, SsdIndex(8), page_bytes=1, world_size=1, timeout_s=5.0, max_inflight=8)
    for key in ("a", "b"):
        handles = index.allocate([key], [1])
        assert handles is not None and handles[0] is not None
        index.commit([handles[0]])
    jobs.watch(["a"])
    jobs.plan_spills()
    (job,) = jobs.take_spills()
    jobs.report_spills({job.job_id: 1}, {})
    assert index.allocate(["c"], [1]) is not None
    assert not index.has("a") and index.has("b")  # a is still the least recently used


def test_a_spill_pin_leaves_the_block_in_t1() -> None:
    index = LocalStore(8, 1, "arc", with_data=False)
    jobs = SsdJobs(index, SsdIndex(8, "arc"), page_bytes=1, world_size=1, timeout_s=5.0, max_inflight=8)
    handles = index.allocate(["a", "b"], [1, 1])
    assert handles is not None
    index.commit([h for h in handles if h is not None])
    jobs.watch(["a", "b"])
    jobs.plan_spills()
    (job,) = jobs.take_spills()
    jobs.report_spills({job.job_id: 1}, {})
    assert index._policy.sizes()[:2] == (2, 0)  # type: ignore[attr-defined]  # |T1|, |T2|


def test_a_promotes_guard_pin_is_not_a_hit() -> None:
    """``_reserve`` pins the host prefix so allocating the promote's pages cannot evict
    it; that guard is not a read of the prefix (the offer's own pin is)."""
    index = LocalStore(8, 1, "arc", with_data=False)
    ssd = SsdIndex(8, "arc")
    jobs = SsdJobs(index, ssd, page_bytes=1, world_size=1, timeout_s=5.0, max_inflight=8)
    handles = index.allocate(["a"], [1])
    assert handles is not None and handles[0] is not None
    index.commit([handles[0]])
    ssd.allocate(["b"])
    ssd.mark_ready(["b"])
    assert jobs.consult("r", ["a", "b"], 1)  # promote of b started behind the host hit a
    assert index._policy.sizes()[:2] == (1, 0)  # type: ignore[attr-defined]
