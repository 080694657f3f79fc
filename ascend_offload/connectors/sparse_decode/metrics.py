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
from ascend_offload.connectors.metrics import CounterPromMetrics, CounterStats

_NS = ("offload_ns", "resolve_ns", "copy_ns", "stash_ns", "prefix_copy_ns")


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
