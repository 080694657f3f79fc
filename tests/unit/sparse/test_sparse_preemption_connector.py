"""Preemption through the sparse decode connector's scheduler and worker objects (what
``AscendSparseDecodeConnector`` and the RD2H decode call), without an engine: vLLM's
scheduler outputs are stand-ins with the fields vLLM 0.32 fills, the KV caches a cut
main-KV view plus a real indexer cache. Imports vLLM's connector base."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ascend_offload.config import SparseOffloadConfig
from ascend_offload.connectors.sparse_decode.scheduler import SparseDecodeScheduler
from ascend_offload.connectors.sparse_decode.settings import SparseDecodeSettings
from ascend_offload.connectors.sparse_decode.worker import SparseDecodeWorker
from ascend_offload.sparse.adapter import BatchRow
from ascend_offload.sparse.preemption import PreemptState, ResumeOrder, StashOrder

BS = 4
ROW = 3
IDX = 5
NUM_BLOCKS = 16
MAIN, INDEXER = "model.layers.0.self_attn.attn", "model.layers.0.self_attn.indexer.k_cache"


def _settings(pool_blocks: int = 32, paged: bool = False) -> SparseDecodeSettings:
    cfg = SparseOffloadConfig(enabled=True, topk_buffer_size=8, index_topk=4,
                              dram_size_per_dp_GB=pool_blocks * BS * ROW * 4 / 2**30)
    return SparseDecodeSettings(cfg, 4, BS, 64, 2, (MAIN,), 0, ROW * 4, pool_blocks, paged,
                                ((INDEXER, 0),), NUM_BLOCKS)


def _kv_caches(settings: SparseDecodeSettings) -> dict[str, torch.Tensor]:
    """A cut main-KV layer (blocks one element apart over its hot region) and a paged
    indexer cache ``[blocks, block, IDX]``."""
    hot_rows = settings.max_num_seqs * settings.cfg.topk_buffer_size
    backing = torch.zeros(hot_rows * ROW + NUM_BLOCKS * BS * ROW)
    main = torch.as_strided(backing, (NUM_BLOCKS, BS, ROW), (1, ROW, 1))
    return {MAIN: main, INDEXER: torch.randn(NUM_BLOCKS, BS, IDX,
                                             generator=torch.Generator().manual_seed(1))}


class _Blocks:
    """vLLM's KV cache manager as the scheduler side reads it (fresh lists per call)."""

    def __init__(self) -> None:
        self.ids: dict[str, list[int]] = {}

    def get_block_ids(self, rid: str) -> tuple[list[int], ...]:
        return (list(self.ids.get(rid, [])),)


def _req(rid: str, num_tokens: int, prompt: int = 9, max_tokens: int = 8) -> Any:
    return SimpleNamespace(request_id=rid, num_tokens=num_tokens, prompt_token_ids=[1] * prompt,
                           sampling_params=SimpleNamespace(max_tokens=max_tokens))


def _output(scheduled: dict[str, int], *, new: tuple[Any, ...] = (),
            cached: dict[str, int] | None = None, resumed: frozenset[str] = frozenset(),
            preempted: frozenset[str] = frozenset(), finished: frozenset[str] = frozenset()
            ) -> Any:
    cached = cached or {}
    return SimpleNamespace(
        num_scheduled_tokens=scheduled, finished_req_ids=set(finished),
        preempted_req_ids=set(preempted),
        scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, num_computed_tokens=0,
                                            prompt_token_ids=r.prompt_token_ids,
                                            sampling_params=r.sampling_params) for r in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=list(cached),
                                              num_computed_tokens=list(cached.values()),
                                              resumed_req_ids=set(resumed)))


def _run_step(worker: SparseDecodeWorker, meta: Any, rows: list[BatchRow]) -> None:
    """What the engine does with the metadata: preemptions before the forward, then the
    per-step facts, one layer's plan and new main-KV rows, the step's end."""
    worker.handle_preemptions(meta)
    worker.apply(meta)
    d = worker.decode
    plan = d.plan_step(rows)
    pos = [(plan.batch_index[i], p) for i, r in enumerate(rows)
           for p in range(plan.offload_from[i], r.num_tokens)]
    d.offload_new_kv(0, torch.ones(len(pos), ROW), torch.tensor(pos, dtype=torch.int64))
    worker.end_step()


