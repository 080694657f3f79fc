"""``ascend-offload bench pd``: per-layer P/D pull throughput against a raw Mooncake read.

Two processes on 127.0.0.1 (Mooncake TCP): a prefill rank (producer) and a
decode rank (consumer). One request of ``--blocks`` blocks is pulled layer by
layer through the full protocol (``read_ready_batch`` -> validation -> one
batched read per layer -> ``read_done``) and, in the same run, the decode rank
reads the very same byte runs straight through the engine (same descriptors,
same coalescing, no protocol). The figure of merit is protocol throughput
divided by raw throughput (target >= 0.7).

The P/D time runs from the prefill rank starting to publish to the decode
rank holding the request's outcome, both read in the rank processes on the
host's monotonic clock: what a decode pays, not the parent's queue hops
(``pd.parent_median_s`` adds them, for reference). ``--layer-delay-ms`` adds
simulated per-layer prefill compute to show the pull overlapping it.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pattern(kind: str, n: int, num_blocks: int) -> tuple[list[int], list[int]]:
    """Source and destination block ids of the benchmark request."""
    if kind == "contiguous":
        return list(range(n)), list(range(num_blocks - n, num_blocks))
    if kind == "scattered":  # every other block on decode: nothing coalesces across blocks
        return list(range(n)), list(range(0, 2 * n, 2))
    raise ValueError(f"--pattern={kind!r} (accepted: 'contiguous', 'scattered')")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ascend_offload.bench.pd_ranks import KVShape, RankConfig, start_ranks

    num_blocks = max(2 * args.blocks, args.blocks + 1)
    shape = KVShape(num_layers=args.layers, num_blocks=num_blocks,
                    main_block_bytes=args.main_block_bytes, indexer_block_bytes=args.indexer_block_bytes)
    port = _free_port()
    d, p = start_ranks([
        RankConfig("decode", 0, 1, 1, shape, backend=args.backend, kv_port=port),
        RankConfig("prefill", 0, 1, 1, shape, backend=args.backend),
    ])
    src, dst = _pattern(args.pattern, args.blocks, num_blocks)
    per_layer_bytes = args.blocks * (2 * args.main_block_bytes + args.indexer_block_bytes)
    total = per_layer_bytes * args.layers
    try:
        meta = p.call("meta")
        pd_times: list[float] = []
        parent_times: list[float] = []
        raw_times: list[float] = []
        # P/D and raw alternate so load from other processes hits both alike.
        for i in range(args.warmup + args.iters):
            rid = f"bench-{i}"
            d.call("expect", rid, dst)
            p.call("add", rid, src, "127.0.0.1", port, 1)
            # Decode is already waiting for the outcome when prefill starts publishing, so no
            # RPC reaches either rank while the bytes move.
            d.post("wait", 1, 60.0)
            t0 = time.perf_counter()
            p.post("run", list(range(args.layers)), args.layer_delay_ms / 1000.0)
            outs = d.collect("wait", timeout_s=70)
            t_parent = time.perf_counter() - t0
            t_run = p.collect("run")
            if len(outs) != 1 or not outs[0][1]:
                raise RuntimeError(f"P/D pull of {rid} failed: {outs}")
            p.call("finished", 1, 10.0)
            raw = d.call("raw_pull", meta, src, dst, 1, timeout_s=60)[0]
            if i >= args.warmup:
                # Prefill's first publish to decode holding the outcome, both on the host's
                # monotonic clock: what a decode pays, without the parent's queue hops.
                pd_times.append(outs[0][4] - t_run)
                parent_times.append(t_parent)
                raw_times.append(raw)
        stats = d.call("stats")
    finally:
        d.close()
        p.close()
    pd_med, raw_med = statistics.median(pd_times), statistics.median(raw_times)
    compute = args.layers * args.layer_delay_ms / 1000.0
    # With simulated compute the comparable figure is the transfer time left after compute.
    pd_xfer = max(pd_med - compute, 1e-9) if compute else pd_med
    res = {
        "bench": "pd",
        "backend": args.backend,
        "pattern": args.pattern,
        "layers": args.layers,
        "blocks": args.blocks,
        "bytes_per_layer": per_layer_bytes,
        "bytes_total": total,
        "iters": args.iters,
        "layer_delay_ms": args.layer_delay_ms,
        "pd": {"median_s": pd_med, "min_s": min(pd_times), "GBps": total / pd_med / 1e9,
               "parent_median_s": statistics.median(parent_times)},
        "raw": {"median_s": raw_med, "min_s": min(raw_times), "GBps": total / raw_med / 1e9},
        "descriptors_per_read": stats["descriptors"] / max(1, stats["reads"]),
        "ratio_pd_over_raw": raw_med / pd_med if not compute else None,
        "exposed_transfer_s": pd_xfer if compute else None,
        "target_ratio": 0.7,
    }
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ascend-offload bench pd", description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write results JSON here (parent dirs created)")
    ap.add_argument("--backend", default="mooncake", help="transfer backend (mooncake; loopback is in-process only)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=32, help="blocks in the request")
    # DeepSeek-V3.2-like, 64-token blocks: main KV 1152 B/token as two halves, indexer 256 B/token.
    ap.add_argument("--main-block-bytes", type=int, default=64 * 576)
    ap.add_argument("--indexer-block-bytes", type=int, default=64 * 256)
    ap.add_argument("--pattern", default="contiguous", choices=["contiguous", "scattered"])
    ap.add_argument("--iters", type=int, default=31, help="alternating P/D and raw pulls (11 gave 0.66-0.93 run to run)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--layer-delay-ms", type=float, default=0.0, help="simulated prefill compute per layer")
    args = ap.parse_args(argv)
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as exc:
        sys.stderr.write(f"bench pd needs Mooncake ({exc}); pip install 'ascend-offload[mooncake]'\n")
        return 1
    res = run(args)
    mb = res["bytes_total"] / 1e6
    print(f"P/D pull  ({res['pattern']}, {args.layers} layers x {args.blocks} blocks = {mb:.1f} MB): "
          f"median {res['pd']['median_s'] * 1e3:.1f} ms, {res['pd']['GBps']:.3f} GB/s "
          f"(seen from the parent, with its queue hops: {res['pd']['parent_median_s'] * 1e3:.1f} ms)")
    print(f"raw read  (same byte runs, same run):            median {res['raw']['median_s'] * 1e3:.1f} ms, "
          f"{res['raw']['GBps']:.3f} GB/s")
    if res["ratio_pd_over_raw"] is not None:
        print(f"ratio P/D / raw = {res['ratio_pd_over_raw']:.2f}x (target >= 0.7x); "
              f"{res['descriptors_per_read']:.1f} descriptors per batched read")
    else:
        print(f"with {args.layer_delay_ms} ms/layer compute: transfer exposed after compute "
              f"{res['exposed_transfer_s'] * 1e3:.1f} ms (raw pull alone {res['raw']['median_s'] * 1e3:.1f} ms)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
