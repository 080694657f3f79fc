"""ResidencyTracker over PrefixJobs and the index: a preempted request's blocks come
back from the store, wait for their own saves (with a deadline), and are recomputed
when the store lost them. Driven with plain keys, block ids and an injected clock."""

from __future__ import annotations

from ascend_offload.store.book.preemption import ResidencyTracker, State
from ascend_offload.store.book.prefix_jobs import CopyJob, PrefixJobs
from ascend_offload.store.local import LocalStore

PAGE = 64
BS = 4  # tokens per block


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(num_pages: int = 16, world_size: int = 2) -> tuple[PrefixJobs, ResidencyTracker, Clock]:
    jobs = PrefixJobs(LocalStore(num_pages * PAGE, PAGE, with_data=False), block_size=BS,
                      page_bytes=PAGE, world_size=world_size, min_load_blocks=1)
    clock = Clock()
    return jobs, ResidencyTracker(save_timeout_s=5.0, clock=clock), clock


def keys(n: int) -> list[str]:
    return [f"k{i}" for i in range(n)]


def pending(jobs: PrefixJobs):  # the scheduler's question, as the connector asks it
    return lambda k: jobs.index.has(k) and not jobs.index.is_committed(k)


def report_all(jobs: PrefixJobs, job: CopyJob, ok: bool = True) -> None:
    for _ in range(jobs.world_size):
        jobs.report({job.job_id: 1} if ok else {}, {} if ok else {job.job_id: 1})


def resume(jobs: PrefixJobs, res: ResidencyTracker, rid: str, n_keys: int, max_blocks: int) -> int:
    """vLLM's re-admission: lookup, allocation of 10.. block ids, the tracker's accounting."""
    hit = jobs.lookup(rid, 0, max_blocks, lambda upto: keys(upto)[:upto])
    assert hit is not None
    job = jobs.accept_load(rid, hit, list(range(10, 10 + max_blocks)))
    loaded = len(job.block_ids) if job else 0
    res.resume(rid, 0, loaded)
    jobs.rewind_saves(rid, loaded)
    return loaded


def test_preempted_request_resumes_every_block_from_the_store() -> None:
    jobs, res, _ = make()
    save = jobs.plan_save("r", keys(3), [1, 2, 3])
    assert save is not None
    report_all(jobs, save)
    assert res.preempt("r", 1, keys(3), pending(jobs))
    assert res.state("r") is State.STORED
    assert not res.wait_for_saves("r", pending(jobs))
    assert resume(jobs, res, "r", 3, 3) == 3
    assert res.state("r") is State.LOADING
    (load,) = jobs.take_loads()
    assert load.block_ids == (10, 11, 12)
    report_all(jobs, load)
    for rid, ok in jobs.settled_loads:
        res.loaded(rid, ok)
    assert res.state("r") is State.DEVICE
    assert res.counters() == {"preempted_requests": 1, "resumed_blocks": 3, "recomputed_blocks": 0,
                              "preempt_save_waits": 0}
    assert jobs.index.stats().pinned_objects == 0  # the load's pin went with its report
    assert res.forget("r") == {"preempted_requests": 1, "resumed_blocks": 3, "recomputed_blocks": 0,
                               "preempt_save_waits": 0}


def test_resumption_waits_for_its_own_saves_then_loads_them() -> None:
    jobs, res, clock = make()
    save = jobs.plan_save("r", keys(2), [1, 2])  # computed by the step still in flight
    assert save is not None
    res.preempt("r", 1, keys(2), pending(jobs))
    assert res.state("r") is State.SAVING
    assert res.wait_for_saves("r", pending(jobs))  # ask later
    clock.now += 1.0
    assert res.wait_for_saves("r", pending(jobs))
    assert res.counters()["preempt_save_waits"] == 1  # one wait, however many asks
    report_all(jobs, save)
    assert not res.wait_for_saves("r", pending(jobs))
    assert res.state("r") is State.STORED
    assert resume(jobs, res, "r", 2, 2) == 2


