"""SfaRemoteD2HConnector with sparse_offload.enabled: role/hook checks at startup, and the decode
worker pulling into the host pool (admission, failure as load errors, release on every path)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from ascend_offload.config import ConfigError, RemoteD2HConfig
from ascend_offload.connectors import remote_d2h as rd
from ascend_offload.connectors.remote_d2h.decode_worker import SPARSE_HOOK_ENV
from ascend_offload.connectors.remote_d2h.settings import check_sparse_role
from ascend_offload.pd.layout import pool_row_shape
from tests.unit.pd.pool_scenario import (
    BLOCK,
    CFG,
    MAX_NEW,
    RecordingHook,
    assert_pool_matches,
    build_prefill,
    producer_for,
    prompts,
    wait_sent,
)

SPARSE = {"enabled": True, "topk_buffer_size": 64, "index_topk": 32,
          "dram_size_per_dp_GB": 16 * BLOCK * CFG.num_layers * CFG.latent * 4 / 2**30}  # 16 blocks


def _vllm_config(*, producer: bool, port: int = 0, sparse: dict | None = None):
    extra = {"host": "127.0.0.1", "sparse_offload": sparse if sparse is not None else SPARSE}
    tc = SimpleNamespace(kv_connector_extra_config=extra, is_kv_producer=producer, is_kv_consumer=not producer,
                         engine_id="D0", kv_port=port)
    return SimpleNamespace(kv_transfer_config=tc, cache_config=SimpleNamespace(block_size=BLOCK),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_rank=0),
                           model_config=SimpleNamespace(use_mla=True))


def test_sparse_on_a_producer_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"'sparse_offload\.enabled'.*decode-side"):
        rd.SfaRemoteD2HConnector(_vllm_config(producer=True), KVConnectorRole.SCHEDULER)
    cfg = RemoteD2HConfig.model_validate({"sparse_offload": SPARSE})
    with pytest.raises(ConfigError, match=r"'sparse_offload\.enabled'"):
        check_sparse_role(cfg, is_producer=True, is_consumer=True)  # kv_both
    check_sparse_role(RemoteD2HConfig(), is_producer=True, is_consumer=False)  # off: fine


def test_sparse_decode_without_attention_hook_is_refused(monkeypatch):
    monkeypatch.delenv(SPARSE_HOOK_ENV, raising=False)
    with pytest.raises(ConfigError, match=rf"'sparse_offload\.enabled'.*{SPARSE_HOOK_ENV}"):
        rd.SfaRemoteD2HConnector(_vllm_config(producer=False), KVConnectorRole.SCHEDULER)
    monkeypatch.setenv(SPARSE_HOOK_ENV, "no_such_module_xyz:make")
    with pytest.raises(ConfigError, match="cannot load"):
        rd.SfaRemoteD2HConnector(_vllm_config(producer=False), KVConnectorRole.SCHEDULER)


def test_pool_row_shape_needs_one_mla_row_per_token():
    nb = 4
    assert pool_row_shape({"l0": torch.zeros(nb, BLOCK, 8), "l1": torch.zeros(nb, BLOCK, 8)},
                          nb, BLOCK) == ((8,), torch.float32)
    with pytest.raises(ConfigError, match="not one"):
        pool_row_shape({"l0": torch.zeros(2, nb, BLOCK, 2, 4)}, nb, BLOCK)  # K/V pair
    with pytest.raises(ConfigError, match=r"\(8,\).*\(4,\)|\(4,\).*\(8,\)"):
        pool_row_shape({"l0": torch.zeros(nb, BLOCK, 8), "l1": torch.zeros(nb, BLOCK, 4)}, nb, BLOCK)


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

    monkeypatch.setenv(SPARSE_HOOK_ENV, "tests.unit.pd.pool_scenario:RecordingHook")
    monkeypatch.setattr("vllm.distributed.parallel_state.get_tensor_model_parallel_rank", lambda: 0)
    dev_blocks = 40
    conn = rd.SfaRemoteD2HConnector(_vllm_config(producer=False, port=port), KVConnectorRole.WORKER,
                                    SimpleNamespace(num_blocks=dev_blocks))
    peng = MooncakeEngine(host="127.0.0.1", timeout_s=10)
    reqs = prompts()  # a: 11 pool blocks (150 + 20 tokens), b: 4, c: 8 -> c does not fit 16
    pre = build_prefill(reqs)
    prod = producer_for(pre, peng, ack_timeout_s=5.0)  # read budget 2.5 s: room for a loaded CI box
    try:
        kv = {f"model.layers.{i}.self_attn.attn": torch.zeros(dev_blocks, BLOCK, CFG.latent)
              for i in range(CFG.num_layers)}
        conn.register_kv_caches(kv)
        hook = RecordingHook.made[-1]
        pool = hook.pool
        assert pool is conn.decode.pool and pool.num_blocks == 16 and hook.layer_names == sorted(kv)
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
        assert not kv["model.layers.0.self_attn.attn"].any()  # main KV went to the pool only
        sent = {s.request_id: s.ok for s in wait_sent(prod, 3)}
        assert sent == {"a": True, "b": True, "c": False}
        conn.get_finished({"a", "b", "c"})  # vLLM finished them: rows released
        assert pool.admitted() == [] and sorted(hook.finished) == ["a", "b", "c"]
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


def test_scheduler_asks_for_the_whole_prompt_and_reserves_max_tokens(monkeypatch):
    monkeypatch.setenv(SPARSE_HOOK_ENV, "tests.unit.pd.pool_scenario:RecordingHook")
    conn = rd.SfaRemoteD2HConnector(_vllm_config(producer=False, port=1), KVConnectorRole.SCHEDULER)
    submitted = []
    monkeypatch.setattr(conn.scheduler.decode.registrar, "submit",
                        lambda *a, **kw: submitted.append((*a, kw)))
    try:
        req = SimpleNamespace(request_id="r", num_prompt_tokens=70, max_tokens=9, kv_transfer_params={
            "do_remote_prefill": True, "metaserver": "http://127.0.0.1:1", "proxy_request_id": "p"})
        assert conn.get_num_new_matched_tokens(req, 16) == (54, True)  # one block hit locally
        blocks = SimpleNamespace(get_block_ids=lambda: ([8, 3, 5, 6, 2],))
        conn.update_state_after_alloc(req, blocks, 54)
        meta = conn.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
        # load errors name only the externally loaded device blocks; the pool gets the whole prompt
        assert meta.recv == [rd.RecvJob("r", (3, 5, 6, 2), 70, 79)]
        (_rid, _url, _prid, registration, kw), = submitted
        assert kw == {"registration_token": None}  # the proxy handed this request none
        params = registration.to_wire()  # the JSON object the metaserver receives
        assert params["remote_block_offset"] == 0 and params["remote_block_ids"] == [8, 3, 5, 6, 2]
    finally:
        conn.shutdown()
