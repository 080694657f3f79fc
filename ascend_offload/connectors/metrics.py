"""Connector counters exported through vLLM's connector stats and Prometheus.

A connector hands vLLM the counter *deltas* since its last report; vLLM sums
them across workers/intervals (``aggregate``), prints them in its periodic log
line and feeds the connector's ``observe``, which increments counters on the
OpenAI server's ``/metrics`` (the ``vllm:`` prefix is what vLLM's own metric
readers, e.g. ``LLM.get_metrics``, pick up): ``vllm:ascend_offload_store_*``
for the store tier (:class:`StorePromMetrics`), ``vllm:ascend_offload_rd2h_*``
for the P/D pull (:class:`RD2HPromMetrics`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar, cast

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge
    from vllm.config import VllmConfig

# counter name -> help text
COUNTERS: dict[str, str] = {
    "loaded_blocks": "KV blocks loaded from the host store into vLLM's cache",
    "saved_blocks": "KV blocks copied into the host store",
    "skipped_blocks": "KV blocks not saved because the store was full",
    "duplicate_blocks": "KV blocks not saved because the store already had them",
    "load_failed_jobs": "load jobs that failed on some rank (blocks reported as load errors)",
    "save_failed_jobs": "save jobs that failed on some rank (objects aborted)",
    "lookups": "store prefix lookups",
    "hit_objects": "objects found by lookups",
    "miss_objects": "objects missed by lookups",
    "evicted_objects": "objects evicted (LRU) to make room",
    "preempted_requests": "preemptions of requests vLLM made (each seen by the store)",
    "resumed_blocks": "KV blocks of preempted requests loaded back from the store",
    "recomputed_blocks": "full KV blocks a preempted request had computed that nothing gave back",
    "preempt_save_waits": "re-admissions of preempted requests that waited for their own saves",
    "store_resets": "connector cache resets (reset_prefix_cache with reset_connector)",
    "stale_reports": "worker reports of jobs from before a reset (dropped)",
    "layerwise_blocks_loaded": "layerwise: (block, layer) pages loaded into shared buffers (all ranks)",
    "layerwise_blocks_saved": "layerwise: (block, layer) pages saved from shared buffers (all ranks)",
    "layerwise_load_errors": "layerwise: blocks that could not be loaded (reported to vLLM)",
    "layerwise_saves_dropped": "layerwise: (block, layer) pages not saved because a load of their step failed first",
    "layerwise_gate_waits": "layerwise: writers that waited for a physical buffer's consumers",
    "layerwise_gate_queued_waits": "layerwise: loads ordered behind a buffer's queued store saves",
    "layerwise_gate_timeouts": "layerwise: reuse-gate waits that hit their deadline",
    "layerwise_native_copies": "layerwise: copy jobs run by the native copy queue",
    "ssd_spilled_blocks": "SSD tier: blocks every rank wrote to its slot (ready for lookups)",
    "ssd_spill_failed": "SSD tier: blocks whose slot write failed on some rank (slot freed)",
    "ssd_spill_skipped": "SSD tier: committed blocks not spilled (no slot free, or evicted from host first)",
    "ssd_hit_blocks": "SSD tier: blocks a lookup found on the tier (promote started)",
    "ssd_promoted_blocks": "SSD tier: blocks read, verified and committed into host pages",
    "ssd_checksum_failures": "SSD tier: slot reads that failed header/checksum verification (a miss)",
    "ssd_promote_wait_timeouts": "SSD tier: requests that stopped waiting for a promote (load_timeout_s)",
    "ssd_evicted": "SSD tier: entries evicted to make room for spills",
}


# counter name -> help text (SfaRemoteD2HConnector workers: decode pulls, prefill publishes)
RD2H_COUNTERS: dict[str, str] = {
    "layers_pulled": "decode: (request, layer, prefill rank) reads completed",
    "bytes_pulled": "decode: KV bytes read from prefill",
    "read_descriptors": "decode: transfer descriptors issued (after coalescing)",
    "read_failures": "decode: readiness items answered read_failed (invalid, read error, late, ...)",
    "read_retries": "decode: reads retried after a transfer error",
    "rejected_messages": "control messages rejected as undecodable or inconsistent (both sides)",
    "resident_pulls": "decode, hybrid residency: pulls whose main KV landed in resident device "
                      "rows (not the host pool)",
    "layers_published": "prefill: (request, layer) readiness items published to decode",
    "acks": "prefill: readiness items decode answered read_done",
    "acks_late": "prefill: answers that arrived after their slot use ended (stale, ignored)",
    "ack_timeouts": "prefill: readiness items unanswered at the ack deadline",
    "failed_answers": "prefill: readiness items decode answered read_failed",
    "send_errors": "prefill: readiness items that could not be sent (endpoint unreachable, queue full)",
    "gate_holds": "prefill, layer sharing: reuse-gate slots held for decode's reads",
    "gate_hold_failures": "prefill, layer sharing: gate holds released with a failed or unanswered read",
    "late_claims": "prefill, early dispatch: decode registrations a worker claimed for a request it "
                   "computed before the decode registered",
    "late_claim_failures": "prefill, early dispatch: such requests not sent (claim failed, or the "
                           "registration was refused)",
}

# gauge name -> help text: state that must return to 0 when the engine is idle (leak checks).
# Reported with the stats of a step, so they show the state at the engine's last step.
RD2H_GAUGES: dict[str, str] = {
    "pending_slot_uses": "prefill: published slot uses still waiting for decode's answers or their deadline",
    "late_sends_waiting": "prefill, early dispatch: computed requests whose decode registration is "
                          "not claimed yet",
    "inflight_reads": "decode: reads submitted to reader threads and not answered yet",
    "parked_messages": "decode: readiness messages parked for requests not started yet",
    "active_requests": "decode: requests still being received",
}

# sparse decode offload (AscendSparseDecodeConnector: vllm:ascend_offload_sparse_*)
# counter name -> help text (nanosecond totals are exported in seconds)
SPARSE_COUNTERS: dict[str, str] = {
    "steps": "decode-offload steps bound (one per engine step with offloaded requests)",
    "resolved_positions": "top-k positions resolved against the hot buffers",
    "hit_positions": "top-k positions already in the hot buffer",
    "miss_rows": "hot-buffer misses: rows copied host pool -> hot buffer",
    "miss_bytes": "bytes copied host pool -> hot buffer",
    "offload_rows": "main-KV rows copied into the host pool",
    "offload_bytes": "bytes copied into the host pool",
    "offload_seconds": "host time in offload_new_kv (D2H + pool scatter)",
    "resolve_seconds": "host time in the residency resolve",
    "copy_seconds": "host time in the miss copies",
    "context_rows": "pool rows copied to the device for multi-token rows (0 on CPU)",
    "pool_query_tokens": "query tokens attended over the host pool's rows (prefill chunks, "
                         "recomputation; decode and verification rows use the hot buffer)",
    "admission_failures": "requests the worker's host pool could not admit (0 unless the "
                          "scheduler's pool ledger and the pool disagree)",
    "unmatched_rows": "batch rows matched to no request (an engine error)",
    "preempted_requests": "requests vLLM preempted (their pool rows stay; indexer rows stashed)",
    "resumed_tokens": "tokens of resumed requests loaded back, not recomputed",
    "recomputed_tokens": "positions computed again after their main-KV rows were pooled "
                         "(rewriting rejected draft positions is not counted)",
    "verify_rows": "speculative verification rows (1 + drafts query tokens) served from the "
                   "hot buffers, the union of their top-k sets resolved at once",
    "stash_failures": "preempted requests whose indexer rows could not be stashed (recomputed)",
    "stash_seconds": "host time copying preempted requests' indexer rows out and back",
    "host_reads_topk": "device -> host reads of a layer's top-k (the host resolver: one per "
                       "layer and step; the device resolver: none)",
    "host_reads_new_rows": "device -> host reads of a layer's new main-KV rows (host resolver)",
    "host_reads_step": "device -> host reads of the device resolver's per-step report",
    "prefix_kept_blocks": "decode-side prefix cache: finished requests' full blocks kept (pool "
                          "rows retained, indexer rows copied to host)",
    "prefix_loaded_blocks": "decode-side prefix cache: cached blocks a new request started with "
                            "(pool rows shared, indexer rows copied to the device)",
    "prefix_evicted_blocks": "decode-side prefix cache: entries evicted (LRU, reset)",
    "prefix_load_failures": "decode-side prefix cache: hit blocks not served (recomputed)",
    "prefix_copy_seconds": "host time copying cached blocks' indexer rows to host and back",
    "resident_rows": "hybrid residency: main-KV rows written to resident device rows (per layer)",
    "resident_query_tokens": "hybrid residency: query tokens attended over resident device rows "
                             "(summed over layers; no resolve, no miss copy)",
    "moved_requests": "hybrid residency: resident requests moved to the host pool under pressure",
    "moved_bytes": "hybrid residency: bytes moved device -> host pool by those moves",
    "placed_requests": "hybrid residency: requests that started resident on the device",
}
SPARSE_GAUGES: dict[str, str] = {
    "pool_rows_used": "host pool rows reserved by admitted requests (per layer)",
    "admitted_requests": "requests holding host pool rows",
    "hit_rate": "hot-buffer hit rate over the last report interval",
    "device_kv_bytes": "device KV allocation of the engine (bytes, one rank)",
    "device_main_kv_bytes": "device bytes of the sparse main-KV layers (their hot buffers)",
    "device_indexer_kv_bytes": "device bytes of the rest of the KV allocation (indexer cache)",
    "stash_bytes": "host bytes holding preempted requests' indexer rows",
    "prefix_cache_blocks": "decode-side prefix cache entries held (one pool block each)",
    "resident_requests": "hybrid residency: requests whose main KV is on the device",
    "offloaded_requests": "requests decoding from the host pool (admitted, not resident)",
}
# A decode with RD2H + sparse_offload reports the same under ``sparse_`` in its RD2H
# stats (vllm:ascend_offload_rd2h_sparse_*; the time totals stay in nanoseconds there).
RD2H_COUNTERS.update({f"sparse_{k.replace('_seconds', '_ns')}": d.replace("host time", "host ns")
                      for k, d in SPARSE_COUNTERS.items()})
RD2H_GAUGES.update({f"sparse_{k}": d for k, d in SPARSE_GAUGES.items() if k != "hit_rate"})

STORE_GAUGES: dict[str, str] = {
    "pinned_objects": "store objects pinned for a load",
    "pending_objects": "store objects allocated for a save and not committed yet",
    "layerwise_gate_consumers_held": "layerwise: reuse-gate consumers (saves, decode reads) holding a buffer",
    "ssd_used_slots": "SSD tier: slots holding or being written with a block",
}


@dataclasses.dataclass
class CounterStats(KVConnectorStats):
    """Counter deltas (summed under aggregation) and gauges (latest value wins).

    Each connector has its own subclass: vLLM keys connector stats by class."""

    GAUGES: ClassVar[frozenset[str]] = frozenset()

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = dict(self.data)
        for k, v in (other.data or {}).items():
            merged[k] = v if k in self.GAUGES else merged.get(k, 0) + v
        return type(self)(data=merged)

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in self.data.items() if v or k in self.GAUGES}

    def is_empty(self) -> bool:
        # a gauge back at 0 is news too: it must reach Prometheus
        return not any(v or k in self.GAUGES for k, v in self.data.items())


@dataclasses.dataclass
class StoreConnectorStats(CounterStats):
    """The store tier's counter deltas and gauges."""

    GAUGES: ClassVar[frozenset[str]] = frozenset(STORE_GAUGES)