def test_saves_that_never_settle_are_recomputed_after_the_deadline() -> None:
    jobs, res, clock = make()
    first = jobs.plan_save("r", keys(1), [1])
    assert first is not None
    report_all(jobs, first)
    stuck = jobs.plan_save("r", keys(3), [1, 2, 3])  # one rank never reports
    assert stuck is not None
    jobs.report({stuck.job_id: 1}, {})
    res.preempt("r", 1, keys(3), pending(jobs))
    assert res.wait_for_saves("r", pending(jobs))
    clock.now += 5.0
    assert not res.wait_for_saves("r", pending(jobs))  # deadline: admit, never serve pending
    assert resume(jobs, res, "r", 3, 3) == 1
    assert res.counters()["recomputed_blocks"] == 2
    # the recomputed blocks are planned again (the pending ones count as duplicates)
    again = jobs.plan_save("r", keys(3), [10, 11, 12])
    assert again is None and jobs.entry("r").duplicate_blocks == 2


def test_blocks_the_store_lost_are_recomputed_never_served() -> None:
    jobs, res, _ = make(num_pages=3)
    save = jobs.plan_save("r", keys(3), [1, 2, 3])
    assert save is not None
    report_all(jobs, save)
    res.preempt("r", 1, keys(3), pending(jobs))
    other = jobs.plan_save("o", [f"o{i}" for i in range(2)], [7, 8])  # evicts k0, k1 (LRU)
    assert other is not None
    assert resume(jobs, res, "r", 3, 3) == 0  # k0 gone: the prefix stops there
    assert res.state("r") is State.DEVICE
    assert res.counters()["recomputed_blocks"] == 3 and res.counters()["resumed_blocks"] == 0


def test_device_cache_hit_is_neither_resumed_nor_recomputed() -> None:
    jobs, res, _ = make()
    res.preempt("r", 1, keys(4), pending(jobs))  # nothing was ever stored
    res.resume("r", device_blocks=3, loaded_blocks=0)
    assert res.counters()["recomputed_blocks"] == 1


def test_a_failed_load_counts_as_recomputed() -> None:
    jobs, res, _ = make()
    save = jobs.plan_save("r", keys(2), [1, 2])
    assert save is not None
    report_all(jobs, save)
    res.preempt("r", 1, keys(2), pending(jobs))
    resume(jobs, res, "r", 2, 2)
    (load,) = jobs.take_loads()
    report_all(jobs, load, ok=False)
    assert jobs.settled_loads == [("r", False)]
    res.loaded("r", False)
    assert res.counters()["recomputed_blocks"] == 2 and res.counters()["resumed_blocks"] == 0


def test_one_preemption_is_registered_once() -> None:
    _, res, _ = make()
    assert res.preempt("r", 1, keys(2), lambda k: False)
    assert not res.preempt("r", 1, keys(2), lambda k: False)  # seen again in build_connector_meta
    assert res.preempt("r", 2, keys(3), lambda k: False)  # a second preemption
    assert res.counters()["preempted_requests"] == 2
    assert res.forget("never") == {}


def test_reset_marks_preempted_requests_lost_and_drops_loads_in_flight() -> None:
    jobs, res, _ = make()
    save = jobs.plan_save("a", keys(2), [1, 2])
    assert save is not None
    report_all(jobs, save)
    res.preempt("a", 1, keys(2), pending(jobs))
    res.preempt("b", 1, keys(2), pending(jobs))
    resume(jobs, res, "b", 2, 2)
    assert res.state("b") is State.LOADING
    assert res.reset() == 1
    assert res.state("a") is State.LOST and res.state("b") is State.DEVICE
    jobs.reset()
    assert resume(jobs, res, "a", 2, 2) == 0
    assert res.counters()["recomputed_blocks"] == 2 and res.counters()["resumed_blocks"] == 0


def test_a_request_never_preempted_is_untouched() -> None:
    _, res, _ = make()
    res.resume("r", 0, 5)
    res.loaded("r", True)
    assert res.state("r") is State.DEVICE
    assert sum(res.counters().values()) == 0
