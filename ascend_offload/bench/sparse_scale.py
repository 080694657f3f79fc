"""``ascend-offload bench sparse-scale``: the residency resolve at DeepSeek-V3.2 scale.

Per decode step, every layer (61) resolves the whole batch's top-k (2048 positions per
request) against hot buffers of 4096 rows, at contexts of 32K and 128K tokens and
batches of 1 to 64, on drifting-focus and uniform top-k traces
(:mod:`~ascend_offload.bench.sparse_traces`). Resolve only: no model, no row copies.
``--device`` says where the top-k lives and the device table runs: ``cpu`` (default) or
this machine's accelerator (``cuda``). Six paths:

* ``host``: the native host table (``NativeResidency``), one thread: what the host
  path runs per layer after the top-k reached the host;
* ``host_threads``: the same, its requests spread over every core (OpenMP);
* ``device``: the device table (``DeviceResidency``) with the kernel it picks. With
  ``--device cpu`` the "device" is this machine's CPU, so that is its C++ host kernel
  (one call per layer over the same device-layout state): host time, what a CPU
  engine with ``residency_backend: device`` pays; on an accelerator it picks the
  tensor ops, compiled where the platform compiles them well (CUDA), launched eagerly:
  ``device_ops`` or ``device_compiled`` without the graph (left out of the default
  paths there);
* ``device_ops``: the same table with its portable kernel, the static-shape tensor ops
  an NPU/GPU runs as kernels inside a captured graph, launched eagerly op by op. On the
  CPU they run on the host (torch with ``--device-threads`` intra-op threads, one by
  default: on a shared, oversubscribed VM torch's OpenMP threads spin at barriers and
  two threads measured 50-100x slower than one): ATen dispatch time, for what it is;
* ``device_graph`` (CUDA, ``--device cuda``): the same table and kernel, the step's
  layer resolves captured once as a CUDA graph after the warm-up steps (run eagerly
  on a side stream) and replayed each step; ``bind_step`` stays outside the graph.
  The step's top-k is copied into the graph's static inputs before the timed region
  (that copy is timed on its own: ``topk_copy_ms_per_step``). After the timed steps
  a second table resolves the same steps eagerly: ``equal_to_eager`` says whether the
  measured (valid, miss) totals and the final table state are equal;
* ``device_compiled`` (CUDA, ``--device cuda``): as ``device_graph``, with the table's
  tensor ops compiled (``torch.compile(fullgraph=True, dynamic=False)``, kernel
  ``ops_compiled``): the warm-up steps compile them (once per shape), the capture
  records the compiled kernels; ``equal_to_eager`` against the same eager table.

With ``--device cuda`` the top-k of every path is on the GPU before anything is
timed; the host paths read it to the host each layer (a real device -> host copy,
counted and paid), and each timed step starts and ends with a device synchronize.

Per step: wall time (median over the measured steps) and host <-> device
synchronizations, counted through ``device.host_read``: the host paths hand every
layer's top-k to host code (one read per layer: a device -> host copy the host waits
for on an accelerator, a counted no-op on CPU); the device paths read nothing (its
once-per-step error/totals report is read after the timed steps, for the hit rate).
Hit rate: hits / valid positions over the measured steps; every path resolves the
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

PATHS = ("host", "host_threads", "device", "device_ops", "device_graph", "device_compiled")
# path -> (use_native, compile_kernel) of its DeviceResidency; device_ops never compiles
# (it is the eager reference), device follows the table's own choice
DEVICE_PATHS = {"device": ("auto", "auto"), "device_ops": ("off", "off"),
                "device_graph": ("off", "off"), "device_compiled": ("off", "on")}
HOST_PATHS = ("host", "host_threads")
GRAPH_PATHS = ("device_graph", "device_compiled")
QUICK = {"layers": 4, "k": 256, "hot": 512, "contexts": "8192", "batches": "1,4", "steps": 2,
         "warmup": 2, "distinct": 2, "block": 64}
TOPK_COPY = "outside the timed region, timed separately (topk_copy_ms_per_step)"


def default_paths(device: str) -> tuple[str, ...]:
    """The paths run when ``--paths`` is not given. On the CPU every path but the graphs
    (no graphs there); on an accelerator ``device`` is left out (there it picks the tensor
    ops, eager: ``device_ops``, compiled where the platform compiles them well),
    ``device_graph`` is in where this platform captures one, ``device_compiled`` where it
    also compiles the tensor ops well."""
    if device == "cpu":
        return tuple(p for p in PATHS if p not in GRAPH_PATHS)
    capture = dev.graph_capture_supported()
    compiles = capture and dev.compiles_tensor_ops(dev.device())
    return tuple(p for p in PATHS
                 if p != "device" and (p not in GRAPH_PATHS or capture)
                 and (p != "device_compiled" or compiles))


def _paths(a: argparse.Namespace) -> list[str]:
    """The paths to run, or SystemExit saying which argument does not fit this machine."""
    here = dev.platform()
    if a.device not in ("cpu", here):
        accepted = "cpu" if here == "cpu" else f"cpu or {here}"
        sees = "no accelerator" if here == "cpu" else here
        raise SystemExit(f"--device {a.device}: accepted {accepted} (torch sees {sees} here)")
    paths = [p for p in (a.paths or ",".join(default_paths(a.device))).split(",") if p]
    bad = [p for p in paths if p not in PATHS]
    if bad:
        raise SystemExit(f"--paths: unknown {bad}; accepted {', '.join(PATHS)}")
    graphs = [p for p in paths if p in GRAPH_PATHS]
    if graphs and (a.device == "cpu" or not dev.graph_capture_supported()):
        raise SystemExit(f"--paths {','.join(graphs)}: a CUDA graph of the device table needs "
                         f"--device cuda on a CUDA machine (--device is {a.device})")
    if graphs and a.warmup < 1:
        raise SystemExit(f"--paths {','.join(graphs)}: needs --warmup >= 1 (the eager steps "
                         "before the capture)")
    needs_native = [p for p in paths if p in HOST_PATHS or (p == "device" and a.device == "cpu")]
    if needs_native and not native.available():
        raise SystemExit(f"--paths {','.join(needs_native)}: needs the native residency library "
                         "(g++ at install); device_ops, device_graph and device_compiled run "
                         "without it")
    return paths


def _traces(a: argparse.Namespace, kind: str, ctx: int) -> list[np.ndarray]:
    fn, kw = TRACE_KINDS[kind]
    rng = np.random.default_rng(a.seed)
    return [fn(rng, steps=a.warmup + a.steps, k=a.k, ctx0=ctx, **kw) for _ in range(a.distinct)]


def _topks(a: argparse.Namespace, traces: list[np.ndarray], batch: int,
           where: torch.device) -> list[torch.Tensor]:
    """Per step the ``[layers, batch, k]`` int32 top-k on ``where`` (layer ``l``'s is
    ``[l]``), built and moved there before anything is timed."""
    out = []
    for t in range(a.warmup + a.steps):
        step = np.stack([np.stack([traces[(7 * layer + r) % a.distinct][t] for r in range(batch)])
                         for layer in range(a.layers)])
        out.append(torch.from_numpy(step).to(where))
    return out


class _Steps:
    """One case's host-side batch (rows, tags, block table): what ``bind_step`` takes
    each step, the same for every path."""

    def __init__(self, a: argparse.Namespace, batch: int, ctx: int) -> None:
        self.ctx, self.block = ctx, a.block
        self.cap = ctx + a.warmup + a.steps + 1
        nblk = -(-self.cap // a.block)
        self.bt = torch.arange(batch * nblk, dtype=torch.int32).view(batch, nblk)
        self.rows = torch.arange(batch, dtype=torch.int32)
        self.tags = torch.ones(batch, dtype=torch.int64)
        self.batch = batch

    def bind(self, table: Any, t: int) -> None:
        lens = torch.full((self.batch,), self.ctx + t + 1, dtype=torch.int32)
        table.bind_step(self.rows, self.tags, lens, lens, self.bt, self.block)


def _device_table(a: argparse.Namespace, path: str, steps: _Steps,
                  where: torch.device) -> DeviceResidency:
    use_native, compile_kernel = DEVICE_PATHS[path]
    return DeviceResidency(a.layers, steps.batch, a.hot, max_positions=steps.cap, device=where,
                           use_native=use_native, compile_kernel=compile_kernel)


def _resolve_all(table: DeviceResidency, topk: torch.Tensor) -> list[Any]:
    """Every layer's resolve of one step (``topk`` ``[layers, B, K]``): what the graph
    captures, and what the eager device paths run."""
    return [table.resolve_layer(layer, topk[layer]) for layer in range(table.num_layers)]


class _Graph:
    """The ``device_graph`` / ``device_compiled`` path's table: its step's 61 resolves
    captured once after the warm-up and replayed, reading the top-k from static input
    tensors."""

    def __init__(self, table: DeviceResidency, like: torch.Tensor) -> None:
        self.table = table
        self.static = torch.full_like(like, -1)
        self.graph: dev.CapturedGraph | None = None

    def load(self, topk: torch.Tensor) -> float:
        """Copy a step's top-k into the static inputs; ms, synchronized (not in the step)."""
        dev.synchronize()
        t0 = time.perf_counter()
        self.static.copy_(topk)
        dev.synchronize()
        return (time.perf_counter() - t0) * 1e3

    def capture(self) -> float:
        """Record the step (executes nothing: the table is unchanged); ms it took."""
        t0 = time.perf_counter()
        self.graph = dev.CapturedGraph(lambda: _resolve_all(self.table, self.static))
        return (time.perf_counter() - t0) * 1e3

    def run(self) -> None:
        """After the bound step: the warm-up (eager, side stream) until captured, then a replay."""
        if self.graph is None:
            dev.run_on_side_stream(lambda: _resolve_all(self.table, self.static))
        else:
            self.graph.replay()


