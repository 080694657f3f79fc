"""The connectors' ``debug:`` blocks: test and fault hooks in the extra config (the one thing
that reaches vLLM's worker processes), typed and strict like every other key, handed by the
connector to the class each configures. Nothing reads them from the environment."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from ascend_offload.config import (
    ConfigError,
    RemoteD2HConfig,
    StoreConnectorConfig,
    parse_extra_config,
)

STORE = "AscendStoreConnector"
RD2H = "SfaRemoteD2HConnector"


def test_debug_blocks_default_off() -> None:
    store = parse_extra_config(STORE, {})
    assert isinstance(store, StoreConnectorConfig)
    assert (store.debug.save_delay_s, store.debug.fail_layer_loads) == (0.0, 0)
    rd2h = parse_extra_config(RD2H, {})
    assert isinstance(rd2h, RemoteD2HConfig) and rd2h.debug.pd_faults is None


def test_debug_blocks_parse() -> None:
    store = parse_extra_config(STORE, {"debug": {"save_delay_s": 0.25, "fail_layer_loads": 3}})
    assert (store.debug.save_delay_s, store.debug.fail_layer_loads) == (0.25, 3)
    assert parse_extra_config(RD2H, {"debug": {"pd_faults": "none,drop:2@7"}}).debug.pd_faults == "none,drop:2@7"


@pytest.mark.parametrize(("connector", "raw", "needles"), [
    # the keys these hooks had before the block: refused like any unknown key, naming it
    (STORE, {"debug_fail_layer_loads": 1}, ["'debug_fail_layer_loads'", "Extra inputs", "debug"]),
    (STORE, {"debug_save_delay_s": 0.1}, ["'debug_save_delay_s'", "Extra inputs", "debug"]),
    # a key of the block that does not exist: the message lists the block's keys
    (STORE, {"debug": {"fail_loads": 1}}, ["'debug.fail_loads'", "fail_layer_loads, save_delay_s"]),
    (STORE, {"debug": {"pd_faults": "drop:1"}}, ["'debug.pd_faults'", "fail_layer_loads, save_delay_s"]),
    (RD2H, {"debug": {"fail_layer_loads": 1}}, ["'debug.fail_layer_loads'", "one of the keys: pd_faults"]),
    (STORE, {"debug": {"save_delay_s": -1}}, ["'debug.save_delay_s'", "greater than or equal to 0"]),
    (STORE, {"debug": {"fail_layer_loads": -1}}, ["'debug.fail_layer_loads'"]),
    (RD2H, {"debug": {"pd_faults": "drop:x"}}, ["'debug.pd_faults'", "drop:<layer>[@<blocks>]"]),
    (RD2H, {"debug": {"pd_faults": "boom:1"}}, ["'debug.pd_faults'", "'boom:1'"]),
])
def test_debug_errors_name_the_key(connector: str, raw: dict[str, Any], needles: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        parse_extra_config(connector, raw)
    for n in needles:
        assert n in str(e.value), (n, str(e.value))


def _rd2h_vllm_config(extra: dict[str, Any], *, producer: bool) -> Any:
    tc = SimpleNamespace(kv_connector_extra_config={"host": "127.0.0.1", **extra}, is_kv_producer=producer,
                         is_kv_consumer=not producer, engine_id="E0", kv_port=1)
    return SimpleNamespace(kv_transfer_config=tc, cache_config=SimpleNamespace(block_size=16),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_rank=0),
                           model_config=SimpleNamespace(use_mla=True, hf_config=None))


def test_pd_faults_are_a_prefill_key() -> None:
    """Only the prefill's producers inject faults: on a decode the key would silently do
    nothing, so a fault test would pass without its faults."""
    from ascend_offload.connectors.remote_d2h.settings import parse_config

    with pytest.raises(ConfigError, match=r"'debug.pd_faults'='drop:2'.*kv_producer"):
        parse_config(_rd2h_vllm_config({"debug": {"pd_faults": "drop:2"}}, producer=False))
    assert parse_config(_rd2h_vllm_config({"debug": {"pd_faults": "drop:2"}}, producer=True)).debug.pd_faults


@pytest.mark.parametrize(("extra", "faults"), [
    ({"debug": {"pd_faults": "drop:2@7,none"}}, [("drop", 2, 7), None]),
    ({}, []),
])
def test_prefill_worker_hands_pd_faults_to_its_producers(monkeypatch: pytest.MonkeyPatch, extra: dict[str, Any],
                                                         faults: list[Any]) -> None:
    """The producer's faults come from the connector's config; the environment variable that
    once carried them is not read."""
    from ascend_offload.connectors.remote_d2h.kv_region import open_region
    from ascend_offload.connectors.remote_d2h.prefill_worker import PrefillWorker
    from ascend_offload.connectors.remote_d2h.settings import build_settings, parse_config
    from ascend_offload.pd.layout import layer_desc
    from ascend_offload.transfer.base import LoopbackEngine

    monkeypatch.setenv("ASCEND_OFFLOAD_PD_FAULTS", "invalid:0")
    vc = _rd2h_vllm_config(extra, producer=True)
    settings = build_settings(vc, parse_config(vc))
    kv = np.zeros((2, 4, 64), dtype=np.uint8)
    region = open_region([layer_desc([kv[0], kv[1]])], settings.cfg, "127.0.0.1", engine=LoopbackEngine())
    worker = PrefillWorker(settings, 0, prepare=lambda: None)
    worker.start(region, ["l0"])
    producer = worker._producer(1)
    try:
        assert producer._faults == faults
    finally:
        producer.close()
        region.close()


def test_store_worker_hands_its_debug_block_to_the_pipeline(monkeypatch: pytest.MonkeyPatch) -> None:
    from ascend_offload.connectors.store import worker as store_worker
    from ascend_offload.connectors.store.settings import StoreSettings
    from ascend_offload.layerwise.plan import plan_uniform

    class Built(Exception):
        """Stops register_kv_caches once the pipeline's arguments are known."""

    cfg = parse_extra_config(STORE, {"use_layerwise": True, "debug": {"save_delay_s": 0.25, "fail_layer_loads": 3}})
    settings = StoreSettings(cfg=cfg, block_size=16, hash_ratio=1, object_bytes=2 * 512, page_bytes=2 * 512,
                             num_pages=4, world_size=1, fingerprint="fp", engine_id="e")
    plan = plan_uniform(2, 1, [0])
    monkeypatch.setattr("ascend_offload.connectors.kv_layout_hook.plan_for_engine", lambda *a: plan)
    seen: dict[str, Any] = {}

    def pipeline(*args: Any, **kw: Any) -> Any:
        seen.update(kw)
        raise Built

    monkeypatch.setattr(store_worker, "LayerwisePipeline", pipeline)
    worker = store_worker.LayerwiseWorker(settings, None, SimpleNamespace(num_blocks=8))  # type: ignore[arg-type]
    with pytest.raises(Built):
        worker.register_kv_caches({name: torch.zeros(8, 2, 16, 8) for name in plan.layers})
    assert (seen["save_delay_s"], seen["fail_loads"]) == (0.25, 3)
