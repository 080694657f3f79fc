"""Sparse decode offload metrics, exported through vLLM's connector stats and Prometheus.

The worker hands vLLM counter *deltas* since its last report plus gauges (the
latest value); vLLM aggregates them and feeds :class:`SparsePromMetrics`, which
exports ``vllm:ascend_offload_sparse_*`` (read by ``LLM.get_metrics`` and the
OpenAI server's ``/metrics``). Derived per-step figures: hit rate =
``hit_positions / resolved_positions``, miss rows and bytes per step =
``miss_rows / steps`` and ``miss_bytes / steps``. The ``device_*_kv_bytes``
gauges are the engine's own allocation (main KV = hot buffers only; vLLM's
``num_gpu_blocks`` counts indexer blocks).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from ascend_offload.connectors.metrics import CounterPromMetrics, CounterStats

# counter name -> help text (nanosecond totals are exported in seconds)
COUNTERS: dict[str, str] = {
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
    "admission_failures": "requests the worker's host pool could not admit (0 unless the "
                          "scheduler's pool ledger and the pool disagree)",
    "unmatched_rows": "batch rows matched to no request (an engine error)",
}
GAUGES: dict[str, str] = {
    "pool_rows_used": "host pool rows reserved by admitted requests (per layer)",
    "admitted_requests": "requests holding host pool rows",
    "hit_rate": "hot-buffer hit rate over the last report interval",
    "device_kv_bytes": "device KV allocation of the engine (bytes, one rank)",
    "device_main_kv_bytes": "device bytes of the sparse main-KV layers (their hot buffers)",
    "device_indexer_kv_bytes": "device bytes of the rest of the KV allocation (indexer cache)",
}
_NS = ("offload_ns", "resolve_ns", "copy_ns")


@dataclasses.dataclass
class SparseDecodeStats(CounterStats):
    """Counter deltas (summed) and gauges (latest) of the worker."""

    GAUGES: ClassVar[frozenset[str]] = frozenset(GAUGES)


class StatsReporter:
    """Turns the worker's monotonic totals into per-report deltas (+ gauges)."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def take(self, totals: dict[str, int], gauges: dict[str, int]) -> SparseDecodeStats | None:
        delta = {k: v - self._last.get(k, 0) for k, v in totals.items()}
        self._last = dict(totals)
        out: dict[str, float] = {}
        for k, v in delta.items():
            if v:
                out[k.replace("_ns", "_seconds")] = v / 1e9 if k in _NS else v
        if not out:
            return None
        out.update(gauges)
        if delta.get("resolved_positions"):
            out["hit_rate"] = delta["hit_positions"] / delta["resolved_positions"]
        return SparseDecodeStats(data=out)


class SparsePromMetrics(CounterPromMetrics):
    """``vllm:ascend_offload_sparse_*`` counters and gauges."""

    PREFIX = "vllm:ascend_offload_sparse_"
    COUNTERS = COUNTERS
    GAUGES = GAUGES