def _eager_equal(a: argparse.Namespace, graph: DeviceResidency, totals: tuple[int, int],
                 steps: _Steps, topks: list[torch.Tensor], where: torch.device) -> bool:
    """The same steps on a second table resolved eagerly (``device_ops``: the tensor ops,
    not compiled): equal measured (valid, miss) totals and equal final state of the
    request rows (the trash row and columns absorb masked scatters in any order, as in
    the CUDA graph test). After the timing, not in it."""
    ref = _device_table(a, "device_ops", steps, where)
    for t, step in enumerate(topks):
        steps.bind(ref, t)
        _resolve_all(ref, step)
        if t == a.warmup - 1:
            ref.check()  # drop the warm-up steps' totals, as the graph's table did
    if ref.check() != totals:
        return False
    rows = ref.num_rows
    return (all(torch.equal(getattr(graph, n)[:, :rows, :-1], getattr(ref, n)[:, :rows, :-1])
                for n in ("pos_slot", "slot_pos", "stamp"))
            and all(torch.equal(getattr(graph, n)[:, :rows], getattr(ref, n)[:, :rows])
                    for n in ("tag", "clock")))


def _no_sync() -> None:
    return None


def _where(a: argparse.Namespace) -> torch.device:
    """The device ``--device`` names (``_paths`` checked it is this machine's)."""
    return dev.device() if a.device != "cpu" else torch.device("cpu")


