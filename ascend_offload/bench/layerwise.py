"""``ascend-offload bench layerwise``: does the per-layer pipeline hide store traffic?

A chunked-prefill step over N layers sharing I + B physical buffers: each layer
reloads the request's earlier chunks from the store (shared layers only), writes
its new KV, runs a compute stand-in (a single-thread matmul sized to a chosen
time), and saves its new blocks; loads of later layers are prefetched while
earlier layers compute. Everything is real: the embedded ``LocalStore``, the
reuse gate, the pipeline's ordered copy queue, real byte copies.

Baseline, measured in the same run on the same data: per layer, the compute
alone and the transfer alone (that layer's load + save through the same code).
The ideal pipelined step is ``sum_l max(compute_l, transfer_l)``; the printed
ratio is achieved step time / that bound (target <= 1.15), plus the serial sum
``sum_l compute_l + transfer_l`` to show what overlapping saved, and a floor: the
same copies submitted at once beside the same compute, no pipeline and no
dependencies (``floor_step``), which shows how much of the ratio the machine itself
imposes (shared cores and memory bandwidth) and how much the pipeline adds on top.
The transfer baseline is the copy time from submit to done
(:meth:`TransferPipeline.move_now`): the store bookkeeping is not in it, while the
pipelined step pays its own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ascend_offload.layerwise.pipeline import LayerwisePipeline
from ascend_offload.layerwise.plan import Independent, LayerwisePlan, plan_uniform
from ascend_offload.layerwise.steps import BlockRef, LoadTimeout, PipelineError, StepIO
from ascend_offload.store.local import LocalStore


class TransferPipeline(LayerwisePipeline):
    """The product pipeline plus one bench measurement: its transfer alone.

    Why a subclass: the bench's baselines must move bytes with exactly the
    pipeline's own copy path (same layer I/O, same queue), but no step, gate or
    hook belongs to that measurement, and nothing in the product calls it.
    """

    def move_now(self, items: Sequence[tuple[str, Sequence[BlockRef], Sequence[BlockRef]]]) -> float:
        """For each ``(layer, load, save)``: load ``load`` into the layer's blocks and save
        ``save`` from them, through the same queue and copy code as a step, all submitted
        at once (no gate, no ordering between layers) and waited for here, outside any
        step. Returns the seconds from the first submit to the end of the copies; the
        store bookkeeping before is planned as at a step start and not counted."""
        self._check_open()
        if self.in_step:
            raise PipelineError("move_now inside a step")
        lio = self._io()
        lio.plan_step(((n, tuple(ld)) for n, ld, _ in items), ((n, tuple(sv)) for n, _, sv in items))
        try:
            t0 = time.perf_counter()
            last = 0
            for layer, load, save in items:
                if load:
                    last = lio.queue_load(layer, load) or last
                if save:
                    last = lio.queue_save(layer, save, [], 0.0) or last
            if last and not lio.queue.wait(last, self.load_timeout_s + self.save_timeout_s):
                raise LoadTimeout(f"layerwise: transfer of {len(items)} layers did not finish")
            took = time.perf_counter() - t0
            lio.reap()
        finally:
            lio.end_plan()
        return took


def _parse_independent(text: str) -> Independent:
    return "all" if text == "all" else [int(x) for x in text.split(",") if x.strip()]


class _Compute:
    """A per-layer compute stand-in whose duration is calibrated to ``target_s``
    (single thread).

    ``kind="matmul"`` (default) runs ``ops`` equal square matmuls per layer, each
    sized to ``target_s / ops``: a transformer layer is about that many large ops
    (projections, attention, MLP), and every op boundary is a point where the
    model thread hands the GIL back and forth with our I/O threads, which is the
    real cost of host-side I/O threads next to a Python model runner.
    ``kind="sleep"`` idles the host thread for ``target_s``, like a host that
    launched the layer on an accelerator and waits.
    """

    def __init__(self, target_s: float, kind: str = "matmul", ops: int = 8) -> None:
        self.kind = kind
        self.target_s = target_s
        self.ops = max(1, ops)
        self.n = 0
        if kind == "matmul":
            self._calibrate(target_s / self.ops)

    @staticmethod
    def _time(n: int, samples: int = 3) -> float:
        a = torch.randn(n, n)
        b = torch.randn(n, n)
        out = torch.empty(n, n)
        torch.mm(a, b, out=out)
        ts = []
        for _ in range(samples):
            t0 = time.perf_counter()
            torch.mm(a, b, out=out)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    def _calibrate(self, op_s: float) -> None:
        n = 64
        for _ in range(6):
            t = self._time(n)
            n = max(16, int(n * (op_s / max(t, 1e-7)) ** (1 / 3)))
        self.n = n
        self.a = torch.randn(n, n)
        self.b = torch.randn(n, n)
        self.out = torch.empty(n, n)

    def run(self) -> None:
        if self.kind == "sleep":
            time.sleep(self.target_s)
            return
        for _ in range(self.ops):
            torch.mm(self.a, self.b, out=self.out)


class _Bench:
    def __init__(self, args: argparse.Namespace, b: int) -> None:
        self.args = args
        self.plan: LayerwisePlan = plan_uniform(args.layers, b, _parse_independent(args.independent))
        self.page_elems = args.page_kib * 1024 // 4
        nblocks = args.load_blocks + args.save_blocks
        # One physical buffer per slot; the layers of a slot alias it (as the layout hook does).
        self.phys = torch.zeros(self.plan.num_physical, nblocks, self.page_elems)
        self.kv = {n: self.phys[self.plan.slot_of[n]] for n in self.plan.layers}
        page = args.page_kib * 1024
        objects = args.layers * (args.load_blocks + args.save_blocks * (args.steps + 8))
        self.store = LocalStore(capacity_bytes=objects * page, page_bytes=page)
        self.pipe = TransferPipeline(
            self.plan, self.store, prefetch_layers=args.prefetch,
            load_timeout_s=60.0, save_timeout_s=60.0,
        )
        self.pipe.register_kv_caches(self.kv)
        self.load = tuple(BlockRef(i, f"ctx{i}") for i in range(args.load_blocks))
        self.step_no = 0
        self.src = torch.randn(args.save_blocks, self.page_elems)
        self._new = slice(args.load_blocks, args.load_blocks + args.save_blocks)

    def write_new_kv(self, layer: str) -> None:
        """The layer's new KV of this step, written into its own blocks (as the model does)."""
        self.kv[layer][self._new].copy_(self.src)

    def _save_refs(self) -> tuple[BlockRef, ...]:
        self.step_no += 1
        base = self.args.load_blocks
        return tuple(BlockRef(base + j, f"s{self.step_no}/{j}") for j in range(self.args.save_blocks))

    def populate(self) -> None:
        """Store the context blocks of every layer (the earlier chunks of the request)."""
        self.pipe.start_step(StepIO(save=tuple(BlockRef(r.block_id, r.key) for r in self.load)))
        for layer in self.plan.layers:
            self.pipe.wait_for_layer_load(layer)
            self.kv[layer][: self.args.load_blocks].normal_()
            self.pipe.save_layer(layer)
        self.pipe.finish_step()

    def step(self, compute: _Compute | None, traffic: bool = True) -> float:
        """One pipelined step; ``traffic=False`` runs the same hooks with nothing to
        load or save (the pipeline's own fixed cost)."""
        io = StepIO(load_shared=self.load, save=self._save_refs()) if traffic else StepIO()
        t0 = time.perf_counter()
        self.pipe.start_step(io)
        for layer in self.plan.layers:
            # vLLM's order: the layer's new KV is written, then its hook, attention, save.
            self.write_new_kv(layer)
            self.pipe.wait_for_layer_load(layer)
            if compute is not None:
                compute.run()
            self.pipe.save_layer(layer)
        self.pipe.finish_step()
        return time.perf_counter() - t0

    def transfer_layer(self, layer: str, save: tuple[BlockRef, ...]) -> float:
        """One layer's load (shared layers only) + save through the pipeline's own copy
        code; the seconds the copies took from their submit (see ``TransferPipeline.move_now``)."""
        return self.pipe.move_now([self.transfer_item(layer, save)])

    def transfer_item(self, layer: str, save: tuple[BlockRef, ...]
                      ) -> tuple[str, tuple[BlockRef, ...], tuple[BlockRef, ...]]:
        return layer, (self.load if self.plan.is_shared(layer) else ()), save

    def transfer_alone(self, reps: int) -> dict[str, float]:
        """Per layer: its load + save, nothing overlapped."""
        out: dict[str, float] = {}
        for layer in self.plan.layers:
            ts = []
            for _ in range(reps):
                ts.append(self.transfer_layer(layer, self._save_refs()))
            out[layer] = statistics.median(ts)
        return out

    def close(self) -> None:
        self.pipe.close()


