"""Decode-side prefix caching through the sparse decode connector's scheduler and worker
objects, without an engine (vLLM's scheduler outputs are stand-ins, as in
test_sparse_preemption_connector): keep at finish, hits offered and served, the
ledger and the pool in step, eviction for a reservation, reset. Imports vLLM's
connector base."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from ascend_offload.config import SparseOffloadConfig
from ascend_offload.connectors.sparse_decode.scheduler import SparseDecodeScheduler
from ascend_offload.connectors.sparse_decode.settings import SparseDecodeSettings
from ascend_offload.connectors.sparse_decode.worker import SparseDecodeWorker
from ascend_offload.sparse.adapter import BatchRow
from ascend_offload.sparse.prefix_cache import EvictOrder, KeepOrder, PrefixHit
from tests.unit.sparse.test_sparse_preemption_connector import (
    BS,
    INDEXER,
    MAIN,
    NUM_BLOCKS,
    ROW,
    _Blocks,
    _kv_caches,
    _output,
    _run_step,
)

POOL_BLOCKS = 12


def _setup() -> tuple[SparseDecodeScheduler, SparseDecodeWorker, dict[str, torch.Tensor], _Blocks]:
    cfg = SparseOffloadConfig(enabled=True, topk_buffer_size=8, index_topk=4,
                              dram_size_per_dp_GB=POOL_BLOCKS * BS * ROW * 4 / 2**30,
                              prefix_cache_blocks=6)
    s = SparseDecodeSettings(cfg, 4, BS, 64, 2, (MAIN,), 0, ROW * 4, POOL_BLOCKS, False,
                             ((INDEXER, 0),), NUM_BLOCKS)
    sched = SparseDecodeScheduler(s)
    blocks = _Blocks()
    sched.kv_cache_manager = blocks  # type: ignore[assignment]
    caches = _kv_caches(s)
    return sched, SparseDecodeWorker(s, caches), caches, blocks


def _req(rid: str, hashes: list[bytes], num_tokens: int, max_tokens: int = 4) -> Any:
    return SimpleNamespace(request_id=rid, num_tokens=num_tokens, num_computed_tokens=0,
                           prompt_token_ids=[1] * num_tokens, block_hashes=hashes,
                           sampling_params=SimpleNamespace(max_tokens=max_tokens))


def test_finished_blocks_serve_the_next_request_with_the_same_prefix() -> None:
    sched, worker, caches, blocks = _setup()
    pool, idx = worker.manager.pool, caches[INDEXER]
    a = _req("a", [b"x", b"y"], 9)
    assert sched.admit(a) and sched.prefix_offer(a) == 0  # nothing cached yet
    blocks.ids["a"] = [3, 7, 2]
    _run_step(worker, sched.build_meta(_output({"a": 9}, new=(a,))), [BatchRow(2, 9, 9)])
    a_rows = list(pool.block_list("a"))
    want = idx[[3, 7]].clone()
    # a finishes with 9 computed tokens: its two full blocks become entries
    a.num_computed_tokens = 9
    sched.finished("a", a, [3, 7, 2])
    assert sched.ledger.cached == 2 and sched.ledger.free_blocks == POOL_BLOCKS - 2
    # b shares both blocks' hashes and is 12 tokens long: offered 8, reserves 4 - 2 own blocks
    b = _req("b", [b"x", b"y", b"z"], 12)
    assert sched.admit(b) and sched.prefix_offer(b) == 8
    assert sched.ledger.free_blocks == POOL_BLOCKS - 2 - 2
    assert not sched.after_alloc(b, 8)
    del blocks.ids["a"]
    blocks.ids["b"] = [5, 9, 11]
    out = _output({"b": 4}, new=(b,), finished=frozenset({"a"}))
    out.scheduled_new_reqs[0].num_computed_tokens = 8  # vLLM counts the hit as computed
    meta = sched.build_meta(out)
    assert meta.prefix_ops == (KeepOrder("a", ((0, b"x"), (1, b"y")), (3, 7)),)
    assert meta.prefix_hits == {"b": PrefixHit((b"x", b"y"), (5, 9))}
    _run_step(worker, meta, [BatchRow(11, 12, 4)])  # computes positions 8..11 only
    idx[[3, 7]] = -1.0  # vLLM reuses a's freed blocks (after this step's start)
    assert pool.block_list("b")[:2] == a_rows[:2] and pool.refs(a_rows[0]) == 2
    assert torch.equal(idx[[5, 9]], want)  # the entries' indexer rows, loaded before the forward
    assert worker.take_load_errors() == set()
    assert worker.decode.counters()["prefix_loaded_blocks"] == 2
    # the worker's pool and the scheduler's ledger agree on what is used
    assert pool.free_blocks == sched.ledger.free_blocks


def test_a_reservation_evicts_unpinned_entries_and_reset_drops_the_rest() -> None:
    sched, worker, _, blocks = _setup()
    a = _req("a", [b"p", b"q", b"r"], 13)
    assert sched.admit(a)
    blocks.ids["a"] = [1, 2, 3, 4]
    _run_step(worker, sched.build_meta(_output({"a": 13}, new=(a,))), [BatchRow(4, 13, 13)])
    a.num_computed_tokens = 13
    sched.finished("a", a, [1, 2, 3, 4])
    assert sched.ledger.cached == 3
    # c needs 11 of the 12 blocks: two entries go, the chain's tail first
    c = _req("c", [b"u"], 40)
    assert sched.admit(c) and sched.prefix_offer(c) == 0
    assert sched.ledger.cached == 1
    del blocks.ids["a"]
    blocks.ids["c"] = list(range(5, 15))
    meta = sched.build_meta(_output({"c": 40}, new=(c,), finished=frozenset({"a"})))
    assert meta.prefix_ops[1] == EvictOrder((b"r", b"q"))
    _run_step(worker, meta, [BatchRow(14, 40, 40)])
    assert worker.manager.pool.free_blocks == sched.ledger.free_blocks == 0
    # a request too big even with every entry evicted waits and evicts nothing
    d = _req("d", [b"p"], 8)
    assert not sched.admit(d) and sched.ledger.cached == 1
    assert sched.reset_prefix() == 1 and sched.ledger.cached == 0
    blocks.ids["c"].append(15)
    meta = sched.build_meta(_output({"c": 1}, cached={"c": 40}))
    assert meta.prefix_ops == (EvictOrder((b"p",)),)
    _run_step(worker, meta, [BatchRow(15, 41, 1)])
    assert len(worker.decode.prefix or ()) == 0
    assert worker.manager.pool.free_blocks == sched.ledger.free_blocks == 1


def test_a_request_recomputed_from_zero_gets_its_own_blocks_first() -> None:
    """Preempted without a stash (here: stashes refused), a request that started from cached
    blocks is recomputed from position 0; the cache's rows must not be written over."""
    sched, worker, _, blocks = _setup()
    pool = worker.manager.pool
    a = _req("a", [b"x", b"y"], 9)
    assert sched.admit(a)
    blocks.ids["a"] = [3, 7, 2]
    _run_step(worker, sched.build_meta(_output({"a": 9}, new=(a,))), [BatchRow(2, 9, 9)])
    a.num_computed_tokens = 9
    sched.finished("a", a, [3, 7, 2])
    cached = list(pool.block_list("a"))[:2]
    b = _req("b", [b"x", b"y", b"z"], 12)
    assert sched.admit(b) and not sched.after_alloc(b, 8)
    del blocks.ids["a"]
    blocks.ids["b"] = [5, 9, 11]
    out = _output({"b": 4}, new=(b,), finished=frozenset({"a"}))
    out.scheduled_new_reqs[0].num_computed_tokens = 8
    _run_step(worker, sched.build_meta(out), [BatchRow(11, 12, 4)])
    assert pool.block_list("b")[:2] == cached
    want = pool.kv[:, [c * BS for c in cached]].clone()
    # b is preempted and cannot be stashed: recomputed from position 0 when resumed
    sched.preemption.refuse("stashes refused in this test")
    del blocks.ids["b"]
    meta = sched.build_meta(_output({}, preempted=frozenset({"b"})))
    worker.handle_preemptions(meta)
    worker.apply(meta)
    worker.end_step()
    # vLLM asks again on resumption: nothing is offered, from the stash or from the cache
    b.num_tokens = 13
    assert sched.admit(b) and sched.resume_offer(b) == 0 and sched.prefix_offer(b) == 0
    assert not sched.after_alloc(b, 0)
    blocks.ids["b"] = [4, 6, 8]
    meta = sched.build_meta(_output({"b": 12}, cached={"b": 0}, resumed=frozenset({"b"})))
    assert meta.unshare == {"b": 2} and sched.prefix is not None and sched.prefix.pinned("b") == ()
    _run_step(worker, meta, [BatchRow(8, 12, 12)])  # the recompute writes positions 0..11
    own = pool.block_list("b")[:2]
    assert not set(own) & set(cached) and all(pool.refs(c) == 1 for c in cached)
    # the entries' rows are untouched (the recompute wrote ones into b's own blocks)
    assert torch.equal(pool.kv[:, [c * BS for c in cached]], want)
    assert torch.equal(pool.kv[:, [o * BS for o in own]], torch.ones_like(want))
    assert pool.free_blocks == sched.ledger.free_blocks
    # the recompute step's 12 positions are what a later preemption stashes (not the 2
    # blocks it unshared)
    sched.preemption.refused = None
    meta = sched.build_meta(_output({}, preempted=frozenset({"b"})))
    assert meta.preempted["b"].tokens == 12
