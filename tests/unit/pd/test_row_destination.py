"""Remote-D2H consumer with a row destination (hybrid residency): a resident request's main
KV lands straight in its per-token rows inside the decode's indexer caches, its indexer in
its device blocks, its host pool rows stay reserved and unwritten; other requests land in
the pool as before (loopback engine, real ZMQ).

The rows come from the real hybrid residency objects (``AreaGeometry``, ``area_views``,
``ResidentArea``) over indexer caches filled with a sentinel, so a byte written anywhere
it should not be is visible."""

from __future__ import annotations

import pytest
import torch

from ascend_offload.pd.consumer import Consumer
from ascend_offload.pd.layout import RowArea, pool_layer_descs, row_runs
from ascend_offload.pd.producer import DecodeTarget
from ascend_offload.pd.topology import Topology
from ascend_offload.sparse.hybrid import AreaGeometry, ResidentArea, area_views
from tests.unit.pd.pool_scenario import (
    BLOCK,
    CFG,
    MAX_NEW,
    WAIT_S,
    assert_pool_matches,
    build_prefill,
    make_pool,
    producer_for,
    prompts,
    wait_sent,
)

DEV_BLOCKS = 24
SENTINEL = -7.0
# indexer page of a block: 16 tokens x 8 x fp32 = 512 B; main-KV row 16 x fp32 = 64 B: 8 rows
GEO = AreaGeometry(block_stride=BLOCK * CFG.index_dim * 4, page=BLOCK * CFG.index_dim * 4,
                   row_bytes=CFG.latent * 4)
# "a" (70 tokens) resident in 9 borrowed blocks, out of order, two adjacent pairs; its own
# indexer blocks and "b"'s (pool destination) are others of the same caches
BORROWED = (13, 5, 6, 20, 2, 17, 9, 10, 22)
INDEX_BLOCKS = {"a": [3, 11, 4, 15, 0], "b": [7, 8, 12]}


def _decode_side():
    """Pool, indexer caches (one sentinel-filled tensor, a view per layer) and the
    resident area over them with "a" placed in ``BORROWED``."""
    pool = make_pool(16)
    idx = torch.full((CFG.num_layers, DEV_BLOCKS, BLOCK, CFG.index_dim), SENTINEL)
    caches = [idx[layer] for layer in range(CFG.num_layers)]
    area = ResidentArea(area_views(caches, GEO, DEV_BLOCKS, torch.float32, CFG.latent), GEO)
    area.grow("a", BORROWED)
    return pool, idx, caches, area


def _row_areas(area: ResidentArea) -> list[RowArea]:
    return [RowArea(v.data_ptr(), v.stride(0) * v.element_size(), v.shape[0]) for v in area.views]


def _consumer(pool, caches, area, transfer, port, *, timeout_s: float = WAIT_S) -> Consumer:
    return Consumer(engine_id="D", d_rank=0, topology=Topology(1, 1), transfer=transfer,
                    layers=pool_layer_descs(pool.kv, BLOCK, caches), port=port,
                    request_timeout_s=timeout_s, pool_block_size=BLOCK, row_areas=_row_areas(area))


def _expected(before: torch.Tensor, area_rows: list[int], pre, rid: str, *, main: bool = True,
              index: dict[str, list[int]] | None = None) -> torch.Tensor:
    """The indexer caches as they must be after the pull: ``rid``'s main-KV rows in its
    resident rows (``main``, its prompt positions only), each request's indexer blocks in
    its device blocks (whole blocks, as without a row destination)."""
    want = before.clone()
    views = area_views([want[i] for i in range(CFG.num_layers)], GEO, DEV_BLOCKS, torch.float32,
                       CFG.latent)
    n = pre.rows[rid][0].shape[0]
    for layer in range(CFG.num_layers):
        if main:
            views[layer][torch.tensor(area_rows[:n])] = pre.rows[rid][layer]
        for r, blocks in (index or {}).items():  # whole blocks (the prefill's tail included)
            want[layer][torch.tensor(blocks)] = pre.indexer[layer][torch.tensor(pre.blocks[r])]
    return want