def parallel_probe(compute: _Compute, copy_bytes: int, reps: int = 5) -> dict[str, float]:
    """What overlap this machine allows right now: the compute stand-in on this thread and a
    plain tensor copy of about the same duration on another, no pipeline involved. A ratio
    well above 1 means the cores are taken by others and no pipeline can reach its bound."""
    src = torch.empty(copy_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    compute.run()
    c = time.perf_counter() - t0
    t0 = time.perf_counter()
    dst.copy_(src)
    one = max(time.perf_counter() - t0, 1e-7)
    n_copies = max(1, round(c / one))
    ratios = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n_copies):
            dst.copy_(src)
        tc = time.perf_counter() - t0
        t0 = time.perf_counter()
        compute.run()
        tm = time.perf_counter() - t0

        def copies() -> None:
            for _ in range(n_copies):
                dst.copy_(src)

        th = threading.Thread(target=copies)
        t0 = time.perf_counter()
        th.start()
        compute.run()
        th.join()
        ratios.append((time.perf_counter() - t0) / max(tc, tm))
    return {"ratio": statistics.median(ratios), "copies": n_copies}


def floor_step(bench: _Bench, compute: _Compute) -> float:
    """The step's own work with no pipeline: every layer's load + save submitted to the
    pipeline's copy queue at once (``move_now`` on a second thread: one store pass,
    then the copies), while this thread runs every layer's KV write + compute; no
    gate, no per-layer hand-off, no dependency. Why: the ideal bound assumes compute
    and transfer run side by side at their alone speeds; where they share cores or
    memory bandwidth even this overlap is slower than the ideal, and no pipeline can
    beat it. ``achieved / floor`` is then what the pipeline's ordering and hooks cost."""
    items = [bench.transfer_item(layer, bench._save_refs()) for layer in bench.plan.layers]
    th = threading.Thread(target=bench.pipe.move_now, args=(items,), name="lw-floor")
    t0 = time.perf_counter()
    th.start()
    for layer in bench.plan.layers:
        bench.write_new_kv(layer)
        compute.run()
    th.join()
    return time.perf_counter() - t0


