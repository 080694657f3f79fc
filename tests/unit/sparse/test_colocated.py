"""Colocated sparse decode bookkeeping (the adapter behind AscendSparseDecodeConnector):
request naming by key block, what each step writes to the pool, refusals, and the
data path through the real manager (rows reach the hot buffer bit for bit)."""

from __future__ import annotations

import pytest
import torch

from ascend_offload.config import SparseOffloadConfig
from ascend_offload.sparse.adapter import BatchRow, SparseDecodeAdapter
from ascend_offload.sparse.colocated import ColocatedSparseDecode
from ascend_offload.sparse.manager import SparseOffloadManager

ROW = 3
TOPK = 4
HOT = 8
BS = 4


def _decode(pool_rows: int = 64, max_requests: int = 2, use_native: str = "auto"
            ) -> ColocatedSparseDecode:
    cfg = SparseOffloadConfig(enabled=True, topk_buffer_size=HOT, index_topk=TOPK,
                              use_native=use_native)
    mgr = SparseOffloadManager(cfg, num_layers=2, row_shape=(ROW,), dtype=torch.float32,
                               block_size=BS, max_requests=max_requests, index_topk=TOPK,
                               pool_rows=pool_rows)
    return ColocatedSparseDecode(mgr, ["l.0.attn", "l.1.attn"])


def test_implements_the_adapter_protocol_and_names_layers() -> None:
    d = _decode()
    assert isinstance(d, SparseDecodeAdapter)
    assert d.sparse_layer_index("l.1.attn") == 1
    assert d.sparse_layer_index("l.1.indexer") is None


def test_plan_writes_what_the_pool_lacks_and_decodes_one_token_rows() -> None:
    d = _decode()
    assert d.admit("a", 20) and d.admit("b", 20)
    d.begin("step1", {7: "a", 9: "b"})
    # a: 12 prompt tokens, 8 of them from the prefix cache; b: a 5-token chunk from 0
    rows = [BatchRow(7, 12, 4), BatchRow(9, 5, 5)]
    plan = d.plan_step(rows)
    assert plan.batch_index == (0, 1) and plan.offload_from == (0, 0)
    assert plan.decode == (False, False) and plan.num_entries == 2
    assert d.plan_step(rows) is plan  # every layer of the step gets the same plan
    with pytest.raises(ValueError, match="another batch"):
        d.plan_step(rows[:1])
    d.begin("step2", {11: "b", 8: "a"})  # batch order is the attention's, not the keys'
    plan = d.plan_step([BatchRow(11, 6, 1), BatchRow(8, 13, 1)])
    assert plan.batch_index == (0, 1) and plan.offload_from == (5, 12)
    assert plan.decode == (True, True)
    # recomputation (e.g. after preemption) rewrites from where the step starts
    d.begin("step3", {11: "b"})
    assert d.plan_step([BatchRow(11, 6, 6)]).offload_from == (0,)


def test_unmatched_rows_and_unadmitted_requests_are_errors_naming_the_row() -> None:
    """No main KV on the device: a row the pool cannot serve has nowhere to attend."""
    d = _decode(pool_rows=16, max_requests=1)
    assert d.admit("a", 16)
    assert not d.admit("b", 4)  # hot rows exhausted (max_requests=1)
    assert d.admission_failures == 1
    d.begin(1, {3: "a", 4: "b"})
    with pytest.raises(RuntimeError, match="request 'b', which holds no host pool rows"):
        d.plan_step([BatchRow(3, 2, 1), BatchRow(4, 2, 1)])
    d.begin(2, {3: "a"})
    with pytest.raises(RuntimeError, match=r"key block 99, 2 tokens\).*matches no scheduled"):
        d.plan_step([BatchRow(3, 2, 1), BatchRow(99, 2, 1)])
    assert d.unmatched_rows == 1
    d.finish("a")
    d.finish("b")
    assert d.admitted == [] and d.manager.pool_rows_used == 0
    assert d.admit("c", 16)  # freed rows are reused
    assert d.gauges() == {"pool_rows_used": 16, "admitted_requests": 1, "stash_bytes": 0,
                        "prefix_cache_blocks": 0, "resident_requests": 0,
                        "offloaded_requests": 1}