def _setup(worker_stash_tokens: int | None = None
           ) -> tuple[SparseDecodeScheduler, SparseDecodeWorker, dict[str, torch.Tensor], _Blocks]:
    s = _settings()
    sched = SparseDecodeScheduler(s)
    blocks = _Blocks()
    sched.kv_cache_manager = blocks  # type: ignore[assignment]
    caches = _kv_caches(s)
    worker = SparseDecodeWorker(s, caches)
    if worker_stash_tokens is not None:  # a worker whose budget disagrees with the scheduler
        st = worker.decode.stash
        st.capacity_bytes = -(-worker_stash_tokens // BS) * st.block_bytes
    return sched, worker, caches, blocks


def test_preempted_request_resumes_with_its_indexer_rows_and_no_recompute() -> None:
    sched, worker, caches, blocks = _setup()
    idx = caches[INDEXER]
    a = _req("a", 9)
    assert sched.admit(a) and sched.resume_offer(a) == 0
    blocks.ids["a"] = [3, 7, 2]
    meta = sched.build_meta(_output({"a": 9}, new=(a,)))
    _run_step(worker, meta, [BatchRow(2, 9, 9)])  # prompt: positions 0..8, key = block of 8
    history = idx[[3, 7, 2]].clone()
    # vLLM preempts a (frees its blocks) and gives blocks 3, 7 to b in the same step
    b = _req("b", 6, prompt=6)
    assert sched.admit(b)
    del blocks.ids["a"]
    blocks.ids["b"] = [7, 3]
    meta = sched.build_meta(_output({"b": 6}, new=(b,), preempted=frozenset({"a"})))
    assert meta.preempted == {"a": StashOrder(9, ((3, 7, 2),))}
    assert sched.preemption.state("a") is PreemptState.STASHED
    worker.handle_preemptions(meta)
    idx[[7, 3]] = -7.0  # b's forward overwrites the freed blocks
    _run_step(worker, meta, [BatchRow(3, 6, 6)])
    # a resumes: 10 tokens (9 computed + the sampled one), new blocks 5, 9, 11
    a.num_tokens = 10
    assert sched.resume_offer(a) == 9
    sched.after_alloc(a, 9)
    blocks.ids["a"] = [5, 9, 11]
    meta = sched.build_meta(_output({"a": 1, "b": 1}, cached={"a": 9, "b": 6},
                                    resumed=frozenset({"a"})))
    assert meta.resumed == {"a": ResumeOrder(9, ((5, 9, 11),))}
    _run_step(worker, meta, [BatchRow(11, 10, 1), BatchRow(3, 7, 1)])
    assert torch.equal(idx[[5, 9, 11]], history)  # loaded before the forward, bit for bit
    c = worker.decode.counters()
    assert (c["preempted_requests"], c["resumed_tokens"], c["recomputed_tokens"],
            c["stash_failures"]) == (1, 9, 0, 0)
    # every position was written to the pool once: 9 + 6 + 1 + 1
    assert c["offload_rows"] == 17
    assert worker.take_load_errors() == set() and worker.decode.stash.bytes_held == 0
    # finished: pool rows and ledger released
    meta = sched.build_meta(_output({}, finished=frozenset({"a", "b"})))
    for rid in ("a", "b"):
        sched.finished(rid)
    worker.apply(meta)
    assert worker.manager.pool.free_blocks == worker.manager.pool.num_blocks
    assert sched.ledger.requests == 0 and len(sched.preemption) == 0


def test_a_stash_the_worker_could_not_hold_becomes_load_errors_and_a_recompute() -> None:
    sched, worker, _caches, blocks = _setup(worker_stash_tokens=BS)  # one block only
    a = _req("a", 9)
    sched.admit(a)
    blocks.ids["a"] = [3, 7, 2]
    _run_step(worker, sched.build_meta(_output({"a": 9}, new=(a,))), [BatchRow(2, 9, 9)])
    del blocks.ids["a"]
    meta = sched.build_meta(_output({}, preempted=frozenset({"a"})))
    worker.apply(meta)  # handles the preemption itself when vLLM did not
    assert worker.decode.counters()["stash_failures"] == 1
    a.num_tokens = 10
    assert sched.resume_offer(a) == 9  # the scheduler cannot know; the load reports it
    sched.after_alloc(a, 9)
    blocks.ids["a"] = [5, 9, 11]
    meta = sched.build_meta(_output({"a": 1}, cached={"a": 9}, resumed=frozenset({"a"})))
    worker.apply(meta)
    assert worker.take_load_errors() == {5, 9, 11}
    # vLLM recomputes from position 0 (the first failed block): counted as recomputed
    worker.decode.begin("recompute", {11: "a"})
    assert worker.decode.plan_step([BatchRow(11, 10, 10)]).offload_from == (0,)
    worker.end_step()
    assert worker.decode.counters()["recomputed_tokens"] == 9


def test_paged_main_kv_recomputes_every_preempted_request() -> None:
    """vllm-ascend's paged main KV: its own prefill reads the paged main KV the
    preemption freed, so nothing is offered on resumption."""
    s = _settings(paged=True)
    sched = SparseDecodeScheduler(s)
    blocks = _Blocks()
    sched.kv_cache_manager = blocks  # type: ignore[assignment]
    a = _req("a", 9)
    sched.admit(a)
    blocks.ids["a"] = [3, 7, 2]
    sched.build_meta(_output({"a": 9}, new=(a,)))
    meta = sched.build_meta(_output({}, preempted=frozenset({"a"})))
    assert meta.preempted == {"a": StashOrder(0, ())}
    a.num_tokens = 10
    assert sched.resume_offer(a) == 0


@pytest.mark.parametrize("finished_too", [False, True])
def test_aborted_while_preempted_frees_everything(finished_too: bool) -> None:
    sched, worker, _caches, blocks = _setup()
    a = _req("a", 9)
    sched.admit(a)
    blocks.ids["a"] = [3, 7, 2]
    _run_step(worker, sched.build_meta(_output({"a": 9}, new=(a,))), [BatchRow(2, 9, 9)])
    del blocks.ids["a"]
    # preempted and finished in the same step: no stash order at all
    fin = frozenset({"a"}) if finished_too else frozenset()
    meta = sched.build_meta(_output({}, preempted=frozenset({"a"}), finished=fin))
    assert ("a" in meta.preempted) is not finished_too
    worker.apply(meta)
    if not finished_too:
        assert worker.decode.stash.bytes_held > 0
        meta = sched.build_meta(_output({}, finished=frozenset({"a"})))
        worker.apply(meta)
    sched.finished("a")
    assert worker.decode.stash.bytes_held == 0 and sched.preemption.used_tokens == 0
    assert worker.manager.pool.free_blocks == worker.manager.pool.num_blocks


class _CountingBlocks(_Blocks):
    """The stand-in that counts the block lists the scheduler side reads."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def get_block_ids(self, rid: str) -> tuple[list[int], ...]:
        self.reads += 1
        return super().get_block_ids(rid)


def test_block_ids_are_read_again_only_past_the_known_blocks_and_after_a_resumption() -> None:
    """A running request's blocks of a one-group engine only grow: the step's key block is
    read from vLLM only when its newest position lies past the blocks last read, and a
    preempted request's new blocks are read when it resumes."""
    s = _settings()
    sched = SparseDecodeScheduler(s)
    blocks = _CountingBlocks()
    sched.kv_cache_manager = blocks  # type: ignore[assignment]
    a = _req("a", 6)
    assert sched.admit(a)
    blocks.ids["a"] = [3, 7]  # positions 0..7
    assert sched.build_meta(_output({"a": 6}, new=(a,))).keys == {7: "a"}
    assert blocks.reads == 1
    assert sched.build_meta(_output({"a": 1}, cached={"a": 6})).keys == {7: "a"}
    assert sched.build_meta(_output({"a": 1}, cached={"a": 7})).keys == {7: "a"}
    assert blocks.reads == 1  # position 7 lies in a block already known
    blocks.ids["a"].append(9)  # vLLM appends a block for position 8
    assert sched.build_meta(_output({"a": 1}, cached={"a": 8})).keys == {9: "a"}
    assert blocks.reads == 2
    # preempted: vLLM frees its blocks; resumed in other ones, which are read
    assert sched.build_meta(_output({}, preempted=frozenset({"a"}))).preempted["a"].tokens == 9
    blocks.ids["a"] = [12, 4, 5]
    meta = sched.build_meta(_output({"a": 9}, cached={"a": 0}, resumed=frozenset({"a"})))
    assert meta.keys == {5: "a"} and blocks.reads == 3
    # finished: forgotten (a request of the same name later starts from vLLM's lists)
    sched.finished("a")
    blocks.ids["a"] = [8]
    b = _req("a", 3)
    assert sched.admit(b)
    assert sched.build_meta(_output({"a": 3}, new=(b,))).keys == {8: "a"}
    assert blocks.reads == 4