def _compute_alone(compute: _Compute, bench: _Bench) -> dict[str, float]:
    """Each layer's compute as the pipelined step does it, with no transfer running: its
    KV write into that layer's own blocks (in layer order, so the physical buffers rotate
    as in the step) plus the compute stand-in.

    Why the real blocks: one scratch buffer written over and over stays in
    cache (4 MiB in ~0.15 ms here) while the step's writes rotate over the slots' buffers
    and run at memory speed (~0.5 ms): a baseline the step could never reach.
    """
    out: dict[str, float] = {}
    for layer in bench.plan.layers:
        t0 = time.perf_counter()
        bench.write_new_kv(layer)
        compute.run()
        out[layer] = time.perf_counter() - t0
    return out


def run_one(args: argparse.Namespace, b: int) -> dict[str, Any]:
    """Rounds of (transfer alone, compute alone, one pipelined step), so each ratio compares
    measurements taken moments apart; the median round is reported."""
    bench = _Bench(args, b)
    try:
        bench.populate()
        transfer0 = bench.transfer_alone(args.reps)
        shared0 = [t for n, t in transfer0.items() if bench.plan.is_shared(n)] or list(transfer0.values())
        target = statistics.median(shared0) * args.compute_scale
        # A layer's compute includes its KV write: size the stand-in to the rest, so that
        # compute ~= transfer (the balanced case) holds for the whole layer.
        kv_write = statistics.median(_compute_alone(_Compute(0.0, "sleep"), bench).values())
        target = max(target - kv_write, 0.1 * target)
        if args.compute_ms is not None:
            target = args.compute_ms / 1e3
        compute = _Compute(target, args.compute_kind, args.compute_ops)
        if args.compute_ms is None:
            # The matmul is calibrated on one warm op; in the layer loop (KV writes
            # rotating through the slots in between) it ran up to ~25 % shorter, which made
            # the "balanced" case transfer-bound. Re-aim at the measured layer time.
            want = statistics.median(shared0) * args.compute_scale
            for _ in range(3):
                got = statistics.median(_compute_alone(compute, bench).values())
                if abs(got - want) <= 0.03 * want:
                    break
                target = max(target * (want - kv_write) / max(got - kv_write, 1e-6), 0.1 * want)
                compute = _Compute(target, args.compute_kind, args.compute_ops)
        probe = parallel_probe(compute, args.page_kib * 1024 * args.load_blocks)
        for _ in range(2):
            bench.step(compute)  # warm-up
        rounds = []
        for _ in range(args.steps):
            transfer = bench.transfer_alone(1)
            comp = _compute_alone(compute, bench)
            c = statistics.median(comp.values())
            ideal = sum(max(comp[n], t) for n, t in transfer.items())
            serial = sum(comp[n] + t for n, t in transfer.items())
            blocked0 = bench.pipe.stats().load_wait_s
            achieved = bench.step(compute)
            blocked = bench.pipe.stats().load_wait_s - blocked0
            no_traffic = bench.step(compute, traffic=False)
            floor = floor_step(bench, compute)
            shared = [t for n, t in transfer.items() if bench.plan.is_shared(n)] or [0.0]
            rounds.append({
                "blocked_ms": blocked * 1e3,  # compute thread waiting for slots / loads
                # how much slower the compute thread's own work ran during the pipelined
                # step than alone: CPU shared with the copies (1.0 on free cores)
                "compute_slowdown": (achieved - blocked) / sum(comp.values()),
                "compute_ms": c * 1e3, "transfer_ms_shared": statistics.median(shared) * 1e3,
                "ideal_ms": ideal * 1e3, "serial_ms": serial * 1e3, "achieved_ms": achieved * 1e3,
                "ratio_vs_ideal": achieved / ideal, "ratio_vs_serial": achieved / serial,
                # dependency-free overlap of the same work (see floor_step) over the ideal,
                # and the pipeline over that floor
                "floor_ms": floor * 1e3, "floor_vs_ideal": floor / ideal,
                "ratio_vs_floor": achieved / floor,
                # the same step with nothing to move: hooks + bookkeeping over compute alone
                "no_traffic_vs_compute": no_traffic / sum(comp.values()),
            })
        mid = sorted(rounds, key=lambda r: r["ratio_vs_ideal"])[len(rounds) // 2]
        st = bench.pipe.stats()
        gate = bench.pipe.gate.stats()
        return {
            "shared_buffers": b,
            "physical_buffers": bench.plan.num_physical,
            "footprint_ratio": bench.plan.footprint_ratio(),
            "compute_kind": compute.kind,
            "matmul_n": compute.n,
            "compute_ops": compute.ops if compute.kind == "matmul" else 0,
            "compute_ms_per_layer": mid["compute_ms"],
            "transfer_ms_shared_layer": mid["transfer_ms_shared"],
            "ideal_ms": mid["ideal_ms"],
            "serial_ms": mid["serial_ms"],
            "achieved_ms": mid["achieved_ms"],
            "blocked_ms": mid["blocked_ms"],
            "compute_slowdown": statistics.median(r["compute_slowdown"] for r in rounds),
            "ratio_vs_ideal": statistics.median(r["ratio_vs_ideal"] for r in rounds),
            "ratio_vs_serial": statistics.median(r["ratio_vs_serial"] for r in rounds),
            "floor_vs_ideal": statistics.median(r["floor_vs_ideal"] for r in rounds),
            "ratio_vs_floor": statistics.median(r["ratio_vs_floor"] for r in rounds),
            "no_traffic_vs_compute": statistics.median(r["no_traffic_vs_compute"] for r in rounds),
            "rounds": rounds,
            "parallel_probe_ratio": probe["ratio"],
            "gate_waits": gate.waits,
            "gate_wait_ms": gate.wait_s * 1e3,
            "prefetched_loads": st.prefetched_loads,
            "native_jobs": st.native_jobs,
            "load_errors": st.load_errors,
            "save_errors": st.save_errors,
        }
    finally:
        bench.close()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ascend-offload bench layerwise", description=__doc__)
    p.add_argument("--layers", type=int, default=16, help="cache-bearing layers N")
    p.add_argument("--shared-buffers", default="1,2,3", help="B values to run (comma list)")
    p.add_argument("--independent", default="0", help="independent layers (comma list or 'all')")
    p.add_argument("--prefetch", type=int, default=2, help="layerwise_prefetch_layers (the product default)")
    p.add_argument("--page-kib", type=int, default=1024,
                   help="bytes of one layer's block page, KiB (1 MiB x 16 blocks = 16 MiB per layer: a 32k-token prefix of a DeepSeek-V3.2-class layer is ~21 MiB)")
    p.add_argument("--load-blocks", type=int, default=16, help="earlier-chunk blocks reloaded per shared layer")
    p.add_argument("--save-blocks", type=int, default=4, help="new blocks saved per layer per step")
    p.add_argument("--compute-ms", type=float, default=None,
                   help="per-layer compute time (default: the measured shared-layer transfer time "
                        "x --compute-scale, the balanced and hardest case)")
    p.add_argument("--compute-scale", type=float, default=1.0)
    p.add_argument("--compute-kind", choices=["matmul", "sleep"], default="matmul",
                   help="matmul: real CPU compute (--compute-ops matmuls per layer); sleep: host "
                        "idles as with device compute")
    p.add_argument("--compute-ops", type=int, default=8,
                   help="matmuls per layer (op boundaries, where the GIL changes hands)")
    p.add_argument("--steps", type=int, default=9, help="measured rounds (median reported)")
    p.add_argument("--reps", type=int, default=5, help="repetitions of the alone-measurements")
    p.add_argument("--threads", type=int, default=1, help="torch threads for the compute")
    p.add_argument("--json", metavar="PATH", help="write results JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        bs = [int(x) for x in str(args.shared_buffers).split(",") if x.strip()]
    except ValueError:
        sys.stderr.write(f"--shared-buffers {args.shared_buffers!r}: not a comma list of ints\n")
        return 2
    torch.set_num_threads(args.threads)
    results = [run_one(args, b) for b in bs]
    for r in results:
        sys.stdout.write(
            f"layerwise N={args.layers} B={r['shared_buffers']} (physical {r['physical_buffers']}, "
            f"{r['compute_kind']}, "
            f"footprint {r['footprint_ratio']:.3f}): compute {r['compute_ms_per_layer']:.2f} ms/layer, "
            f"transfer {r['transfer_ms_shared_layer']:.2f} ms/shared layer; step achieved "
            f"{r['achieved_ms']:.1f} ms, ideal max(compute,transfer) {r['ideal_ms']:.1f} ms, "
            f"serial {r['serial_ms']:.1f} ms (compute thread blocked {r['blocked_ms']:.1f} ms, "
            f"its own work {r['compute_slowdown']:.2f}x slower than alone) "
            f"-> ratio vs ideal {r['ratio_vs_ideal']:.3f} "
            f"(target <= 1.15), vs serial {r['ratio_vs_serial']:.3f}; the step with nothing to "
            f"move {r['no_traffic_vs_compute']:.3f}x the compute alone; machine parallel probe "
            f"{r['parallel_probe_ratio']:.2f} (1.0 = two free cores); dependency-free floor "
            f"{r['floor_vs_ideal']:.3f}x ideal, pipeline {r['ratio_vs_floor']:.3f}x that floor\n"
        )
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "bench": "layerwise",
            "config": {k: v for k, v in vars(args).items() if k != "json"},
            "cpu_count": os.cpu_count(),
            "results": results,
        }
        path.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