def test_attach_takes_a_hot_row_for_rows_another_party_filled() -> None:
    d = _decode()
    d.manager.pool.admit("r", 12)  # what the remote-D2H consumer does
    d.attach("r", 12, pooled=9)
    d.begin(1, {5: "r"})
    plan = d.plan_step([BatchRow(5, 10, 1)])
    assert plan.offload_from == (9,) and plan.decode == (True,)
    d.finish("r")
    assert d.manager.pool.admitted() == []


def test_context_rows_address_the_pool_rows_of_the_positions() -> None:
    d = _decode()
    assert d.admit("a", 20)
    d.begin(1, {0: "a"})
    d.plan_step([BatchRow(0, 10, 10)])
    kv = torch.arange(30, dtype=torch.float32).view(10, ROW)
    d.offload_new_kv(0, kv, torch.tensor([[0, p] for p in range(10)]))
    store, rows = d.context_rows(0, 0, torch.tensor([[0, 3, 9, -1]]))
    got = store[rows[0, :3]]
    assert torch.equal(got, kv[[0, 3, 9]]) and int(rows[0, 3]) == -1
    with pytest.raises(IndexError, match="beyond num_tokens=10"):
        d.context_rows(0, 0, torch.tensor([[10]]))


@pytest.mark.parametrize("use_native", ["auto", "off"])
def test_hot_buffer_rows_equal_the_offloaded_rows(use_native: str) -> None:
    """The attention's view: offload a request's rows, resolve a top-k, read the hot
    buffer; rewritten (recomputed) positions are served fresh, not from the hot buffer."""
    d = _decode(use_native=use_native)
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(20, ROW, generator=g)
    assert d.admit("a", 20)
    d.begin(1, {0: "a"})
    d.plan_step([BatchRow(0, 10, 10)])
    for layer in range(2):
        d.offload_new_kv(layer, kv[:10] + layer, torch.tensor([[0, p] for p in range(10)]))
    d.end_step()
    d.begin(2, {2: "a"})
    plan = d.plan_step([BatchRow(2, 11, 1)])
    assert plan.offload_from == (10,) and plan.decode == (True,)
    topk = torch.tensor([[1, 4, 9, 10]], dtype=torch.int32)
    for layer in range(2):
        d.offload_new_kv(layer, kv[10:11] + layer, torch.tensor([[0, 10]]))
        slots = d.onload_topk(layer, topk)
        got = d.hot_buffer(layer)[slots[0].long()]
        assert torch.equal(got, kv[[1, 4, 9, 10]] + layer)
    d.end_step()
    stats = d.manager.stats
    assert stats.miss_rows == 8 and stats.hits == 0
    # the same positions again, one of them recomputed with other values
    d.begin(3, {2: "a"})
    d.plan_step([BatchRow(2, 11, 2)])  # positions 9, 10 recomputed
    new = kv[9:11] * -1
    for layer in range(2):
        d.offload_new_kv(layer, new + layer, torch.tensor([[0, 9], [0, 10]]))
        slots = d.onload_topk(layer, topk)
        got = d.hot_buffer(layer)[slots[0].long()]
        assert torch.equal(got, torch.cat((kv[[1, 4]], new)) + layer)
    d.end_step()
    assert stats.hits == 4 and stats.miss_rows == 12  # 1 and 4 hit; 9 and 10 reloaded
    counters = d.counters()
    assert counters["hit_positions"] == 4 and counters["miss_bytes"] == 12 * ROW * 4
    assert counters["resolve_ns"] > 0 and counters["offload_rows"] == 2 * (10 + 1 + 2)
