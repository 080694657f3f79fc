"""Remote-D2H consumer writes prompt KV straight into the sparse host pool (loopback engine, real ZMQ)."""

from __future__ import annotations

import pytest
import torch

from ascend_offload.pd.layout import pool_layer_descs
from ascend_offload.pd.producer import DecodeTarget
from ascend_offload.sparse.pools import HostKVPool
from tests.unit.pd.pool_scenario import (
    BLOCK,
    CFG,
    MAX_NEW,
    WAIT_S,
    assert_pool_matches,
    build_prefill,
    consumer_for,
    decode_parity,
    fragment,
    make_pool,
    producer_for,
    prompts,
    wait_sent,
)


def _pull(pool: HostKVPool, reqs, pre, engines, port, closing, *, indexer=None, index_blocks=None,
          ack_timeout_s: float = 5.0):
    pe, de = engines
    prod = producer_for(pre, pe, ack_timeout_s=ack_timeout_s)
    closing(prod)
    cons = consumer_for(pool, de, port, indexer=indexer)
    closing(cons)
    admitted = {}
    for rid, prompt in reqs.items():
        admitted[rid] = cons.expect_pool(rid, pool, prompt_tokens=len(prompt),
                                         max_tokens=len(prompt) + MAX_NEW,
                                         index_blocks=None if index_blocks is None else index_blocks[rid])
        prod.add_request(rid, pre.blocks[rid], DecodeTarget("127.0.0.1", port, 1))
    for layer in range(CFG.num_layers):
        prod.publish_layer(layer)
    outs = {o.request_id: o for o in cons.wait_finished(len(reqs), WAIT_S)}
    return prod, cons, admitted, outs


def test_pool_rows_equal_prefill_kv_then_sparse_decode_is_bit_identical(engines, port, closing):
    reqs = prompts()
    pre = build_prefill(reqs)
    pool = make_pool(40)
    fragment(pool)
    prod, cons, admitted, outs = _pull(pool, reqs, pre, engines, port, closing)
    assert all(admitted.values())
    assert sorted((r, o.ok) for r, o in outs.items()) == [("a", True), ("b", True), ("c", True)]
    # the pool handed out holes first: request "a" spans non-contiguous pool blocks
    table = pool.block_table("a").tolist()
    assert table != list(range(table[0], table[0] + len(table)))
    assert_pool_matches(pool, pre, list(reqs))
    assert sorted((s.request_id, s.ok) for s in wait_sent(prod, 3)) == [("a", True), ("b", True),
                                                                          ("c", True)]
    assert cons.stats.reads == 3 * CFG.num_layers  # one batched read per (request, layer)
    assert cons.active() == []
    # Decode from the pulled pool: ≥ 16 steps, 3 requests, logits equal the full-KV run bit for bit.
    mgr = decode_parity(pool, reqs, steps=18)
    assert mgr.active_requests == [] and pool.free_blocks == pool.num_blocks - 1  # "_keep" stays