def _run_path(a: argparse.Namespace, path: str, steps: _Steps,
              topks: list[torch.Tensor]) -> dict[str, Any]:
    where = _where(a)
    sync = dev.synchronize if where.type != "cpu" else _no_sync  # the CPU timing stays as it was
    table: Any
    threads_before = torch.get_num_threads()
    if path in DEVICE_PATHS:
        table = _device_table(a, path, steps, where)
        torch.set_num_threads(a.device_threads)
    else:
        threads = 1 if path == "host" else a.threads
        table = NativeResidency(a.layers, steps.batch, a.hot, nthreads=threads)
    graph = _Graph(table, topks[0]) if path in GRAPH_PATHS else None
    extra: dict[str, Any] = {}
    times: list[float] = []
    copies: list[float] = []
    valid = misses = 0
    reads_timed = 0
    for t, step in enumerate(topks):
        measured = t >= a.warmup
        if graph is not None:
            if t == a.warmup:
                try:
                    extra["capture_ms"] = round(graph.capture(), 3)
                except RuntimeError as e:  # recorded in the row: the other rows still run
                    extra["error"] = f"graph capture failed: {e}"
                    break
            copy_ms = graph.load(step)
            if measured:
                copies.append(copy_ms)
        sync()
        r0 = sum(dev.host_reads().values())
        t0 = time.perf_counter()
        steps.bind(table, t)
        if graph is not None:
            graph.run()
        elif path in DEVICE_PATHS:
            _resolve_all(table, step)
        else:
            for layer in range(a.layers):
                res = table.resolve_layer(layer, dev.host_read(step[layer], reason=dev.TOPK_READ))
                if measured:
                    valid += res.num_valid
                    misses += res.num_misses
        sync()
        elapsed = time.perf_counter() - t0
        if measured:
            times.append(elapsed * 1e3)
            reads_timed += sum(dev.host_reads().values()) - r0
        if path in DEVICE_PATHS and t == a.warmup - 1:
            table.check()  # drop the warm-up steps' totals (not timed)
    torch.set_num_threads(threads_before)
    if path in DEVICE_PATHS and "error" not in extra:
        valid, misses = table.check()  # after the timed steps: one read for the hit rate
    if graph is not None and "error" not in extra:
        extra["equal_to_eager"] = _eager_equal(a, table, (valid, misses), steps, topks, where)
        extra["topk_copy"] = TOPK_COPY
        extra["topk_copy_ms_per_step"] = statistics.median(copies)
    elif graph is not None:
        extra["equal_to_eager"] = False
    return {"path": path, "device": a.device, "batch": steps.batch, "context": steps.ctx,
            "hit_rate": 1.0 - misses / valid if valid else 0.0,
            "host_ms_per_step": statistics.median(times) if times else None,
            "host_syncs_per_step": reads_timed / len(times) if times else None,
            "ms_per_step_steps": [round(x, 3) for x in times],
            "threads": {"host": 1, "host_threads": a.threads}.get(path, a.device_threads),
            "kernel": table.kernel if path in DEVICE_PATHS else "native",
            "device_state_bytes": table.state_bytes if path in DEVICE_PATHS else None,
            **extra}