def test_resident_main_kv_lands_in_its_rows_pool_request_beside_it(engines, port, closing):
    reqs = prompts({"a": 70, "b": 37})
    pre = build_prefill(reqs, with_indexer=True)
    pool, idx, caches, area = _decode_side()
    before = idx.clone()
    rows = area.rows("a").tolist()
    assert len(rows) == 72 >= 70
    pe, de = engines
    prod = producer_for(pre, pe)
    closing(prod)
    cons = _consumer(pool, caches, area, de, port)
    closing(cons)
    assert cons.expect_pool("a", pool, prompt_tokens=70, max_tokens=70 + MAX_NEW,
                            index_blocks=INDEX_BLOCKS["a"], rows=rows)
    assert cons.expect_pool("b", pool, prompt_tokens=37, max_tokens=37 + MAX_NEW,
                            index_blocks=INDEX_BLOCKS["b"])
    for rid in reqs:
        prod.add_request(rid, pre.blocks[rid], DecodeTarget("127.0.0.1", port, 1))
    for layer in range(CFG.num_layers):
        prod.publish_layer(layer)
    outs = {o.request_id: o for o in cons.wait_finished(2, WAIT_S)}
    assert {r: o.ok for r, o in outs.items()} == {"a": True, "b": True}, outs
    # every byte of the indexer caches is what it must be: "a"'s 70 main-KV rows in its
    # resident rows (the last borrowed block's 2 rows past the prompt untouched), both
    # requests' indexer rows in their device blocks, nothing else written
    assert torch.equal(idx, _expected(before, rows, pre, "a", index=INDEX_BLOCKS))
    for layer in range(CFG.num_layers):
        got = area.view(layer)[torch.tensor(rows[:70])].contiguous().view(torch.uint8)
        assert torch.equal(got, pre.rows["a"][layer].contiguous().view(torch.uint8))
        assert (area.view(layer)[torch.tensor(rows[70:])] == SENTINEL).all()
    # "a" keeps its pool reservation (a later move cannot fail) but no pool row was written;
    # "b" landed in the pool as without a row destination
    assert pool.capacity("a") == 96 and not pool.kv[:, pool.rows_for("a", torch.arange(90))].any()
    assert_pool_matches(pool, pre, ["b"])
    assert {s.request_id: s.ok for s in wait_sent(prod, 2)} == {"a": True, "b": True}
    # one batched read per (request, layer); "a"'s main KV in runs of consecutive rows: at
    # most one per source block and borrowed block (5 + 9), coalesced across blocks where
    # both sides continue; its indexer at most one per device block
    assert cons.stats.reads == 2 * CFG.num_layers
    b_desc = CFG.num_layers * 3 * 2  # at most: 3 pool blocks + 3 indexer blocks
    assert cons.stats.descriptors <= CFG.num_layers * (5 + 9 + 5) + b_desc
    assert cons.stats.bytes_read == CFG.num_layers * (
        70 * GEO.row_bytes + 5 * BLOCK * CFG.index_dim * 4   # a: prompt rows only, 5 index blocks
        + 3 * BLOCK * GEO.row_bytes + 3 * BLOCK * CFG.index_dim * 4)  # b: whole blocks
    assert cons.active() == []


def test_a_failed_resident_pull_reports_its_device_blocks_and_writes_nothing(engines, port, closing):
    """A prefill with another row size: every layer READ_FAILED before a byte is read; the
    outcome names the request's device blocks (what vLLM recomputes)."""
    reqs = prompts({"a": 70})
    pre = build_prefill(reqs, latent=8, with_indexer=True)  # 32 B rows, decode has 64 B
    pool, idx, caches, area = _decode_side()
    before = idx.clone()
    pe, de = engines
    prod = producer_for(pre, pe)
    closing(prod)
    cons = _consumer(pool, caches, area, de, port)
    closing(cons)
    assert cons.expect_pool("a", pool, prompt_tokens=70, max_tokens=90,
                            index_blocks=INDEX_BLOCKS["a"], rows=area.rows("a").tolist())
    prod.add_request("a", pre.blocks["a"], DecodeTarget("127.0.0.1", port, 1))
    for layer in range(CFG.num_layers):
        prod.publish_layer(layer)
    (o,) = cons.wait_finished(1, WAIT_S)
    assert not o.ok and "row_bytes 32" in o.reasons[0] and "row_bytes 64" in o.reasons[0]
    assert o.failed_blocks == tuple(sorted(INDEX_BLOCKS["a"]))
    assert torch.equal(idx, before) and not pool.kv.any()
    assert cons.active() == []


