"""SfaRemoteD2HConnector with hybrid residency on its sparse decode: the scheduler places a
pulled request when it registers the pull (vLLM's real block pool lends the blocks) and
keeps it pinned until vLLM first schedules it; the decode worker applies the placement
before it expects the pull and lands the main KV straight in the resident rows; after the
worker attached it, a preemption moves exactly the pulled rows to its pool rows (main KV
kept, indexer stashed and loaded back on resumption)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.block_pool import BlockPool

from ascend_offload.connectors import remote_d2h as rd
from ascend_offload.connectors.sparse_decode.kv_cut import CutFacts, mark_cut
from ascend_offload.connectors.sparse_decode.scheduler import SparseDecodeMetadata
from ascend_offload.sparse.hybrid import GrowOp, MoveOp, ResidentBook
from ascend_offload.sparse.preemption import ResumeOrder, StashOrder
from tests.unit.pd.pool_scenario import (
    BLOCK,
    CFG,
    assert_pool_matches,
    build_prefill,
    producer_for,
    prompts,
    wait_sent,
)
from tests.unit.pd.test_connector_sparse import (
    INDEXERS,
    MAINS,
    SPARSE,
    _cut_caches,
    _cut_config,
    _until,
    _vllm_config,
)

HYBRID = {
    **SPARSE,
    "hybrid": True,  # a host pool of 64 blocks
    "dram_size_per_dp_GB": 64 * BLOCK * CFG.num_layers * CFG.latent * 4 / 2**30,
}
PAGE = BLOCK * CFG.index_dim * 4  # one block of an indexer layer: 512 B = 8 main-KV rows
DEV_BLOCKS = 40


def _hybrid_cut_config(dev_blocks: int = DEV_BLOCKS) -> SimpleNamespace:
    """The cut config plus what hybrid residency plans with: the indexer layers' block
    layout (layer-outermost pages of ``PAGE``) and their page size."""
    cfg = _cut_config(dev_blocks)
    cfg.kv_cache_tensors = [
        SimpleNamespace(layers=list(INDEXERS), block_stride=PAGE, layer_stride=PAGE * dev_blocks)
    ]
    mark_cut(cfg, CutFacts(tuple(MAINS), CFG.latent * 4, 0, index_page=PAGE))
    return cfg


def _out(new=(), cached=(), scheduled=None, finished=(), preempted=()) -> SimpleNamespace:
    """A SchedulerOutput with the fields the connector reads."""
    ids = [r for r, _ in cached]
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        num_scheduled_tokens=dict(scheduled or {}),
        finished_req_ids=set(finished),
        preempted_req_ids=set(preempted),
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=ids, num_computed_tokens=[n for _, n in cached], resumed_req_ids=set()
        ),
    )


def _pulled(rid: str, n: int) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=rid,
        num_prompt_tokens=n,
        num_tokens=n,
        max_tokens=10,
        prompt_token_ids=[1] * n,
        sampling_params=SimpleNamespace(max_tokens=10),
        kv_transfer_params={
            "do_remote_prefill": True,
            "metaserver": "http://127.0.0.1:1",
            "proxy_request_id": f"p-{rid}",
        },
    )


def test_scheduler_places_pulls_pins_them_until_scheduled_and_never_moves_them_early(monkeypatch):
    conn = rd.SfaRemoteD2HConnector(
        _vllm_config(producer=False, port=1, sparse=HYBRID),
        KVConnectorRole.SCHEDULER,
        _hybrid_cut_config(),
    )
    monkeypatch.setattr(conn.scheduler.decode.registrar, "submit", lambda *a, **kw: None)
    pool = BlockPool(DEV_BLOCKS, False, BLOCK)  # vLLM's own: block 0 is its null block
    held: dict[str, list[int]] = {}
    # vLLM binds its KV cache manager; the base class hands us its block pool from there
    conn.bind_kv_cache_manager(
        SimpleNamespace(block_pool=pool, get_block_ids=lambda rid: (held[rid],))
    )
    book = conn.scheduler.hybrid
    assert isinstance(book, ResidentBook) and book.keep_free == 4

    def pull(rid: str, n: int) -> None:
        req = _pulled(rid, n)
        count, load_async = conn.get_num_new_matched_tokens(req, 0)
        assert (count, load_async) == (n, True)
        held[rid] = [b.block_id for b in pool.get_new_blocks(-(-n // BLOCK))]  # vLLM allocates
        conn.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (held[rid],)), n)

    try:
        free0 = pool.get_num_free_blocks()  # 39
        pull("c", 40)  # 3 own blocks; resident: 5 borrowed blocks of 8 rows
        pull("r", 70)  # 5 own blocks; resident: 9 borrowed blocks
        assert book.holds("c") and book.holds("r") and book.pinned == {"c", "r"}
        assert book.borrowed == 14
        pull("big", 150)  # 10 own blocks; 22 more would not fit the 3 spare ones
        assert not book.holds("big") and not book.placeable("big")
        assert pool.get_num_free_blocks() == free0 - 3 - 5 - 5 - 9 - 10 == 7
        # only pinned residents: vLLM is not told to wait for blocks (it preempts or waits
        # as without residents), and a waiting pull that does not fit is not held back
        assert not conn.has_pending_block_frees()
        assert conn.get_num_new_matched_tokens(_pulled("w", 100), 0) == (100, True)
        meta = conn.build_connector_meta(_out())
        assert [(type(o), o.req_id, len(o.blocks)) for o in meta.sparse.hybrid_ops] == [
            (GrowOp, "c", 5),
            (GrowOp, "r", 9),
        ]
        assert [j.request_id for j in meta.recv] == ["c", "r", "big"]  # the same step's pulls
        assert meta.idle  # nothing computed this step: the workers may wait for a pull
        conn.update_connector_output(
            SimpleNamespace(finished_recving=("r", "big"), finished_sending=())
        )
        # vLLM schedules "r" and "big" (the last prompt token): "r" grows within its rows,
        # "big" landed in the pool and is never placed; "r" is attached by the workers now
        new = [
            SimpleNamespace(
                req_id=rid,
                num_computed_tokens=n - 1,
                prompt_token_ids=[1] * n,
                sampling_params=SimpleNamespace(max_tokens=10),
            )
            for rid, n in (("r", 70), ("big", 150))
        ]
        meta = conn.build_connector_meta(_out(new=new, scheduled={"r": 1, "big": 1}))
        assert meta.sparse.hybrid_ops == () and not book.holds("big") and book.pinned == {"c"}
        assert not meta.idle
        # vLLM wants 13 blocks for "w2": "r" moves at the end of the step, "c" (older, still
        # pulling) does not, though 16 free blocks are still short of 13 + 4 kept free
        assert conn.has_pending_block_frees()
        assert conn.get_num_new_matched_tokens(_pulled("w2", 190), 0) == (None, False)
        meta = conn.build_connector_meta(
            _out(cached=[("r", 70), ("big", 150)], scheduled={"r": 1, "big": 1})
        )
        assert meta.sparse.hybrid_ops == (MoveOp("r"),)
        assert book.holds("c") and pool.get_num_free_blocks() == 16
        assert book.counters.moved_requests == 1
        # "c" finished while its pull runs: its borrowed blocks stay until the pull stopped
        assert conn.request_finished(_pulled("c", 40), held["c"]) == (True, None)
        conn.build_connector_meta(_out(finished={"c"}))
        assert book.holds("c") and pool.get_num_free_blocks() == 16
        conn.update_connector_output(SimpleNamespace(finished_recving=(), finished_sending=("c",)))
        assert not book.holds("c") and book.pinned == set() and len(book) == 0
        assert pool.get_num_free_blocks() == 16 + 5
        # a resident pulled request that vLLM preempts moves to the pool in that step (its
        # main KV kept there; the workers copy its rows before the forward)
        pull("p", 40)
        assert book.holds("p")
        conn.build_connector_meta(_out())
        conn.update_connector_output(SimpleNamespace(finished_recving=("p",), finished_sending=()))
        new = [
            SimpleNamespace(
                req_id="p",
                num_computed_tokens=39,
                prompt_token_ids=[1] * 40,
                sampling_params=SimpleNamespace(max_tokens=10),
            )
        ]
        conn.build_connector_meta(_out(new=new, scheduled={"p": 1}))
        conn.build_connector_meta(_out(cached=[("p", 40)], scheduled={"p": 1}))
        meta = conn.build_connector_meta(_out(preempted={"p"}))
        assert meta.sparse.hybrid_ops == (MoveOp("p"),) and meta.sparse.preempted["p"].tokens == 41
        assert not book.holds("p") and book.counters.moved_requests == 2
    finally:
        conn.shutdown()


def test_decode_worker_lands_resident_pulls_in_their_rows_and_moves_them_bit_for_bit(
    monkeypatch, port
):
    pytest.importorskip("mooncake.engine")
    from ascend_offload.pd.producer import DecodeTarget
    from ascend_offload.transfer.mooncake import MooncakeEngine

    monkeypatch.setattr("vllm.distributed.parallel_state.get_tensor_model_parallel_rank", lambda: 0)
    conn = rd.SfaRemoteD2HConnector(
        _vllm_config(producer=False, port=port, sparse=HYBRID),
        KVConnectorRole.WORKER,
        _hybrid_cut_config(),
    )
    peng = MooncakeEngine(host="127.0.0.1", timeout_s=10)
    reqs = prompts({"a": 70, "b": 37})
    pre = build_prefill(reqs, with_indexer=True)
    prod = producer_for(pre, peng, ack_timeout_s=5.0)

    def step(**sparse) -> None:
        recv = sparse.pop("recv", [])
        conn.bind_connector_metadata(
            rd.RemoteD2HMetadata(
                recv=recv,
                sparse=SparseDecodeMetadata(
                    sparse.pop("new", {}), {}, sparse.pop("finished", ()), **sparse
                ),
            )
        )
        conn.start_load_kv(None)

    try:
        kv = _cut_caches(DEV_BLOCKS)
        for n in INDEXERS:
            kv[n].fill_(-7.0)
        conn.register_kv_caches(kv)
        dec = conn.decode
        area = dec.sparse.manager.area
        assert area is not None and dec.row_areas is not None
        # the resident rows are the indexer caches' own memory, registered with the wire layers
        assert [a.base_addr for a in dec.row_areas] == [kv[n].data_ptr() for n in INDEXERS]
        assert [a.row_bytes for a in dec.row_areas] == [CFG.latent * 4] * CFG.num_layers
        pool = dec.pool
        pool.kv.zero_()
        borrowed = (13, 5, 6, 20, 2, 17, 9, 10, 22)
        dev = {"a": (3, 11, 4, 15, 0), "b": (30, 31, 32)}
        before = {n: kv[n].clone() for n in INDEXERS}
        # one step: "a" placed (its growth first), "a" and "b" pulled
        step(
            hybrid_ops=(GrowOp("a", borrowed),),
            recv=[rd.RecvJob(r, dev[r], len(p), len(p) + 20) for r, p in reqs.items()],
        )
        assert dec.landed_resident == 1 and sorted(pool.admitted()) == ["a", "b"]
        for rid in reqs:
            prod.add_request(rid, pre.blocks[rid], DecodeTarget("127.0.0.1", port, 1))
        for layer in range(CFG.num_layers):
            prod.publish_layer(layer)
        got: set[str] = set()
        _until(lambda: got.update(conn.get_finished(set())[1] or ()) or got == set(reqs))
        assert conn.get_block_ids_with_load_errors() == set()
        rows = area.rows("a")[:70]
        for layer in range(CFG.num_layers):
            # the main KV in the resident rows, the indexer in the device blocks
            assert torch.equal(area.view(layer)[rows], pre.rows["a"][layer])
            for rid, blocks in dev.items():
                n = len(reqs[rid])
                got_idx = kv[INDEXERS[layer]][list(blocks)].reshape(-1, CFG.index_dim)[:n]
                assert torch.equal(got_idx, pre.index_rows[rid][layer])
            # and nothing else of the indexer cache changed
            touched = torch.zeros(DEV_BLOCKS, dtype=torch.bool)
            touched[[*borrowed, *dev["a"], *dev["b"]]] = True
            assert torch.equal(kv[INDEXERS[layer]][~touched], before[INDEXERS[layer]][~touched])
        assert not pool.kv[:, pool.rows_for("a", torch.arange(90))].any()  # reserved, unwritten
        assert_pool_matches(pool, pre, ["b"])
        assert {s.request_id: s.ok for s in wait_sent(prod, 2)} == {"a": True, "b": True}
        # vLLM schedules "a" (attached with its 69 computed positions), then moves it: the
        # pool gets exactly the pulled rows
        step(new={"a": 90}, computed={"a": 69})
        assert dec.sparse.decode.resident("a") and dec.sparse.decode.pooled("a") == 69
        # vLLM preempts it: the step stashes its indexer rows and moves its main KV to the
        # pool (what the scheduler orders, see the test above)
        step(preempted={"a": StashOrder(69, (dev["a"],))}, hybrid_ops=(MoveOp("a"),))
        assert not dec.sparse.decode.resident("a")
        host = pool.rows_for("a", torch.arange(69))
        for layer in range(CFG.num_layers):
            assert torch.equal(pool.layer(layer)[host], pre.rows["a"][layer][:69])
            kv[INDEXERS[layer]][list(dev["a"])] = -1.0  # vLLM reuses its freed blocks
        # resumed in other blocks: its indexer rows come back from the stash, its main KV
        # stays in the pool (nothing recomputed)
        moved = (33, 34, 35, 36, 37)
        step(resumed={"a": ResumeOrder(69, (moved,))})
        assert conn.get_block_ids_with_load_errors() == set()
        for layer in range(CFG.num_layers):
            got_idx = kv[INDEXERS[layer]][list(moved)].reshape(-1, CFG.index_dim)[:69]
            assert torch.equal(got_idx, pre.index_rows["a"][layer][:69])
        c = dec.sparse.decode.counters()
        assert c["placed_requests"] == 1 and c["moved_requests"] == 1
        assert c["moved_bytes"] == 69 * CFG.num_layers * CFG.latent * 4
        step(finished=("a", "b"))
        conn.get_finished({"a", "b"})
        assert pool.admitted() == [] and len(area) == 0
    finally:
        prod.close()
        conn.shutdown()
        peng.close()
        time.sleep(0)