def run(a: argparse.Namespace) -> dict[str, Any]:
    paths = _paths(a)
    where = _where(a)
    t_start = time.time()
    rows: list[dict[str, Any]] = []
    load = [os.getloadavg()[0]]
    for ctx in [int(c) for c in a.contexts.split(",")]:
        for kind in a.traces.split(","):
            traces = _traces(a, kind, ctx)
            for batch in [int(b) for b in a.batches.split(",")]:
                topks = _topks(a, traces, batch, where)
                steps = _Steps(a, batch, ctx)
                for path in paths:
                    row = _run_path(a, path, steps, topks)
                    row["trace"] = kind
                    rows.append(row)
                    if a.verbose:
                        print(_line(row), file=sys.stderr, flush=True)
                del topks
            load.append(os.getloadavg()[0])
    return {
        "bench": "sparse-scale",
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(t_start)),
        "machine": {"cpus": os.cpu_count(), "machine": platform.machine(),
                    "processor": platform.processor(), "torch_threads": torch.get_num_threads(),
                    "accelerator": dev.device_name() if a.device != "cpu" else None,
                    "torch": torch.__version__, "loadavg_1m": load},
        "config": {**{k: getattr(a, k) for k in ("layers", "k", "hot", "contexts", "batches",
                                                 "traces", "steps", "warmup", "distinct", "block",
                                                 "threads", "device_threads", "quick", "seed",
                                                 "device")},
                   "paths": paths,
                   "timing": "wall time of bind_step + every layer's resolve (device_graph, "
                             "device_compiled: bind_step + one replay), median over the "
                             "measured steps"
                             + ("; each step starts and ends with a device synchronize, not "
                                "counted in host_syncs_per_step" if a.device != "cpu" else "")},
        "rows": rows,
    }


