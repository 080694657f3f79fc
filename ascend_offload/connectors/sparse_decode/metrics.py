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

from ascend_offload.connectors.metrics import SPARSE_COUNTERS as COUNTERS
from ascend_offload.connectors.metrics import SPARSE_GAUGES as GAUGES
from ascend_offload.connectors.metrics import CounterDeltas, CounterPromMetrics, CounterStats

_NS = ("offload_ns", "resolve_ns", "copy_ns", "stash_ns", "prefix_copy_ns")


@dataclasses.dataclass
class SparseDecodeStats(CounterStats):
    """Counter deltas (summed) and gauges (latest) of the worker."""

    GAUGES: ClassVar[frozenset[str]] = frozenset(GAUGES)


class StatsReporter(CounterDeltas[SparseDecodeStats]):
    """The worker's monotonic totals as per-report deltas (times in seconds), changed
    gauges, and the hot-buffer hit rate of the report's resolved positions."""

    def __init__(self) -> None:
        super().__init__(SparseDecodeStats)

    def derive(self, delta: dict[str, float]) -> dict[str, float]:
        out = {(k[:-3] + "_seconds" if k in _NS else k): (v / 1e9 if k in _NS else v)
               for k, v in delta.items()}
        if delta.get("resolved_positions"):
            out["hit_rate"] = delta.get("hit_positions", 0) / delta["resolved_positions"]
        return out


class SparsePromMetrics(CounterPromMetrics):
    """``vllm:ascend_offload_sparse_*`` counters and gauges."""

    PREFIX = "vllm:ascend_offload_sparse_"
    COUNTERS = COUNTERS
    GAUGES = GAUGES
