"""Hybrid residency through the sparse decode connector's scheduler and worker objects,
without an engine (vLLM's scheduler outputs are stand-ins, as in
test_sparse_preemption_connector), over vLLM's real ``BlockPool``: placement as a step is
built, rows written into the borrowed blocks' indexer pages, pressure from a waiting and
from a running request, the move bit for bit, blocks back at finish."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from vllm.v1.core.block_pool import BlockPool

from ascend_offload.config import SparseOffloadConfig
from ascend_offload.connectors.sparse_decode.scheduler import SparseDecodeScheduler
from ascend_offload.connectors.sparse_decode.worker import SparseDecodeWorker
from ascend_offload.sparse.adapter import BatchRow, SparseStepPlan
from ascend_offload.sparse.hybrid import (
    AreaGeometry,
    GrowOp,
    MoveOp,
    resident_slots,
    write_resident,
)
from tests.unit.sparse.test_sparse_preemption_connector import (
    BS,
    IDX,
    INDEXER,
    NUM_BLOCKS,
    ROW,
    _Blocks,
    _kv_caches,
    _output,
    _req,
    _settings,
)

GEO = AreaGeometry(BS * IDX * 4, BS * IDX * 4, ROW * 4)  # 80 B pages: 5-6 rows of 12 B


def _setup() -> tuple[SparseDecodeScheduler, SparseDecodeWorker, dict[str, torch.Tensor],
                      _Blocks, BlockPool]:
    base = _settings()
    cfg = SparseOffloadConfig(**{**base.cfg.model_dump(), "hybrid": True})
    s = dataclasses.replace(base, cfg=cfg, hybrid=GEO, max_batched_tokens=64)
    sched = SparseDecodeScheduler(s)
    pool = BlockPool(NUM_BLOCKS, False, BS)
    sched.bind_block_pool(pool)
    blocks = _Blocks()
    sched.kv_cache_manager = blocks  # type: ignore[assignment]
    caches = _kv_caches(s)
    return sched, SparseDecodeWorker(s, caches), caches, blocks, pool


def _step(worker: SparseDecodeWorker, meta: Any, rows: list[BatchRow], value: float
          ) -> SparseStepPlan:
    worker.handle_preemptions(meta)
    worker.apply(meta)
    d = worker.decode
    plan = d.plan_step(rows)
    pos = [(plan.batch_index[i], p) for i, r in enumerate(rows)
           for p in range(plan.offload_from[i], r.num_tokens)]
    new = torch.full((len(pos), ROW), value)
    if plan.resident is not None:  # every entry resident: the layer writes its rows itself
        for view in plan.resident.views:
            write_resident(view, plan.resident.new_rows, new)
    else:
        for layer in range(len(worker.manager.hot.buffers)):
            d.offload_new_kv(layer, new, torch.tensor(pos, dtype=torch.int64))
    worker.end_step()
    return plan


def test_resident_rows_live_in_borrowed_indexer_pages_and_move_under_pressure() -> None:
    sched, worker, caches, blocks, pool = _setup()
    free0 = pool.get_num_free_blocks()
    assert sched.s.hybrid_keep_free == 2
    a = _req("a", 9)
    assert sched.admit(a) and not sched.hybrid_wait(a, 0)  # nothing resident yet
    blocks.ids["a"] = [3, 7, 2]  # vLLM's own blocks for the indexer
    pool.get_new_blocks(3)  # (what vLLM allocated for them)
    meta = sched.build_meta(_output({"a": 9}, new=(a,)))
    (grow,) = meta.hybrid_ops
    assert isinstance(grow, GrowOp) and grow.req_id == "a"
    assert sum(len(GEO.rows_of(b)) for b in grow.blocks) >= 9
    assert pool.get_num_free_blocks() == free0 - 3 - len(grow.blocks)
    _step(worker, meta, [BatchRow(2, 9, 9)], 5.0)
    # the rows went into the borrowed blocks' indexer pages, not the host pool
    rows = worker.decode.manager.area.rows("a")  # type: ignore[union-attr]
    flat = caches[INDEXER].view(-1)
    for r in rows[:9].tolist():
        assert torch.equal(flat[r * ROW:(r + 1) * ROW], torch.full((ROW,), 5.0))
    host = worker.manager.pool
    table = host.block_list("a")
    pool_rows = [table[p // BS] * BS + p % BS for p in range(9)]
    assert (host.layer(0)[pool_rows] == 0).all()
    assert worker.decode.counters()["resident_rows"] == 9 * len(worker.manager.area.views)  # type: ignore[union-attr]

    # a waiting request that does not fit in vLLM's free blocks: it waits one step and the
    # resident gives its blocks back at the end of this one
    b = _req("b", 40, prompt=40)
    assert sched.admit(b) and sched.hybrid_wait(b, 0)
    meta = sched.build_meta(_output({"a": 1}, cached={"a": 9}))
    assert [type(o) for o in meta.hybrid_ops] == [MoveOp] and meta.hybrid_ops[0].req_id == "a"
    assert pool.get_num_free_blocks() == free0 - 3  # the borrowed blocks are vLLM's again
    _step(worker, meta, [BatchRow(2, 10, 1)], 6.0)
    # the move copied the 9 resident rows; the 10th token went to the pool itself
    assert torch.equal(host.layer(0)[pool_rows], torch.full((9, ROW), 5.0))
    assert torch.equal(host.layer(0)[table[9 // BS] * BS + 9 % BS], torch.full((ROW,), 6.0))
    c = worker.decode.counters()
    assert c["moved_requests"] == 1 and c["moved_bytes"] == 9 * ROW * 4 and c["miss_rows"] == 0
    assert not sched.pending_frees()  # nothing resident: vLLM preempts as usual
    sched.finished("a")
    sched.finished("b")


def test_a_running_request_that_cannot_allocate_makes_residents_give_back() -> None:
    sched, worker, _, blocks, pool = _setup()
    free0 = pool.get_num_free_blocks()
    a, b = _req("a", 9), _req("b", 6, prompt=6)
    for r, ids in ((a, [3, 7, 2]), (b, [4, 5])):
        assert sched.admit(r)
        blocks.ids[r.request_id] = ids
    pool.get_new_blocks(5)
    meta = sched.build_meta(_output({"a": 9, "b": 6}, new=(a, b)))
    assert [o.req_id for o in meta.hybrid_ops] == ["a", "b"]  # both placed, a first
    _step(worker, meta, [BatchRow(2, 9, 9), BatchRow(5, 6, 6)], 1.0)
    taken = pool.get_new_blocks(pool.get_num_free_blocks() - 1)  # vLLM's others took the rest
    # vLLM could not allocate for a running request: it waits a step, a resident moves
    assert sched.pending_frees()
    meta = sched.build_meta(_output({"a": 1}, cached={"a": 9}))
    assert meta.hybrid_ops[0] == MoveOp("a")  # the longest-running first
    # vLLM got a block per request of the last step beyond what was free
    assert pool.get_num_free_blocks() >= sched.hybrid.keep_free + 1  # type: ignore[union-attr]
    # a step with an entry that is not resident: the layers go through the adapter
    assert _step(worker, meta, [BatchRow(2, 10, 1)], 2.0).resident is None
    assert not worker.decode.resident("a")
    assert worker.decode.counters()["moved_bytes"] >= 9 * ROW * 4
    sched.finished("a")
    sched.finished("b")
    assert sched.hybrid is not None and len(sched.hybrid) == 0
    pool.free_blocks(taken)
    assert len(sched.hybrid.source) == 0 and pool.get_num_free_blocks() == free0 - 5  # type: ignore[arg-type]


def test_prefix_cache_keeps_a_resident_requests_rows_and_hits_start_offloaded() -> None:
    """With the decode-side prefix cache on: a finished resident request's kept blocks get
    its device rows in their pool rows before the entry is made (the borrowed blocks are
    vLLM's again from the next step on), and a request starting from cached blocks is not
    placed (its leading rows are the pool's)."""
    from ascend_offload.sparse.prefix_cache import KeepOrder

    base = _settings()
    cfg = SparseOffloadConfig(**{**base.cfg.model_dump(), "hybrid": True, "prefix_cache_blocks": 6})
    s = dataclasses.replace(base, cfg=cfg, hybrid=GEO, max_batched_tokens=64)
    sched = SparseDecodeScheduler(s)
    sched.bind_block_pool(BlockPool(NUM_BLOCKS, False, BS))
    blocks = _Blocks()
    sched.kv_cache_manager = blocks  # type: ignore[assignment]
    worker = SparseDecodeWorker(s, _kv_caches(s))
    host = worker.manager.pool
    a = _req("a", 9)
    a.block_hashes, a.num_computed_tokens = [b"x", b"y"], 0
    assert sched.admit(a)
    blocks.ids["a"] = [3, 7, 2]
    meta = sched.build_meta(_output({"a": 9}, new=(a,)))
    assert [o.req_id for o in meta.hybrid_ops] == ["a"]
    _step(worker, meta, [BatchRow(2, 9, 9)], 4.0)
    table = host.block_list("a")
    assert (host.layer(0)[table[0] * BS:table[0] * BS + 2 * BS] == 0).all()  # still on device
    a.num_computed_tokens = 9
    sched.finished("a", a, [3, 7, 2])
    b = _req("b", 12, prompt=12)
    b.block_hashes, b.num_computed_tokens = [b"x", b"y", b"z"], 0
    assert sched.admit(b) and sched.prefix_offer(b) == 8 and not sched.after_alloc(b, 8)
    del blocks.ids["a"]
    blocks.ids["b"] = [5, 9, 11]
    out = _output({"b": 4}, new=(b,), finished=frozenset({"a"}))
    out.scheduled_new_reqs[0].num_computed_tokens = 8
    meta = sched.build_meta(out)
    assert isinstance(meta.prefix_ops[0], KeepOrder) and meta.hybrid_ops == ()  # b not placed
    _step(worker, meta, [BatchRow(11, 12, 4)], 6.0)
    # the entries' pool rows hold a's rows (copied from the device before the keep)
    assert torch.equal(host.layer(0)[table[0] * BS:table[0] * BS + 2 * BS],
                       torch.full((2 * BS, ROW), 4.0))
    assert host.block_list("b")[:2] == table[:2] and not worker.decode.resident("b")
    c = worker.decode.counters()
    assert c["prefix_loaded_blocks"] == 2 and c["placed_requests"] == 1


def test_a_step_of_resident_requests_plans_where_its_rows_live() -> None:
    """Every entry resident: the plan carries the device rows of the step's new tokens (in
    the order of its new rows) and each entry's row table, so the layers write and gather
    with tensor ops and no adapter call; the rows and query tokens are counted once for
    every layer."""
    sched, worker, _, blocks, pool = _setup()
    a, b = _req("a", 9), _req("b", 6, prompt=6)
    for r, ids in ((a, [3, 7, 2]), (b, [4, 5])):
        assert sched.admit(r)
        blocks.ids[r.request_id] = ids
    pool.get_new_blocks(5)
    area = worker.decode.manager.area
    assert area is not None
    layers = len(area.views)
    plan = _step(worker, sched.build_meta(_output({"a": 9, "b": 6}, new=(a, b))),
                 [BatchRow(2, 9, 9), BatchRow(5, 6, 6)], 3.0)
    res = plan.resident
    assert res is not None and not plan.any_decode
    assert res.new_rows.tolist() == area.row_list("a")[:9] + area.row_list("b")[:6]
    assert res.tables[0] is area.table("a") and res.tables[1] is area.table("b")
    assert list(res.views) == area.views
    for view in area.views:  # written through the plan: every layer holds the rows
        assert torch.equal(view[res.new_rows], torch.full((15, ROW), 3.0))
    c = worker.decode.counters()
    assert c["resident_rows"] == c["resident_query_tokens"] == 15 * layers
    assert c["offload_rows"] == 0 and c["pool_query_tokens"] == 0
    # a decode step: one new row each, at its last position
    plan = _step(worker, sched.build_meta(_output({"a": 1, "b": 1}, cached={"a": 9, "b": 6})),
                 [BatchRow(2, 10, 1), BatchRow(5, 7, 1)], 4.0)
    assert plan.resident is not None
    assert plan.resident.new_rows.tolist() == [area.row_list("a")[9], area.row_list("b")[6]]
    # the -1 padding of a selected position gathers -1 through the table
    got = resident_slots(plan.resident.tables[1], torch.tensor([[6, 0, -1]]))
    assert got.tolist() == [[area.row_list("b")[6], area.row_list("b")[0], -1]]
    assert worker.decode.counters()["resident_rows"] == 17 * layers
    sched.finished("a")
    sched.finished("b")
