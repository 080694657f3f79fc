"""Store reset with work in flight: the index forgets, open jobs are settled, and the
ranks' reports of pre-reset jobs never commit into the post-reset index (epoch fence).

The rules are driven on the vLLM-free classes (LocalStore, PrefixJobs,
LayerwiseSaves); the last tests drive the connector's PrefixScheduler with plain
stand-ins for vLLM's request and scheduler-output fields it reads."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Any

from ascend_offload.store.book.layerwise_saves import LayerwiseSaves
from ascend_offload.store.book.prefix_jobs import PrefixJobs
from ascend_offload.store.local import LocalStore
from tests.support.scheduler_inputs import request as _new_request
from tests.support.scheduler_inputs import step as _step

PAGE = 64
BS = 4



def _request(rid: str, n_tokens: int) -> SimpleNamespace:
    return _new_request(rid, n_tokens, BS)

def index(num_pages: int = 8) -> LocalStore:
    return LocalStore(num_pages * PAGE, PAGE, with_data=False)


def keys(n: int, prefix: str = "k") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


# ------------------------------------------------------------------ LocalStore.clear


def test_clear_drops_committed_and_pinned_keeps_pending_and_makes_old_pins_inert() -> None:
    ix = index(4)
    done = ix.allocate(keys(2), [PAGE] * 2)
    assert done is not None
    ix.commit([h for h in done if h is not None])
    old_pin = ix.pin(["k0"])
    assert old_pin is not None
    (pending,) = ix.allocate(["p"], [PAGE]) or [None]
    assert pending is not None
    ix.take_freed()
    assert ix.clear() == 2
    assert ix.lookup_prefix(keys(2)) == 0 and not ix.has("k0")
    assert sorted(ix.take_freed()) == ["k0", "k1"]
    st = ix.stats()
    assert (st.stored_objects, st.pinned_objects, st.pending_objects, st.free_pages) == (0, 0, 1, 3)
    # the same key stored again and pinned: the pre-clear pin's release must not touch it
    (h,) = ix.allocate(["k0"], [PAGE]) or [None]
    assert h is not None
    ix.commit([h])
    new_pin = ix.pin(["k0"])
    assert new_pin is not None
    ix.unpin(old_pin)
    assert ix.stats().pinned_objects == 1
    ix.unpin(new_pin)
    # the pending object's writer still settles it normally
    ix.abort([pending])
    assert ix.stats().pending_objects == 0 and ix.stats().free_pages == 3


# ------------------------------------------------------------------ PrefixJobs


def test_prefix_reset_aborts_open_saves_and_fences_their_reports() -> None:
    jobs = PrefixJobs(index(), block_size=BS, page_bytes=PAGE, world_size=2, min_load_blocks=1)
    stored = jobs.plan_save("a", keys(2), [1, 2])
    assert stored is not None
    for _ in range(2):
        jobs.report({stored.job_id: 1}, {})
    open_save = jobs.plan_save("b", keys(3, "b"), [5, 6, 7])
    assert open_save is not None
    jobs.report({open_save.job_id: 1}, {})  # one rank of two reported before the reset
    assert jobs.lookup("c", 0, 2, lambda n: keys(n)) == 2 * BS  # an offer in flight
    old_epoch = jobs.epoch
    assert jobs.reset() == 2
    assert jobs.epoch == old_epoch + 1
    st = jobs.index.stats()
    assert (st.stored_objects, st.pending_objects, st.pinned_objects, st.free_pages) == (0, 0, 0, 8)
    assert jobs.accept_load("c", 2 * BS, [9, 9]) is None  # the offer went with the reset
    # the same blocks saved again after the reset, into pages the old job named
    again = jobs.plan_save("b", keys(3, "b"), [5, 6, 7])
    assert again is not None and again.job_id != open_save.job_id
    # the second rank's late report of the pre-reset job: wrong epoch, dropped
    assert not jobs.current(old_epoch)
    assert jobs.totals["stale_reports"] == 1
    assert jobs.index.lookup_prefix(keys(3, "b")) == 0  # nothing committed from it
    assert jobs.current(jobs.epoch)
    for _ in range(2):
        jobs.report({again.job_id: 1}, {})
    assert jobs.index.lookup_prefix(keys(3, "b")) == 3
    assert jobs.totals["store_resets"] == 1


# ------------------------------------------------------------------ LayerwiseSaves


def test_layerwise_stale_report_of_a_key_placed_again_cannot_commit_it() -> None:
    book = LayerwiseSaves(index(), block_size=BS, page_bytes=PAGE, world_size=1, min_load_blocks=1,
                          partial_prefix="partial:")
    assert book.place("r", ["K"]) == ["K"]
    old_epoch = book.epoch
    book.reset()
    assert book.place("r", ["K"]) == ["K"]  # placed again: its ranks have not written it yet
    # the pre-reset write of K reports done: keyed by block, so only the epoch tells them apart
    if book.current(old_epoch):
        book.report({"K": 1}, {})
    assert not book.index.is_committed("K") and book.saving == frozenset({"K"})
    if book.current(book.epoch):
        book.report({"K": 1}, {})
    assert book.index.is_committed("K")


# ------------------------------------------------------------------ the scheduler connector


def _scheduler(num_pages: int = 16, save_timeout_s: float = 30.0) -> Any:
    from ascend_offload.config import parse_extra_config
    from ascend_offload.connectors.store.scheduler import PrefixScheduler
    from ascend_offload.connectors.store.settings import NAME, StoreSettings

    cfg = parse_extra_config(NAME, {"save_timeout_s": save_timeout_s})
    settings = StoreSettings(cfg=cfg, block_size=BS, hash_ratio=1, object_bytes=PAGE, page_bytes=PAGE,
                             num_pages=num_pages, world_size=1, fingerprint="fp", engine_id="e")
    tables: dict[str, list[int]] = {}
    sched = PrefixScheduler(settings, lambda rid: tables[rid])
    return sched, tables





def _report(sched: Any, meta: Any, failed: bool = False) -> None:
    from vllm.v1.outputs import KVConnectorOutput

    from ascend_offload.connectors.store.metadata import StoreWorkerMetadata

    ids = Counter({j.job_id: 1 for j in (*meta.loads, *meta.saves)})
    wm = StoreWorkerMetadata(done=Counter() if failed else ids, failed=ids if failed else Counter(),
                             epoch=meta.epoch)
    sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=wm))


def _blocks(ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(get_block_ids=lambda: (ids,))


def test_preempted_request_waits_for_its_saves_then_resumes_every_block() -> None:
    sched, tables = _scheduler()
    req = _request("r", 17)  # 4 full blocks + 1 token
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    tables["r"] = [10, 11, 12, 13, 14]
    sched.update_state_after_alloc(req, _blocks(tables["r"]), 0)
    step1 = sched.build_connector_meta(_step(new=[("r", 0, 16)]))
    assert [len(j.block_ids) for j in step1.saves] == [4]
    # vLLM preempts it before step1's report arrived (async scheduling)
    req.num_preemptions, req.num_computed_tokens = 1, 0
    step2 = sched.build_connector_meta(_step(preempted={"r"}))
    assert step2.preempted == 1 and not step2.saves
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)  # its saves are in flight
    _report(sched, step1)
    assert sched.get_num_new_matched_tokens(req, 0) == (16, False)
    tables["r"] = [20, 21, 22, 23, 24]
    sched.update_state_after_alloc(req, _blocks(tables["r"]), 16)
    step3 = sched.build_connector_meta(_step(cached=[("r", 16, 1)]))
    assert [j.block_ids for j in step3.loads] == [(20, 21, 22, 23)]
    _report(sched, step3)
    _, params = sched.request_finished(req)
    st = params["ascend_store"]
    assert (st["preempted_requests"], st["resumed_blocks"], st["recomputed_blocks"],
            st["preempt_save_waits"]) == (1, 4, 0, 1)
    stats = sched.stats().data
    assert stats["resumed_blocks"] == 4 and stats["preempted_requests"] == 1


def test_reset_with_a_save_in_flight_no_pre_reset_block_is_served() -> None:
    sched, tables = _scheduler()
    a = _request("a", 9)
    sched.get_num_new_matched_tokens(a, 0)
    tables["a"] = [1, 2, 3]
    sched.update_state_after_alloc(a, _blocks(tables["a"]), 0)
    step1 = sched.build_connector_meta(_step(new=[("a", 0, 8)]))
    assert step1.epoch == 0 and step1.saves
    assert sched.reset_cache() is True  # the save of step1 is still running on the ranks
    _report(sched, step1)  # its report arrives after the reset: epoch 0, dropped
    b = _request("b", 9)
    b.block_hashes = list(a.block_hashes)  # same prefix
    assert sched.get_num_new_matched_tokens(b, 0) == (0, False)
    assert sched.index.stats().stored_objects == 0
    # saved again in the new epoch, a later request hits it
    tables["b"] = [4, 5, 6]
    sched.update_state_after_alloc(b, _blocks(tables["b"]), 0)
    step2 = sched.build_connector_meta(_step(new=[("b", 0, 8)]))
    assert step2.epoch == 1 and step2.saves
    _report(sched, step2)
    c = _request("c", 9)
    c.block_hashes = list(a.block_hashes)
    assert sched.get_num_new_matched_tokens(c, 0) == (8, False)
    assert sched.stats().data["stale_reports"] == 1


def test_multi_connector_resets_every_child_and_fails_if_one_fails() -> None:
    from ascend_offload.connectors.multi import AscendMultiConnector

    calls: list[str] = []

    class Child:
        def __init__(self, name: str, answer: bool | None) -> None:
            self.name, self.answer = name, answer

        def reset_cache(self) -> bool | None:
            calls.append(self.name)
            return self.answer

        def handle_preemptions(self, meta: Any) -> None:
            calls.append(f"{self.name}:{meta}")

    multi = object.__new__(AscendMultiConnector)
    multi._connectors = [Child("store", False), Child("rd2h", None)]
    assert multi.reset_cache() is False
    assert calls == ["store", "rd2h"]  # the second child is reset although the first failed
    multi._connectors = [Child("a", True), Child("b", None)]
    assert multi.reset_cache() is True
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
        MultiKVConnectorMetadata,
    )

    calls.clear()
    multi.handle_preemptions(MultiKVConnectorMetadata(metadata=("m0", "m1")))
    assert calls == ["a:m0", "b:m1"]


def test_prefix_worker_save_reads_the_block_before_the_next_step_can_reuse_it() -> None:
    """The ordering the preemption fence relies on: a block saved in step N is copied to
    its page inside step N's ``wait_for_save``; step N+1 (``handle_preemptions`` first,
    then vLLM's reuse of the freed block) cannot change what the page holds. The ranks
    echo the epoch of the step they ran."""
    import torch

    from ascend_offload.connectors.store.metadata import CopyJob, StoreConnectorMetadata
    from ascend_offload.connectors.store.worker import PrefixWorker

    kv = {"l0": torch.randn(6, 2, 4, 8)}
    settings = SimpleNamespace(num_pages=4, page_bytes=None, shared_tier=False, ssd_tier=False)
    worker = PrefixWorker(settings, None, SimpleNamespace(num_blocks=6, kv_cache_groups=[]))  # type: ignore[arg-type]
    worker.register_kv_caches(kv)
    saved = kv["l0"][3].clone()
    step_n = StoreConnectorMetadata(saves=[CopyJob(1, (3,), (2,))], epoch=1)
    worker.start_load_kv(step_n)
    worker.wait_for_save(step_n)
    meta = worker.build_worker_meta()
    assert meta is not None and meta.done == {1: 1} and meta.epoch == 1
    step_n1 = StoreConnectorMetadata(loads=[CopyJob(2, (5,), (2,))], epoch=1, preempted=1)
    worker.handle_preemptions(step_n1)
    kv["l0"][3].fill_(7.0)  # vLLM hands the preempted request's block to another request
    worker.start_load_kv(step_n1)
    assert torch.equal(kv["l0"][5], saved)  # the page kept what step N computed


def test_reset_is_refused_while_a_request_runs_on_pre_reset_kv() -> None:
    """Its later saves would bring blocks computed before the reset into the new index."""
    sched, tables = _scheduler()
    r = _request("r", 9)
    sched.get_num_new_matched_tokens(r, 0)
    tables["r"] = [1, 2, 3]
    sched.update_state_after_alloc(r, _blocks(tables["r"]), 0)
    step = sched.build_connector_meta(_step(new=[("r", 0, 8)]))
    _report(sched, step)
    r.num_computed_tokens = 8
    assert sched.reset_cache() is False
    assert sched.index.stats().stored_objects == 2 and sched.book.epoch == 0
    r.num_computed_tokens, r.num_preemptions = 0, 1  # reset_running_requests=True preempts it
    assert sched.reset_cache() is True
    assert sched.index.stats().stored_objects == 0 and sched.book.epoch == 1
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    sched.update_state_after_alloc(r, _blocks([4, 5, 6]), 0)
    _, params = sched.request_finished(r)
    assert params["ascend_store"]["recomputed_blocks"] == 2  # lost with the reset
