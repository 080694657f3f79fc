"""SfaRemoteD2HConnector with sparse_offload.enabled: startup checks, and the decode worker
pulling the main KV into the host pool and the indexer into device blocks (admission,
failure as load errors, release on every path), over a KV allocation cut like the
engine core cuts it (no main KV on the device)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from ascend_offload.config import ConfigError, RemoteD2HConfig
from ascend_offload.connectors import remote_d2h as rd
from ascend_offload.connectors.remote_d2h.settings import check_sparse_role
from ascend_offload.connectors.sparse_decode.kv_cut import CutFacts, mark_cut
from ascend_offload.sparse.adapter import SparseDecodeAdapter
from tests.unit.pd.pool_scenario import (
    BLOCK,
    CFG,
    MAX_NEW,
    assert_pool_matches,
    build_prefill,
    producer_for,
    prompts,
    wait_sent,
)

HOT = 64
MAX_SEQS = 2
SPARSE = {"enabled": True, "topk_buffer_size": HOT, "index_topk": 32,
          "dram_size_per_dp_GB": 16 * BLOCK * CFG.num_layers * CFG.latent * 4 / 2**30}  # 16 blocks
MAINS = [f"model.layers.{i}.self_attn.attn" for i in range(CFG.num_layers)]
INDEXERS = [f"model.layers.{i}.self_attn.indexer.k_cache" for i in range(CFG.num_layers)]


def _vllm_config(*, producer: bool, port: int = 0, sparse: dict | None = None, index_topk: int | None = 32):
    extra = {"host": "127.0.0.1", "sparse_offload": sparse if sparse is not None else SPARSE}
    tc = SimpleNamespace(kv_connector_extra_config=extra, is_kv_producer=producer, is_kv_consumer=not producer,
                         engine_id="D0", kv_port=port)
    hf = SimpleNamespace(architectures=["SparseMLAForCausalLM"])
    if index_topk is not None:
        hf.index_topk = index_topk
    return SimpleNamespace(kv_transfer_config=tc, cache_config=SimpleNamespace(block_size=BLOCK),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_rank=0),
                           model_config=SimpleNamespace(use_mla=True, hf_config=hf, model="m",
                                                        max_model_len=12 * BLOCK),
                           scheduler_config=SimpleNamespace(max_num_seqs=MAX_SEQS, max_num_batched_tokens=2048),
                           speculative_config=None)


def _cut_config(dev_blocks: int) -> SimpleNamespace:
    """A worker KV cache config after the engine-core cut (roles per layer, facts attached)."""
    roles = {**{n: SimpleNamespace(cache_role="sparse") for n in MAINS},
             **{n: SimpleNamespace(cache_role=SimpleNamespace(value="indexer")) for n in INDEXERS}}
    group = SimpleNamespace(layer_names=[*INDEXERS, *MAINS], kv_cache_spec=SimpleNamespace(kv_cache_specs=roles))
    cfg = SimpleNamespace(num_blocks=dev_blocks, kv_cache_groups=[group])
    mark_cut(cfg, CutFacts(tuple(MAINS), CFG.latent * 4, 0))
    return cfg


def _cut_caches(dev_blocks: int) -> dict[str, torch.Tensor]:
    """Main-KV layers as vLLM views them after the cut (blocks one element apart over the
    hot region), indexer caches as ordinary paged tensors."""
    kv = {}
    for n in MAINS:
        raw = torch.zeros(max(MAX_SEQS * HOT, BLOCK + dev_blocks) * CFG.latent)
        kv[n] = torch.as_strided(raw, (dev_blocks, BLOCK, CFG.latent), (1, CFG.latent, 1))
    for n in INDEXERS:
        kv[n] = torch.zeros(dev_blocks, BLOCK, CFG.index_dim)
    return kv


def test_sparse_on_a_producer_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"'sparse_offload\.enabled'.*decode-side"):
        rd.SfaRemoteD2HConnector(_vllm_config(producer=True), KVConnectorRole.SCHEDULER)
    cfg = RemoteD2HConfig.model_validate({"sparse_offload": SPARSE})
    with pytest.raises(ConfigError, match=r"'sparse_offload\.enabled'"):
        check_sparse_role(cfg, is_producer=True, is_consumer=True)  # kv_both
    check_sparse_role(RemoteD2HConfig(), is_producer=True, is_consumer=False)  # off: fine


def test_sparse_decode_of_a_model_without_sparse_attention_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"'sparse_offload\.enabled'.*no sparse attention"):
        rd.SfaRemoteD2HConnector(_vllm_config(producer=False, index_topk=None), KVConnectorRole.SCHEDULER)


def test_an_uncut_kv_allocation_is_refused_naming_the_cause():
    cfg = _cut_config(8)
    del cfg.ascend_offload_sparse_cut
    with pytest.raises(ConfigError, match="was not cut"):
        rd.SfaRemoteD2HConnector(_vllm_config(producer=False), KVConnectorRole.SCHEDULER, cfg)


def _until(fn, timeout_s: float = 20.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        out = fn()
        if out:
            return out
        time.sleep(0.02)
    raise AssertionError("condition not met before the deadline")


def test_decode_worker_pulls_into_pool_fails_on_exhaustion_and_releases(monkeypatch, port):
    pytest.importorskip("mooncake.engine")
    from ascend_offload.pd.producer import DecodeTarget
    from ascend_offload.transfer.mooncake import MooncakeEngine

    monkeypatch.setattr("vllm.distributed.parallel_state.get_tensor_model_parallel_rank", lambda: 0)
    dev_blocks = 40
    conn = rd.SfaRemoteD2HConnector(_vllm_config(producer=False, port=port), KVConnectorRole.WORKER,
                                    _cut_config(dev_blocks))
    peng = MooncakeEngine(host="127.0.0.1", timeout_s=10)
    reqs = prompts()  # a: 11 pool blocks (150 + 20 tokens), b: 4, c: 8 -> c does not fit 16
    pre = build_prefill(reqs, with_indexer=True)
    prod = producer_for(pre, peng, ack_timeout_s=5.0)  # read budget 2.5 s: room for a loaded CI box
    try:
        kv = _cut_caches(dev_blocks)
        conn.register_kv_caches(kv)
        assert isinstance(conn, SparseDecodeAdapter)
        assert conn.sparse_layer_index(MAINS[2]) == 2 and conn.sparse_layer_index(INDEXERS[0]) is None
        pool = conn.decode.pool
        assert pool is conn.decode.sparse.manager.pool and pool.num_blocks == 16
        # the hot buffers are the engine's own regions of the main-KV layers
        assert conn.hot_buffer(0).data_ptr() == kv[MAINS[0]].data_ptr()
        pool.kv.zero_()
        dev = {"a": tuple(range(0, 10)), "b": (20, 21, 22), "c": (30, 31, 32, 33, 34, 35, 36)}
        jobs = [rd.RecvJob(r, dev[r], len(p), len(p) + MAX_NEW) for r, p in reqs.items()]
        conn.bind_connector_metadata(rd.RemoteD2HMetadata(recv=jobs))
        conn.start_load_kv(None)
        assert pool.admitted() == ["a", "b"]  # c refused at admission, nothing overwritten
        for rid in reqs:
            prod.add_request(rid, pre.blocks[rid], DecodeTarget("127.0.0.1", port, 1))
        for layer in range(CFG.num_layers):
            prod.publish_layer(layer)
        got: set[str] = set()
        _until(lambda: got.update(conn.get_finished(set())[1] or ()) or got == set(reqs))
        assert conn.get_block_ids_with_load_errors() == set(dev["c"])  # device blocks, not pool blocks
        assert_pool_matches(pool, pre, ["a", "b"])
        # the indexer went to the device blocks vLLM allocated, row for row
        for rid in ("a", "b"):
            n = len(reqs[rid])
            for layer in range(CFG.num_layers):
                got_idx = kv[INDEXERS[layer]][list(dev[rid])].reshape(-1, CFG.index_dim)[:n]
                assert torch.equal(got_idx, pre.index_rows[rid][layer])
        sent = {s.request_id: s.ok for s in wait_sent(prod, 3)}
        assert sent == {"a": True, "b": True, "c": False}
        conn.get_finished({"a", "b", "c"})  # vLLM finished them: rows released
        assert pool.admitted() == []
        # Finished on decode before its KV arrived: rows stay reserved until the consumer stopped.
        conn.bind_connector_metadata(rd.RemoteD2HMetadata(recv=[rd.RecvJob("d", (1, 2), 20, 30)]))
        conn.start_load_kv(None)
        conn.get_finished({"d"})
        assert pool.admitted() == ["d"]
        conn.bind_connector_metadata(rd.RemoteD2HMetadata(cancel_recv=["d"]))
        conn.start_load_kv(None)
        sending: set[str] = set()
        _until(lambda: sending.update(conn.get_finished(set())[0] or ()) or "d" in sending)
        assert pool.admitted() == [] and pool.free_blocks == pool.num_blocks
        assert conn.get_block_ids_with_load_errors() == set()
    finally:
        prod.close()
        conn.shutdown()
        peng.close()


def test_scheduler_asks_for_the_whole_prompt_reserves_max_tokens_and_waits_for_rows(monkeypatch):
    conn = rd.SfaRemoteD2HConnector(_vllm_config(producer=False, port=1), KVConnectorRole.SCHEDULER,
                                    _cut_config(40))
    submitted = []
    monkeypatch.setattr(conn.scheduler.decode.registrar, "submit",
                        lambda *a, **kw: submitted.append((*a, kw)))
    try:
        sp = SimpleNamespace(max_tokens=9)
        req = SimpleNamespace(request_id="r", num_prompt_tokens=70, max_tokens=9, kv_transfer_params={
            "do_remote_prefill": True, "metaserver": "http://127.0.0.1:1", "proxy_request_id": "p"},
            prompt_token_ids=[1] * 70, sampling_params=sp)
        assert conn.get_num_new_matched_tokens(req, 16) == (54, True)  # one block hit locally
        blocks = SimpleNamespace(get_block_ids=lambda: ([8, 3, 5, 6, 2],))
        conn.update_state_after_alloc(req, blocks, 54)
        conn.scheduler.kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: ([8, 3, 5, 6, 2],))
        out = SimpleNamespace(num_scheduled_tokens={}, finished_req_ids=set(), scheduled_new_reqs=[],
                              preempted_req_ids=set(),
                              scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[],
                                                                    resumed_req_ids=set()))
        meta = conn.build_connector_meta(out)
        # load errors name only the externally loaded device blocks; the pool gets the whole prompt
        assert meta.recv == [rd.RecvJob("r", (3, 5, 6, 2), 70, 79)]
        (_rid, _url, _prid, registration, kw), = submitted
        assert kw == {"registration_token": None}  # the proxy handed this request none
        params = registration.to_wire()  # the JSON object the metaserver receives
        assert params["remote_block_offset"] == 0 and params["remote_block_ids"] == [8, 3, 5, 6, 2]
        # the pool ledger: 16 blocks; r holds 5 (79 tokens); a 12-block request must wait
        big = SimpleNamespace(request_id="big", num_prompt_tokens=150, max_tokens=40, kv_transfer_params=None,
                              prompt_token_ids=[1] * 150, sampling_params=SimpleNamespace(max_tokens=40))
        assert conn.get_num_new_matched_tokens(big, 0) == (None, False)
        assert conn.request_finished(req, [8, 3, 5, 6, 2]) == (True, None)  # still pulling
        assert conn.get_num_new_matched_tokens(big, 0) == (None, False)  # rows not free yet
        conn.update_connector_output(SimpleNamespace(finished_recving=(), finished_sending=("r",)))
        assert conn.get_num_new_matched_tokens(big, 0) == (0, False)  # the worker let go of r's rows
    finally:
        conn.shutdown()
