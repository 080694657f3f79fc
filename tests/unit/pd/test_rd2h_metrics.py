"""SfaRemoteD2HConnector's Prometheus counters: worker totals become per-report deltas,
vLLM aggregates them, and they land in ``vllm:ascend_offload_rd2h_*`` counters."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ascend_offload.connectors.metrics import (
    RD2H_COUNTERS,
    RD2H_GAUGES,
    CounterDeltas,
    RD2HConnectorStats,
    RD2HPromMetrics,
)
from ascend_offload.connectors.remote_d2h import SfaRemoteD2HConnector
from ascend_offload.connectors.remote_d2h.decode_worker import DecodeWorker
from ascend_offload.connectors.remote_d2h.prefill_worker import PrefillWorker
from ascend_offload.pd.consumer_records import ConsumerStats
from ascend_offload.pd.producer import ProducerStats


def _registry_types(reg: CollectorRegistry) -> dict[type, type]:
    def bind(cls: type) -> type:
        class Bound(cls):  # type: ignore[misc, valid-type]
            def __init__(self, *a, **kw) -> None:
                super().__init__(*a, registry=reg, **kw)
        return Bound

    return {Gauge: bind(Gauge), Counter: bind(Counter), Histogram: bind(Histogram)}


def test_deltas_reach_prometheus_counters() -> None:
    # Workers without engines: only their counters are read here.
    conn = SfaRemoteD2HConnector.__new__(SfaRemoteD2HConnector)
    conn._deltas = CounterDeltas(RD2HConnectorStats)
    state = {"inflight": 2, "parked": 1, "active": ["r1"], "slots": {0: 3}}
    cons = SimpleNamespace(stats=ConsumerStats(reads=6, bytes_read=6144, descriptors=3, failed=1, rejected=2),
                           inflight=lambda: state["inflight"], parked=lambda: state["parked"],
                           active=lambda: list(state["active"]))
    conn.decode = DecodeWorker.__new__(DecodeWorker)
    conn.decode.consumer, conn.decode.sparse, conn.decode.landed_resident = cons, None, 2
    conn.prefill = PrefillWorker.__new__(PrefillWorker)
    conn.prefill.gate_holds, conn.prefill.gate_hold_failures = 4, 1
    conn.prefill._late = SimpleNamespace(claimed=3, failures=1, waiting=2)
    conn.prefill._producers = {1: SimpleNamespace(stats=ProducerStats(published_items=6, acked=5, stale=1,
                                                                       timed_out=1, rejected=1),
                                                      pending_slots=lambda: dict(state["slots"]))}
    first = conn.get_kv_connector_stats()
    assert isinstance(first, RD2HConnectorStats)
    assert first.data == {"layers_pulled": 6, "bytes_pulled": 6144, "read_descriptors": 3, "read_failures": 1,
                          "rejected_messages": 3, "layers_published": 6, "acks": 5, "acks_late": 1,
                          "ack_timeouts": 1, "gate_holds": 4, "gate_hold_failures": 1,
                          "late_claims": 3, "late_claim_failures": 1,
                          "resident_pulls": 2,
                          "inflight_reads": 2, "parked_messages": 1, "active_requests": 1,
                          "pending_slot_uses": 1, "late_sends_waiting": 2}
    assert set(first.data) <= set(RD2H_COUNTERS) | set(RD2H_GAUGES)
    assert conn.get_kv_connector_stats() is None  # nothing new since
    cons.stats.reads += 2
    cons.stats.bytes_read += 2048
    second = conn.get_kv_connector_stats()
    # the gauges did not change: only the moved counters travel
    assert second is not None and second.data == {"layers_pulled": 2, "bytes_pulled": 2048}
    state["inflight"] = 1
    cons.stats.reads += 1
    third = conn.get_kv_connector_stats()
    assert third is not None and third.data == {"layers_pulled": 1, "inflight_reads": 1}
    second = second.aggregate(third)
    total = first.aggregate(second)
    assert isinstance(total, RD2HConnectorStats) and total.data["layers_pulled"] == 9
    assert total.data["inflight_reads"] == 1 and total.data["parked_messages"] == 1

    reg = CollectorRegistry()
    vcfg = SimpleNamespace(kv_transfer_config=None)
    prom = SfaRemoteD2HConnector.build_prom_metrics(vcfg, _registry_types(reg), ["engine"], {0: ["0"]})
    assert isinstance(prom, RD2HPromMetrics)
    prom.observe(total.reduce(), engine_idx=0)
    assert reg.get_sample_value("vllm:ascend_offload_rd2h_layers_pulled_total", {"engine": "0"}) == 9
    assert reg.get_sample_value("vllm:ascend_offload_rd2h_bytes_pulled_total", {"engine": "0"}) == 8192
    assert reg.get_sample_value("vllm:ascend_offload_rd2h_acks_late_total", {"engine": "0"}) == 1
    assert reg.get_sample_value("vllm:ascend_offload_rd2h_send_errors_total", {"engine": "0"}) == 0


def test_idle_gauges_reach_prometheus_and_return_to_zero() -> None:
    """The leak-check gauges: reported when they change (also back to 0, with no counter
    moving), the latest value wins under aggregation, and Prometheus shows it."""
    conn = SfaRemoteD2HConnector.__new__(SfaRemoteD2HConnector)
    conn._deltas = CounterDeltas(RD2HConnectorStats)
    state = {"inflight": 3, "parked": 2, "active": ["a", "b"]}
    conn.decode = DecodeWorker.__new__(DecodeWorker)
    conn.decode.consumer = SimpleNamespace(stats=ConsumerStats(reads=1), inflight=lambda: state["inflight"],
                                           parked=lambda: state["parked"], active=lambda: list(state["active"]))
    conn.decode.sparse, conn.decode.landed_resident = None, 0
    conn.prefill = None
    busy = conn.get_kv_connector_stats()
    assert busy is not None and busy.data["inflight_reads"] == 3 and busy.data["active_requests"] == 2
    state.update(inflight=0, parked=0, active=[])
    idle = conn.get_kv_connector_stats()  # no counter moved, but the gauges did
    assert idle is not None and not idle.is_empty()
    assert idle.data == {"inflight_reads": 0, "parked_messages": 0, "active_requests": 0}
    assert conn.get_kv_connector_stats() is None  # nothing changed since
    total = busy.aggregate(idle)
    assert total.data["inflight_reads"] == 0 and total.data["layers_pulled"] == 1

    reg = CollectorRegistry()
    vcfg = SimpleNamespace(kv_transfer_config=None)
    prom = SfaRemoteD2HConnector.build_prom_metrics(vcfg, _registry_types(reg), ["engine"], {0: ["0"]})
    prom.observe(busy.reduce(), engine_idx=0)
    assert reg.get_sample_value("vllm:ascend_offload_rd2h_inflight_reads", {"engine": "0"}) == 3
    prom.observe(idle.reduce(), engine_idx=0)
    assert reg.get_sample_value("vllm:ascend_offload_rd2h_inflight_reads", {"engine": "0"}) == 0
    assert reg.get_sample_value("vllm:ascend_offload_rd2h_parked_messages", {"engine": "0"}) == 0