@dataclasses.dataclass
class RD2HConnectorStats(CounterStats):
    """The P/D pull's counter deltas and gauges."""

    GAUGES: ClassVar[frozenset[str]] = frozenset(RD2H_GAUGES)


S = TypeVar("S", bound=CounterStats)


class CounterDeltas(Generic[S]):
    """Turns monotonically growing totals into per-report deltas, plus gauges: the
    counters that moved and the gauges whose value changed since the last report (a
    gauge's return to 0 included). An unchanged gauge is left out: Prometheus keeps a
    gauge's last value and aggregation keeps the latest, so it would only add bytes to
    every step's output, its aggregation and its export."""

    def __init__(self, stats_cls: type[S]) -> None:
        self._last: dict[str, int] = {}
        self._last_gauges: dict[str, int] = {}
        self._cls = stats_cls

    def take(self, totals: dict[str, int], gauges: dict[str, int] | None = None) -> S | None:
        last = self._last
        delta: dict[str, float] = {k: d for k, v in totals.items() if (d := v - last.get(k, 0))}
        self._last = dict(totals)
        if gauges:
            seen = self._last_gauges
            changed = {k: v for k, v in gauges.items() if seen.get(k) != v}
            if changed:
                self._last_gauges = {**seen, **changed}
                delta.update(changed)
        return self._cls(data=self.derive(delta)) if delta else None

    def derive(self, delta: dict[str, float]) -> dict[str, float]:
        """The report's data from the moved counters and changed gauges (a subclass adds
        derived figures or converts units)."""
        return delta


