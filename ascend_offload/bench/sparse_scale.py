"""``ascend-offload bench sparse-scale``: the residency resolve at DeepSeek-V3.2 scale.

Per decode step, every layer (61) resolves the whole batch's top-k (2048 positions per
request) against hot buffers of 4096 rows, at contexts of 32K and 128K tokens and
batches of 1 to 64, on drifting-focus and uniform top-k traces
(:mod:`~ascend_offload.bench.sparse_traces`). Resolve only: no model, no row copies.
Four paths:

* ``host``: the native host table (``NativeResidency``), one thread: what the host
  path runs per layer after the top-k reached the host;
* ``host_threads``: the same, its requests spread over every core (OpenMP);
* ``device``: the device table (``DeviceResidency``) with the kernel it runs on this
  platform. Here the "device" is this machine's CPU, so that is its C++ host kernel
  (one call per layer over the same device-layout state): host time, what a CPU
  engine with ``residency_backend: device`` pays;
* ``device_ops``: the same table with its portable kernel, the static-shape tensor ops
  an NPU/GPU runs as kernels inside a captured graph. On this CPU they run on the host
  (torch with ``--device-threads`` intra-op threads, one by default: on a shared,
  oversubscribed VM torch's OpenMP threads spin at barriers and two threads measured
  50-100x slower than one): ATen dispatch time, for what it is.

Per step: wall time (median over the measured steps) and host <-> device
synchronizations, counted through ``device.host_read``: the host paths hand every
layer's top-k to host code (one read per layer: a device -> host copy the host waits
for on an accelerator, a counted no-op on CPU); the device paths read nothing (its
once-per-step error/totals report is read after the timed steps, for the hit rate).
Hit rate: hits / valid positions over the measured steps; the three paths resolve the
same traces with the same exact-LRU semantics, so their hit rates are equal.

Traces: ``--distinct`` traces per (kind, context), each ``warmup + steps`` long;
(layer, request) uses trace ``(7 * layer + request) % distinct`` (every (layer, row)
still has its own table state; generating 61 x 64 distinct 128K-context traces would
take minutes and change no per-call cost).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

from ascend_offload import device as dev
from ascend_offload import native
from ascend_offload.bench import write_json
from ascend_offload.bench.sparse_traces import TRACE_KINDS
from ascend_offload.sparse.device_residency import DeviceResidency
from ascend_offload.sparse.residency import NativeResidency

PATHS = ("host", "host_threads", "device", "device_ops")
DEVICE_PATHS = {"device": "auto", "device_ops": "off"}  # path -> the table's use_native
QUICK = {"layers": 4, "k": 256, "hot": 512, "contexts": "8192", "batches": "1,4", "steps": 2,
         "warmup": 2, "distinct": 2, "block": 64}


def _traces(a: argparse.Namespace, kind: str, ctx: int) -> list[np.ndarray]:
    fn, kw = TRACE_KINDS[kind]
    rng = np.random.default_rng(a.seed)
    return [fn(rng, steps=a.warmup + a.steps, k=a.k, ctx0=ctx, **kw) for _ in range(a.distinct)]


def _topks(a: argparse.Namespace, traces: list[np.ndarray], batch: int) -> list[list[torch.Tensor]]:
    """``[step][layer]`` ``[batch, k]`` int32 top-k, built before anything is timed."""
    out = []
    for t in range(a.warmup + a.steps):
        step: list[torch.Tensor] = []
        for layer in range(a.layers):
            rows = [traces[(7 * layer + r) % a.distinct][t] for r in range(batch)]
            step.append(torch.from_numpy(np.stack(rows)).contiguous())
        out.append(step)
    return out


def _run_path(a: argparse.Namespace, path: str, batch: int, ctx: int,
              topks: list[list[torch.Tensor]]) -> dict[str, Any]:
    L, H = a.layers, a.hot
    cap = ctx + a.warmup + a.steps + 1
    nblk = -(-cap // a.block)
    bt = torch.arange(batch * nblk, dtype=torch.int32).view(batch, nblk)
    rows = torch.arange(batch, dtype=torch.int32)
    tags = torch.ones(batch, dtype=torch.int64)
    table: Any
    threads_before = torch.get_num_threads()
    if path in DEVICE_PATHS:
        table = DeviceResidency(L, batch, H, max_positions=cap, use_native=DEVICE_PATHS[path])
        torch.set_num_threads(a.device_threads)
    else:
        threads = 1 if path == "host" else a.threads
        table = NativeResidency(L, batch, H, nthreads=threads)
    times: list[float] = []
    valid = misses = 0
    reads_timed = 0
    for t, step in enumerate(topks):
        lens = torch.full((batch,), ctx + t + 1, dtype=torch.int32)
        measured = t >= a.warmup
        r0 = sum(dev.host_reads().values())
        t0 = time.perf_counter()
        table.bind_step(rows, tags, lens, lens, bt, a.block)
        for layer, topk in enumerate(step):
            if path in DEVICE_PATHS:
                table.resolve_layer(layer, topk)
            else:
                res = table.resolve_layer(layer, dev.host_read(topk, reason=dev.TOPK_READ))
                if measured:
                    valid += res.num_valid
                    misses += res.num_misses
        elapsed = time.perf_counter() - t0
        if measured:
            times.append(elapsed * 1e3)
            reads_timed += sum(dev.host_reads().values()) - r0
        if path in DEVICE_PATHS and t == a.warmup - 1:
            table.check()  # drop the warm-up steps' totals (not timed)
    if path in DEVICE_PATHS:
        valid, misses = table.check()  # after the timed steps: one read for the hit rate
    torch.set_num_threads(threads_before)
    return {"path": path, "batch": batch, "context": ctx,
            "hit_rate": 1.0 - misses / valid if valid else 0.0,
            "host_ms_per_step": statistics.median(times),
            "host_syncs_per_step": reads_timed / len(times),
            "ms_per_step_steps": [round(x, 3) for x in times],
            "threads": {"host": 1, "host_threads": a.threads}.get(path, a.device_threads),
            "kernel": table.kernel if path in DEVICE_PATHS else "native",
            "device_state_bytes": table.state_bytes if path in DEVICE_PATHS else None}


def run(a: argparse.Namespace) -> dict[str, Any]:
    if not native.available():
        raise SystemExit("bench sparse-scale needs the native residency library (g++ at install)")
    paths = [p for p in a.paths.split(",") if p]
    bad = [p for p in paths if p not in PATHS]
    if bad:
        raise SystemExit(f"--paths: unknown {bad}; accepted {', '.join(PATHS)}")
    t_start = time.time()
    rows: list[dict[str, Any]] = []
    load = [os.getloadavg()[0]]
    for ctx in [int(c) for c in a.contexts.split(",")]:
        for kind in a.traces.split(","):
            traces = _traces(a, kind, ctx)
            for batch in [int(b) for b in a.batches.split(",")]:
                topks = _topks(a, traces, batch)
                for path in paths:
                    row = _run_path(a, path, batch, ctx, topks)
                    row["trace"] = kind
                    rows.append(row)
                    if a.verbose:
                        print(f"{path:12s} B={batch:3d} ctx={ctx:6d} {kind:8s} "
                              f"{row['host_ms_per_step']:9.2f} ms/step  syncs "
                              f"{row['host_syncs_per_step']:.0f}  hit {row['hit_rate']:.4f}",
                              file=sys.stderr, flush=True)
                del topks
            load.append(os.getloadavg()[0])
    return {
        "bench": "sparse-scale",
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(t_start)),
        "machine": {"cpus": os.cpu_count(), "machine": platform.machine(),
                    "processor": platform.processor(), "torch_threads": torch.get_num_threads(),
                    "loadavg_1m": load},
        "config": {k: getattr(a, k) for k in ("layers", "k", "hot", "contexts", "batches",
                                              "traces", "steps", "warmup", "distinct", "block",
                                              "threads", "device_threads", "quick", "seed")},
        "rows": rows,
    }


def report(res: dict[str, Any]) -> str:
    c = res["config"]
    lines = [f"sparse-scale: {c['layers']} layers, top-k {c['k']}, hot buffer {c['hot']} rows, "
             f"{c['steps']} measured steps after {c['warmup']} (resolve only, "
             f"{res['machine']['cpus']} CPUs)",
             f"  {'path':12s} {'batch':>5s} {'context':>8s} {'trace':8s} {'ms/step':>10s} "
             f"{'syncs/step':>10s} {'hit rate':>8s}"]
    for r in res["rows"]:
        lines.append(f"  {r['path']:12s} {r['batch']:5d} {r['context']:8d} {r['trace']:8s} "
                     f"{r['host_ms_per_step']:10.2f} {r['host_syncs_per_step']:10.0f} "
                     f"{r['hit_rate']:8.4f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ascend-offload bench sparse-scale",
                                description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=61)
    p.add_argument("--k", type=int, default=2048, help="top-k per (request, layer)")
    p.add_argument("--hot", type=int, default=4096, help="hot-buffer rows per (request, layer)")
    p.add_argument("--contexts", default="32768,131072", help="context lengths at step 0")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--traces", default="drift,uniform", help=f"of {', '.join(TRACE_KINDS)}")
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--steps", type=int, default=3, help="measured steps")
    p.add_argument("--warmup", type=int, default=2, help="steps that fill the hot buffers first")
    p.add_argument("--distinct", type=int, default=8, help="distinct traces per kind and context")
    p.add_argument("--block", type=int, default=128, help="host pool block size")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="threads of the host_threads path")
    p.add_argument("--device-threads", type=int, default=1,
                   help="torch intra-op threads of the device paths on CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="a small smoke run: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    p.add_argument("--json", help="write the result as JSON here")
    p.add_argument("-v", "--verbose", action="store_true", help="print each row as it finishes")
    a = p.parse_args(argv)
    if a.quick:
        for k, v in QUICK.items():
            setattr(a, k, v)
    res = run(a)
    print(report(res))
    if a.json:
        write_json(a.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