def test_a_resident_pull_never_published_times_out_as_its_device_blocks(engines, port, closing):
    pool, idx, caches, area = _decode_side()
    before = idx.clone()
    cons = _consumer(pool, caches, area, engines[1], port, timeout_s=0.3)
    closing(cons)
    assert cons.expect_pool("a", pool, prompt_tokens=70, max_tokens=90,
                            index_blocks=INDEX_BLOCKS["a"], rows=area.rows("a").tolist())
    (o,) = cons.wait_finished(1, WAIT_S)
    assert not o.ok and "timeout" in o.reasons[0]
    assert o.failed_blocks == tuple(sorted(INDEX_BLOCKS["a"]))
    assert torch.equal(idx, before) and cons.active() == []
    assert pool.holds("a")  # the caller releases the reservation (the worker, on finish)


def test_row_areas_must_lie_in_registered_memory_and_row_tables_are_checked(engines, port, closing):
    pool, _idx, caches, area = _decode_side()
    layers = pool_layer_descs(pool.kv, BLOCK, caches)
    stray = torch.zeros(64, CFG.latent)  # not part of the layout: never registered
    areas = _row_areas(area)
    bad = [*areas[:-1], RowArea(stray.data_ptr(), CFG.latent * 4, 64)]
    kw = dict(engine_id="D", d_rank=0, topology=Topology(1, 1), transfer=engines[1], layers=layers,
              port=port, pool_block_size=BLOCK)
    with pytest.raises(ValueError, match=r"layer 2 row area: rows .* not inside the registered KV"):
        Consumer(**kw, row_areas=bad)
    with pytest.raises(ValueError, match="rows of 32 B, but a main-KV block of 1024 B"):
        Consumer(**kw, row_areas=[RowArea(a.base_addr, 32, a.num_rows) for a in areas])
    with pytest.raises(ValueError, match="one per layer"):
        Consumer(**kw, row_areas=areas[:1])
    cons = Consumer(**kw, row_areas=areas)
    closing(cons)
    rows = area.rows("a").tolist()
    with pytest.raises(ValueError, match="duplicate destination rows"):
        cons.expect_pool("x", pool, prompt_tokens=20, max_tokens=30, index_blocks=[1, 2],
                         rows=[rows[0]] * 20)
    with pytest.raises(ValueError, match=r"destination rows \[100000\] outside"):
        cons.expect_pool("x", pool, prompt_tokens=20, max_tokens=30, index_blocks=[1, 2],
                         rows=[*rows[:19], 100000])
    with pytest.raises(ValueError, match="20 destination rows for 3 blocks"):
        cons.expect_pool("x", pool, prompt_tokens=20, max_tokens=30, index_blocks=[1, 2, 3],
                         rows=rows[:20])
    with pytest.raises(ValueError, match="a row for each of the 20 prompt positions"):
        cons.expect_pool("x", pool, prompt_tokens=20, max_tokens=30, index_blocks=[1, 2],
                         rows=rows[:19])
    assert pool.free_blocks == pool.num_blocks and cons.active() == []  # nothing leaked
    plain = Consumer(**{**kw, "port": port + 1})  # no row areas: no row destination
    closing(plain)
    with pytest.raises(ValueError, match="no row areas"):
        plain.expect_rows("x", rows[:20], [1, 2])


def test_row_runs_merge_consecutive_rows_within_a_source_block() -> None:
    # block 0: rows 5 6 7 | 20; block 1: 21 | 8 9 (21 follows 20 but in the next block)
    assert row_runs([5, 6, 7, 20, 21, 8, 9], 4) == [(0, 0, 5, 3), (0, 3, 20, 1), (1, 0, 21, 1),
                                                    (1, 1, 8, 2)]
    assert row_runs([], 4) == []