def test_indexer_goes_to_device_blocks_main_kv_to_pool(engines, port, closing):
    reqs = prompts({"x": 70, "y": 33})
    pre = build_prefill(reqs, with_indexer=True)
    pool = make_pool(16)
    dev_blocks = 12
    indexer = [torch.zeros(dev_blocks, BLOCK, CFG.index_dim) for _ in range(CFG.num_layers)]
    index_blocks = {"x": [7, 2, 9, 4, 11], "y": [0, 5, 6]}
    _, _, admitted, outs = _pull(pool, reqs, pre, engines, port, closing, indexer=indexer,
                                 index_blocks=index_blocks)
    assert all(admitted.values()) and all(o.ok for o in outs.values()) and len(outs) == 2
    assert_pool_matches(pool, pre, list(reqs))
    for rid, blocks in index_blocks.items():
        n = pre.rows[rid][0].shape[0]
        pos = torch.arange(n)
        for layer in range(CFG.num_layers):
            got = indexer[layer][torch.tensor(blocks)[pos // BLOCK], pos % BLOCK]
            assert torch.equal(got, pre.index_rows[rid][layer]), f"indexer {rid} layer {layer}"
    untouched = sorted(set(range(dev_blocks)) - {b for v in index_blocks.values() for b in v})
    assert not any(t[untouched].any() for t in indexer)


def test_pool_admission_failure_fails_only_that_request(engines, port, closing):
    reqs = prompts()
    pre = build_prefill(reqs)
    # a needs ceil(170/16) = 11 blocks, b 4, c 8: 16 blocks admit a and b, not c.
    pool = make_pool(16)
    # The default ack deadline (5 s): with 1 s the read budget is 0.5 s, and a loaded CI
    # machine once reported request a's reads as late. c's readiness is parked and
    # answered READ_FAILED when its budget ends (2.5 s here).
    prod, cons, admitted, outs = _pull(pool, reqs, pre, engines, port, closing)
    assert admitted == {"a": True, "b": True, "c": False}
    assert outs["a"].ok and outs["b"].ok
    assert not outs["c"].ok
    assert "'c'" in outs["c"].reasons[0] and "exhausted" in outs["c"].reasons[0]
    assert "dram_size_per_dp_GB" in outs["c"].reasons[0]  # the key to raise
    assert_pool_matches(pool, pre, ["a", "b"])  # and the free block was never written
    sent = {s.request_id: s for s in wait_sent(prod, 3)}
    assert sent["a"].ok and sent["b"].ok
    assert not sent["c"].ok and sent["c"].failed_layers == tuple(range(CFG.num_layers))
    assert cons.active() == []


def test_row_size_mismatch_is_read_failed_naming_both_sizes(engines, port, closing):
    reqs = prompts({"a": 40})
    pre = build_prefill(reqs)  # 16 float32 per row: 64 B
    pool = make_pool(8, latent=8)  # 32 B rows
    prod, _, admitted, outs = _pull(pool, reqs, pre, engines, port, closing)
    assert admitted == {"a": True}
    o = outs["a"]
    assert not o.ok and len(o.reasons) == CFG.num_layers
    assert "invalid" in o.reasons[0]
    assert "row_bytes 64" in o.reasons[0] and "row_bytes 32" in o.reasons[0]
    assert o.failed_blocks == tuple(sorted(pool.block_table("a").tolist()[:3]))
    assert not pool.kv.any()  # nothing written
    sent = wait_sent(prod, 1)
    assert sent and not sent[0].ok and sent[0].failed_layers == tuple(range(CFG.num_layers))


def test_pool_row_bytes_checked_at_startup():
    pool = make_pool(4, latent=8)
    with pytest.raises(ValueError, match=r"row_bytes=32 != model main-KV row_bytes=64"):
        pool_layer_descs(pool.kv, BLOCK, kv_row_bytes=64)
    descs = pool_layer_descs(pool.kv, BLOCK, kv_row_bytes=32)
    assert len(descs) == CFG.num_layers
    assert [d.main[0].block_bytes for d in descs] == [BLOCK * 32] * CFG.num_layers
    assert descs[1].main[0].base_addr == pool.layer_region(1)[0]
    assert descs[0].main[0].num_blocks == 4 and descs[0].indexer is None


def test_duplicate_expect_pool_refused_without_touching_the_original(engines, port, closing):
    pool = make_pool(8)
    cons = consumer_for(pool, engines[1], port)
    closing(cons)
    assert cons.expect_pool("a", pool, prompt_tokens=20, max_tokens=30)
    with pytest.raises(ValueError, match="already expected"):
        cons.expect_pool("a", pool, prompt_tokens=20, max_tokens=30)
    assert cons.active() == ["a"] and pool.capacity("a") == 32
    with pytest.raises(ValueError, match="prompt_tokens"):
        cons.expect_pool("b", pool, prompt_tokens=40, max_tokens=30)
    assert pool.free_blocks == 6  # nothing reserved for the refused call
    cons.fail("a", "test over")
    assert [o.request_id for o in cons.wait_finished(1, WAIT_S)] == ["a"]
