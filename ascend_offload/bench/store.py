"""``ascend-offload bench store``: save/load throughput of block-sized objects.

Two paths, each against a plain contiguous torch copy of the same byte count
measured in the same run (the ratio is what matters on a noisy machine):

* ``store``: ``LocalStore`` allocate + ``write_batch`` + commit, and pin +
  ``read_batch`` + unpin — the contract any backend serves;
* ``worker``: ``WorkerPagePool.save/load`` between a paged KV cache (random,
  scattered block ids, several layers) and host pages — the connector's path.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ascend_offload.store.local import LocalStore
from ascend_offload.store.worker_pool import WorkerPagePool


def _paired(fn: Callable[[], Any], baseline: Callable[[], Any], repeats: int) -> tuple[float, float, float]:
    """Alternate ``fn`` and ``baseline`` so both see the same machine load; returns
    (median fn seconds, median baseline seconds, median of per-pair ratios)."""
    fn()
    baseline()
    ts, tb, ratios = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        baseline()
        t2 = time.perf_counter()
        ts.append(t1 - t0)
        tb.append(t2 - t1)
        ratios.append((t2 - t1) / (t1 - t0))
    return statistics.median(ts), statistics.median(tb), statistics.median(ratios)


def bench_store(object_bytes: int, num_objects: int, repeats: int) -> dict[str, Any]:
    total = object_bytes * num_objects
    store = LocalStore(capacity_bytes=total, page_bytes=object_bytes)
    src = torch.randint(0, 255, (num_objects, object_bytes), dtype=torch.uint8)
    dst = torch.empty_like(src)
    counter = [0]

    def save() -> None:
        counter[0] += 1
        keys = [f"r{counter[0]}:{i}" for i in range(num_objects)]
        hs = store.allocate(keys, [object_bytes] * num_objects)
        assert hs is not None
        owned = [h for h in hs if h is not None]
        store.write_batch(owned, src)
        store.commit(owned)
        save.keys = keys  # type: ignore[attr-defined]

    def load() -> None:
        keys = save.keys  # type: ignore[attr-defined]
        pin = store.pin(keys)
        assert pin is not None
        store.read_batch(pin, keys, dst)
        store.unpin(pin)

    plain_dst = torch.empty_like(src)
    copy = lambda: plain_dst.copy_(src)  # noqa: E731
    save_t = _paired(save, copy, repeats)
    load_t = _paired(load, copy, repeats)
    assert torch.equal(dst, src), "store round trip changed bytes"
    return _rates("store", total, save_t, load_t, object_bytes, num_objects)


def bench_worker(layer_block_bytes: int, num_layers: int, num_objects: int, repeats: int) -> dict[str, Any]:
    num_blocks = num_objects * 2
    floats = layer_block_bytes // 4
    kv = {f"layer{i}": torch.randn(num_blocks, floats) for i in range(num_layers)}
    pool = WorkerPagePool(kv, num_blocks=num_blocks, num_pages=num_objects)
    g = torch.Generator().manual_seed(0)
    block_ids = torch.randperm(num_blocks, generator=g)[:num_objects].tolist()
    dst_ids = [b for b in range(num_blocks) if b not in set(block_ids)][:num_objects]
    pages = list(range(num_objects))
    total = pool.page_bytes * num_objects
    src = torch.empty(total, dtype=torch.uint8).random_(0, 255)
    dst = torch.empty_like(src)
    copy = lambda: dst.copy_(src)  # noqa: E731
    save_t = _paired(lambda: pool.save(block_ids, pages), copy, repeats)
    load_t = _paired(lambda: pool.load(pages, dst_ids), copy, repeats)
    for t in kv.values():
        assert torch.equal(t[dst_ids], t[block_ids]), "worker pool round trip changed bytes"
    out = _rates("worker", total, save_t, load_t, pool.page_bytes, num_objects)
    out["layers"] = num_layers
    return out


def _rates(
    path: str,
    total: int,
    save: tuple[float, float, float],
    load: tuple[float, float, float],
    obj: int,
    n: int,
) -> dict[str, Any]:
    return {
        "path": path,
        "object_bytes": obj,
        "objects": n,
        "total_bytes": total,
        "save_GBps": total / save[0] / 1e9,
        "load_GBps": total / load[0] / 1e9,
        "plain_copy_GBps": total / statistics.median([save[1], load[1]]) / 1e9,
        "save_ratio": save[2],
        "load_ratio": load[2],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ascend-offload bench store", description=__doc__)
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--total-mib", type=int, default=64, help="bytes moved per measured call")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--target", type=float, default=0.7)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    total = args.total_mib << 20
    rows: list[dict[str, Any]] = []
    for obj in (64 << 10, 256 << 10, 1 << 20):  # tiny-model block .. a large-model layer group
        rows.append(bench_store(obj, total // obj, args.repeats))
    for layer_bytes, layers in ((16 << 10, 4), (16 << 10, 32), (144 << 10, 8)):
        rows.append(bench_worker(layer_bytes, layers, total // (layer_bytes * layers), args.repeats))
    print(f"{'path':7} {'object':>9} {'objs':>6} {'save GB/s':>10} {'load GB/s':>10} {'copy GB/s':>10} {'save x':>7} {'load x':>7}")
    for r in rows:
        print(
            f"{r['path']:7} {r['object_bytes']:>9} {r['objects']:>6} {r['save_GBps']:>10.2f} "
            f"{r['load_GBps']:>10.2f} {r['plain_copy_GBps']:>10.2f} {r['save_ratio']:>7.2f} {r['load_ratio']:>7.2f}"
        )
    worst = min(min(r["save_ratio"], r["load_ratio"]) for r in rows)
    print(f"worst ratio vs plain torch copy of the same bytes: {worst:.2f} (target >= {args.target})")
    result = {"bench": "store", "threads": 1, "rows": rows, "worst_ratio": worst, "target": args.target}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0