def _line(r: dict[str, Any]) -> str:
    """One row of :func:`report` (and of ``--verbose``)."""
    ms = r["host_ms_per_step"]
    syncs = r["host_syncs_per_step"]
    eq = r.get("equal_to_eager")
    return (f"  {r['path']:15s} {r['batch']:5d} {r['context']:8d} {r['trace']:8s} "
            + (f"{ms:10.2f} {syncs:10.0f}" if ms is not None else f"{'-':>10s} {'-':>10s}")
            + f" {r['hit_rate']:8.4f}" + ("" if eq is None else f"  {'yes' if eq else 'NO'}")
            + (f"  {r['error']}" if "error" in r else ""))


def report(res: dict[str, Any]) -> str:
    c, m = res["config"], res["machine"]
    gpu = m.get("accelerator")
    where = f"{m['cpus']} CPUs" + (f", {c['device']}: {gpu}" if gpu else "")
    lines = [f"sparse-scale: {c['layers']} layers, top-k {c['k']}, hot buffer {c['hot']} rows, "
             f"{c['steps']} measured steps after {c['warmup']} (resolve only, {where})",
             f"  {'path':15s} {'batch':>5s} {'context':>8s} {'trace':8s} {'ms/step':>10s} "
             f"{'syncs/step':>10s} {'hit rate':>8s}"
             + ("  graph = eager" if any("equal_to_eager" in r for r in res["rows"]) else "")]
    lines += [_line(r) for r in res["rows"]]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, ``--quick`` applied (tests build single cases from it too)."""
    p = argparse.ArgumentParser(prog="ascend-offload bench sparse-scale",
                                description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=61)
    p.add_argument("--k", type=int, default=2048, help="top-k per (request, layer)")
    p.add_argument("--hot", type=int, default=4096, help="hot-buffer rows per (request, layer)")
    p.add_argument("--contexts", default="32768,131072", help="context lengths at step 0")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--traces", default="drift,uniform", help=f"of {', '.join(TRACE_KINDS)}")
    p.add_argument("--paths", default=None,
                   help=f"of {', '.join(PATHS)}; default: every path but device_graph and "
                        "device_compiled with --device cpu, every path but device on an "
                        "accelerator (device_graph and device_compiled where it captures "
                        "and compiles: CUDA)")
    p.add_argument("--device", default="cpu",
                   help="where the top-k lives and the device tables run: cpu, or this machine's "
                        "accelerator (cuda); the host paths' tables stay on the host")
    p.add_argument("--steps", type=int, default=3, help="measured steps")
    p.add_argument("--warmup", type=int, default=2, help="steps that fill the hot buffers first")
    p.add_argument("--distinct", type=int, default=8, help="distinct traces per kind and context")
    p.add_argument("--block", type=int, default=128, help="host pool block size")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="threads of the host_threads path")
    p.add_argument("--device-threads", type=int, default=1,
                   help="torch intra-op threads of the device paths (on CPU: their kernels)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="a small smoke run: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    p.add_argument("--json", help="write the result as JSON here")
    p.add_argument("-v", "--verbose", action="store_true", help="print each row as it finishes")
    a = p.parse_args(argv)
    if a.quick:
        for k, v in QUICK.items():
            setattr(a, k, v)
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    res = run(a)
    print(report(res))
    if a.json:
        write_json(a.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