class CounterPromMetrics(KVConnectorPromMetrics):
    """Prometheus counters (``PREFIX + name``) and gauges of one connector's stats."""

    PREFIX: ClassVar[str] = ""
    COUNTERS: ClassVar[dict[str, str]] = {}
    GAUGES: ClassVar[dict[str, str]] = {}

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # vLLM types each class of metric_types as any metric class; these are its
        # Counter and Gauge (or their multiprocess wrappers).
        counter_cls = cast("type[Counter]", self._counter_cls)
        gauge_cls = cast("type[Gauge]", self._gauge_cls)
        self._counters: dict[str, dict[int, Counter]] = {
            name: cast("dict[int, Counter]", create_metric_per_engine(
                counter_cls(name=f"{self.PREFIX}{name}", documentation=doc,
                            labelnames=labelnames),
                per_engine_labelvalues,
            ))
            for name, doc in self.COUNTERS.items()
        }
        self._gauges: dict[str, dict[int, Gauge]] = {
            name: cast("dict[int, Gauge]", create_metric_per_engine(
                gauge_cls(name=f"{self.PREFIX}{name}", documentation=doc,
                          labelnames=labelnames, multiprocess_mode="mostrecent"),
                per_engine_labelvalues,
            ))
            for name, doc in self.GAUGES.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            counter = self._counters.get(name)
            if counter is not None and value > 0:
                counter[engine_idx].inc(value)
            gauge = self._gauges.get(name)
            if gauge is not None:
                gauge[engine_idx].set(value)


class StorePromMetrics(CounterPromMetrics):
    """``vllm:ascend_offload_store_*`` counters of the store tier."""

    PREFIX = "vllm:ascend_offload_store_"
    COUNTERS = COUNTERS
    GAUGES = STORE_GAUGES


class RD2HPromMetrics(CounterPromMetrics):
    """``vllm:ascend_offload_rd2h_*`` counters of the P/D pull."""

    PREFIX = "vllm:ascend_offload_rd2h_"
    COUNTERS = RD2H_COUNTERS
    GAUGES = RD2H_GAUGES


class ConnectorMetrics:
    """Mixin for a connector class: vLLM's two metric factories from ``STATS`` / ``PROM``.

    Why: vLLM asks the connector *class* for these; every connector of ours answers
    the same way, only the classes differ."""

    STATS: ClassVar[type[CounterStats]]
    PROM: ClassVar[type[CounterPromMetrics]]

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> CounterStats | None:
        return cls.STATS(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> CounterPromMetrics:
        return cls.PROM(vllm_config, metric_types, labelnames, per_engine_labelvalues)
