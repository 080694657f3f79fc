"""AscendSparseDecodeConnector's startup checks and stats, without an engine
(imports vLLM's connector base)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ascend_offload.config import ConfigError, parse_extra_config
from ascend_offload.connectors.sparse_decode.metrics import SparseDecodeStats, StatsReporter
from ascend_offload.connectors.sparse_decode.settings import model_index_topk


def _vllm_config(**hf: object) -> SimpleNamespace:
    return SimpleNamespace(model_config=SimpleNamespace(
        model="m", hf_config=SimpleNamespace(architectures=["X"], **hf)))


def test_a_model_without_sparse_attention_is_refused_naming_the_key() -> None:
    assert model_index_topk(_vllm_config(index_topk=32)) == 32
    for hf in ({}, {"index_topk": 32, "use_sparse_attention": False}):
        with pytest.raises(ConfigError, match=r"'sparse_offload.enabled'=True.*no sparse attention"):
            model_index_topk(_vllm_config(**hf))


def test_extra_config_is_strict_and_off_by_default() -> None:
    cfg = parse_extra_config("AscendSparseDecodeConnector", {})
    assert cfg.sparse_offload.enabled is False
    with pytest.raises(ConfigError, match="topk_buffer"):
        parse_extra_config("AscendSparseDecodeConnector", {"sparse_offload": {"topk_buffer": 64}})


def test_stats_report_deltas_seconds_and_gauges() -> None:
    rep = StatsReporter()
    totals = {"resolved_positions": 10, "hit_positions": 4, "miss_rows": 6, "resolve_ns": 2_000}
    first = rep.take(totals, {"pool_rows_used": 64})
    assert first is not None
    assert first.data == {"resolved_positions": 10, "hit_positions": 4, "miss_rows": 6,
                          "resolve_seconds": 2e-6, "pool_rows_used": 64, "hit_rate": 0.4}
    assert rep.take(totals, {"pool_rows_used": 64}) is None  # nothing new
    second = rep.take(dict(totals, resolved_positions=20, hit_positions=14), {"pool_rows_used": 0})
    assert second is not None and second.data["hit_rate"] == 1.0
    merged = first.aggregate(second)
    assert isinstance(merged, SparseDecodeStats)
    assert merged.data["resolved_positions"] == 20  # counters add up
    assert merged.data["pool_rows_used"] == 0  # gauges keep the latest
    # an unchanged gauge does not travel with every step's counters; a gauge that
    # changed alone is a report of its own
    third = rep.take(dict(totals, resolved_positions=20, hit_positions=14, miss_rows=7),
                     {"pool_rows_used": 0})
    assert third is not None and third.data == {"miss_rows": 1}
    fourth = rep.take(dict(totals, resolved_positions=20, hit_positions=14, miss_rows=7),
                      {"pool_rows_used": 5})
    assert fourth is not None and fourth.data == {"pool_rows_used": 5}
    assert merged.aggregate(third).aggregate(fourth).data["pool_rows_used"] == 5


def _recording_worker(applied: list[object]) -> SimpleNamespace:
    """A worker stand-in with the real one's apply-once contract (``applied``: the last
    metadata applied)."""
    w = SimpleNamespace(applied=None)

    def apply(meta: object) -> None:
        applied.append(meta)
        w.applied = meta

    w.apply = apply
    return w


def test_the_first_layer_hook_applies_the_step_metadata() -> None:
    """vLLM calls start_load_kv after the forward unless a load is synchronous, and a layer
    writes its new indexer rows before its first adapter call: wait_for_layer_load must
    apply the step's orders (a prefix-cache keep copies rows of blocks freed last step,
    which this step may overwrite) where binding did not, once."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from ascend_offload.connectors.sparse_decode.connector import (
        AscendSparseDecodeConnector,
        SparseDecodeMetadata,
    )

    applied: list[object] = []
    conn = AscendSparseDecodeConnector.__new__(AscendSparseDecodeConnector)
    conn.worker = _recording_worker(applied)  # type: ignore[assignment]
    meta = SparseDecodeMetadata({}, {}, ())
    KVConnectorBase_V1.bind_connector_metadata(conn, meta)  # the base class's: no apply
    conn.wait_for_layer_load("model.layers.0.self_attn.attn")
    conn.wait_for_layer_load("model.layers.1.self_attn.attn")
    assert applied == [meta]


def test_binding_applies_the_step_metadata_once() -> None:
    """The connector applies a step's metadata when vLLM binds it (before the forward);
    every hook of the step after that finds it applied, and the next step's binding
    applies the next one."""
    from ascend_offload.connectors.sparse_decode.connector import (
        AscendSparseDecodeConnector,
        SparseDecodeMetadata,
    )

    applied: list[object] = []
    conn = AscendSparseDecodeConnector.__new__(AscendSparseDecodeConnector)
    conn.worker = _recording_worker(applied)  # type: ignore[assignment]
    first, second = SparseDecodeMetadata({}, {}, ()), SparseDecodeMetadata({}, {}, ())
    conn.bind_connector_metadata(first)
    assert applied == [first]
    for layer in range(4):
        conn.wait_for_layer_load(f"model.layers.{layer}.self_attn.attn")
    conn.start_load_kv(None)  # type: ignore[arg-type]
    assert applied == [first]
    conn.clear_connector_metadata()
    conn.bind_connector_metadata(second)
    assert applied == [first, second]


def test_a_report_reads_the_gauges_only_after_the_holdings_changed() -> None:
    """The gauges (pool rows, admitted and resident requests, stash bytes) change only with
    a step's orders; a report between such steps carries the counters alone, and the next
    one after an order reads the gauges again."""
    from ascend_offload.connectors.sparse_decode.connector import AscendSparseDecodeConnector
    from ascend_offload.connectors.sparse_decode.metrics import StatsReporter

    reads: list[int] = []
    totals = {"steps": 0}

    def gauges() -> dict[str, int]:
        reads.append(1)
        return {"admitted_requests": len(reads)}

    decode = SimpleNamespace(counters=lambda: dict(totals), gauges=gauges)
    worker = SimpleNamespace(decode=decode, holdings_version=0,
                             device_kv_gauges=lambda: {"device_kv_bytes": 64})
    conn = AscendSparseDecodeConnector.__new__(AscendSparseDecodeConnector)
    conn.worker = worker  # type: ignore[assignment]
    conn._reporter = StatsReporter()
    conn._gauges_version = -1
    totals["steps"] = 1
    first = conn.get_kv_connector_stats()
    assert first is not None and first.data == {"steps": 1, "admitted_requests": 1,
                                                 "device_kv_bytes": 64}
    totals["steps"] = 2
    second = conn.get_kv_connector_stats()
    assert second is not None and second.data == {"steps": 1} and len(reads) == 1
    worker.holdings_version = 1  # a step admitted or finished a request
    totals["steps"] = 3
    third = conn.get_kv_connector_stats()
    assert third is not None and third.data == {"steps": 1, "admitted_requests": 2}
    assert len(reads) == 2
