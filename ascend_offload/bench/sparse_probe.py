"""The worker side of ``ascend-offload bench sparse-e2e``: a vLLM worker extension
(``worker_extension_cls``) whose methods run in each engine's worker process through
``LLM.collective_rpc`` -- the model-function timers of the breakdown and the offload
counters read from the connector. In a module of its own because vLLM imports it by
name in every worker, apart from the bench's engine and round logic."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

# model functions timed in the worker (first argument: the request's queries or scores)
_TIMED = ("indexer_scores", "select_topk", "sparse_attention")


class WorkerProbe:
    """vLLM worker extension (``worker_extension_cls``): methods run in the worker
    process through ``LLM.collective_rpc``. Needs no state of its own until
    :meth:`bench_probe_timers` installs the model-function timers."""

    def bench_probe_timers(self, on: bool, query_tokens: int = 1) -> None:
        """Wrap (``on``) or restore the model's indexer/attention functions in
        ``ascend_offload.models.attention`` with wall-clock accumulators, for decode
        rows (at most ``query_tokens`` queries: 1 + the draft tokens)."""
        from ascend_offload.models import attention as mod

        orig: dict[str, Callable[..., Any]] = getattr(mod, "_bench_orig", {})
        if not on:
            for name, fn in orig.items():
                setattr(mod, name, fn)
            if orig:
                mod.SparseMLACache.run = mod._bench_layer_run  # type: ignore[attr-defined,method-assign]
            mod._bench_orig = {}  # type: ignore[attr-defined]
            return
        if orig:
            return
        totals: dict[str, int] = {n: 0 for n in _TIMED}
        mod._bench_totals = totals  # type: ignore[attr-defined]

        def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(*a: Any, **k: Any) -> Any:
                if a[0].shape[0] > query_tokens:  # a prefill chunk: not timed
                    return fn(*a, **k)
                t0 = time.perf_counter_ns()
                try:
                    return fn(*a, **k)
                finally:
                    totals[name] += time.perf_counter_ns() - t0

            return wrapper

        for name in _TIMED:
            orig[name] = getattr(mod, name)
            setattr(mod, name, timed(name, orig[name]))
        layer_run = mod.SparseMLACache.run
        totals["layer"] = 0

        def timed_layer(layer: Any, meta: Any, *a: Any) -> None:
            # whole decode-only steps: every request one query token (or 1 + drafts)
            if meta is None or meta.num_actual_tokens > len(meta.requests) * query_tokens:
                return layer_run(layer, meta, *a)
            t0 = time.perf_counter_ns()
            try:
                return layer_run(layer, meta, *a)
            finally:
                totals["layer"] += time.perf_counter_ns() - t0

        mod.SparseMLACache.run = timed_layer  # type: ignore[assignment]
        mod._bench_orig = orig  # type: ignore[attr-defined]
        mod._bench_layer_run = layer_run  # type: ignore[attr-defined]

    def bench_probe_read(self) -> dict[str, Any]:
        """Timer totals (ns), the offload counters and device KV split (if offloading) and
        the main-KV layers' paged bytes (without offload; with it their views overlap)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        from ascend_offload.models import attention as mod

        ctx = self.vllm_config.compilation_config.static_forward_context  # type: ignore[attr-defined]
        main_kv = 0
        for layer in ctx.values():
            if isinstance(layer, mod.SparseMLACache):
                caches = layer.kv_cache if isinstance(layer.kv_cache, list) else [layer.kv_cache]
                main_kv += sum(c.numel() * c.element_size() for c in caches)
        out: dict[str, Any] = {
            "timers_ns": dict(getattr(mod, "_bench_totals", {})),
            "paged_main_kv_bytes": main_kv,
            "device_kv": {},
            "counters": {},
        }
        if has_kv_transfer_group():
            worker = getattr(get_kv_transfer_group(), "worker", None)
            if worker is not None:
                out["counters"] = worker.decode.counters()
                out["gauges"] = worker.decode.gauges()
                out["device_kv"] = worker.device_kv_gauges()
                out["hot_buffer_bytes"] = int(worker.manager.hot.nbytes)
                table = worker.manager.residency
                out["residency"] = {"kind": table.kind, "kernel": getattr(table, "kernel", None)}
        return out
