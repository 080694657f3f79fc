"""``ascend-offload bench store``: save/load throughput of block-sized objects.

Two paths, each against a plain contiguous torch copy of the same byte count
measured in the same run (the ratio is what matters on a noisy machine):

* ``store``: ``LocalStore`` allocate + ``write_batch`` + commit, and pin +
  ``read_batch`` + unpin — the contract any backend serves;
* ``worker``: ``WorkerPagePool.save/load`` between a paged KV cache (random,
  scattered block ids, several layers) and host pages — the connector's path;
* ``mooncake``: ``MooncakeStore`` (the same contract calls as ``store``) against a
  loopback ``mooncake_master`` started by the bench; its baseline is not a torch
  copy but a raw Mooncake ``batch_put_from`` / ``batch_get_into`` of the same bytes
  between registered buffers, through the same client, in the same run.

And the eviction policies' hit rates on the same traces (``bench/store_policy.py``):
ARC vs LRU through the scheduler's index, ``LocalStore(with_data=False)``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import torch

from ascend_offload.bench import store_policy
from ascend_offload.store.local import LocalStore
from ascend_offload.store.pages.worker_pool import WorkerPagePool


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


def _rounds(fns: list[Callable[[], Any]], repeats: int,
            between: Callable[[], Any] | None = None) -> list[list[float]]:
    """Seconds of every ``fns[j]`` in each of ``repeats`` rounds, run back to back so all
    see the same machine load (one warm-up round first); ``between`` runs untimed."""
    out: list[list[float]] = [[] for _ in fns]
    for r in range(repeats + 1):
        for j, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            if r:
                out[j].append(time.perf_counter() - t0)
        if between is not None:
            between()
    return out


def bench_mooncake(master_address: str, object_bytes: int, num_objects: int,
                   repeats: int) -> dict[str, Any]:
    """``MooncakeStore`` save/load against two raw Mooncake baselines moving the same
    bytes between the same tensors, through the same client, in the same rounds:

    * ``raw``: the plain put/get API (``put_batch`` of the source rows, ``get_batch``
      then a copy into the destination) — what a caller without our backend writes;
    * ``zero_copy``: ``batch_put_from``/``batch_get_into`` between buffers registered
      with the client — the transfer itself, the floor no wrapper can beat."""
    from ascend_offload.bench.stores.mooncake import MooncakeStore

    total = object_bytes * num_objects
    store = MooncakeStore(master_address=master_address, page_bytes=object_bytes,
                          staging_bytes=2 * total, global_segment_bytes=max(64 << 20, 6 * total),
                          local_buffer_bytes=max(16 << 20, 2 * total))
    client = store.client
    src = torch.randint(0, 255, (num_objects, object_bytes), dtype=torch.uint8)
    dst, raw_dst, zc_dst = torch.empty_like(src), torch.empty_like(src), torch.empty_like(src)
    for t in (src, zc_dst):
        if client.register_buffer(t.data_ptr(), t.nbytes) != 0:
            raise RuntimeError("register_buffer failed")
    sizes = [object_bytes] * num_objects
    src_ptrs = [src[i].data_ptr() for i in range(num_objects)]
    zc_ptrs = [zc_dst[i].data_ptr() for i in range(num_objects)]
    src_views = [memoryview(src[i].numpy()) for i in range(num_objects)]  # type: ignore[arg-type]  # numpy declares ndarray.__buffer__ for Python >= 3.12 only
    n = [0]
    keys: dict[str, list[str]] = {}

    def fresh() -> None:
        n[0] += 1
        for name in ("ours", "raw", "zc"):
            keys[name] = [f"{name}{n[0]}:{i}" for i in range(num_objects)]

    def save() -> None:
        hs = store.allocate(keys["ours"], sizes)
        assert hs is not None and all(h is not None for h in hs), "Mooncake save skipped"
        ready = [h for h in hs if h is not None]
        store.write_batch(ready, src)
        store.commit(ready)

    def raw_put() -> None:
        assert client.put_batch(keys["raw"], src_views) == 0, "raw put_batch failed"

    def zc_put() -> None:
        codes = client.batch_put_from(keys["zc"], src_ptrs, sizes)
        assert all(c == 0 for c in codes), f"raw batch_put_from failed: {codes[:4]}"

    def load() -> None:
        pin = store.pin(keys["ours"])
        assert pin is not None, "Mooncake load missed"
        store.read_batch(pin, keys["ours"], dst)
        store.unpin(pin)

    def raw_get() -> None:
        got = client.get_batch(keys["raw"])
        with warnings.catch_warnings():  # read-only bytes, only read here
            warnings.simplefilter("ignore", UserWarning)
            for i, b in enumerate(got):
                assert len(b) == object_bytes, "raw get_batch missed"
                raw_dst[i].copy_(torch.frombuffer(b, dtype=torch.uint8))

    def zc_get() -> None:
        codes = client.batch_get_into(keys["zc"], zc_ptrs, sizes)
        assert all(c == object_bytes for c in codes), f"raw batch_get_into failed: {codes[:4]}"

    def drop() -> None:  # keep the segment from filling (eviction would skew timings)
        client.batch_remove(keys["ours"] + keys["raw"] + keys["zc"], True)
        fresh()

    fresh()
    try:
        saves = _rounds([save, raw_put, zc_put], repeats, between=drop)
        save()
        raw_put()
        zc_put()
        loads = _rounds([load, raw_get, zc_get], repeats)
        drop()
        for got in (dst, raw_dst, zc_dst):
            assert torch.equal(got, src), "Mooncake round trip changed bytes"
    finally:
        for t in (src, zc_dst):
            client.unregister_buffer(t.data_ptr())
        store.close()

    def med(ts: list[float]) -> float:
        return statistics.median(ts)

    def ratio(base: list[float], ours: list[float]) -> float:
        return statistics.median([b / o for b, o in zip(base, ours, strict=True)])

    return {
        "path": "mooncake",
        "object_bytes": object_bytes,
        "objects": num_objects,
        "total_bytes": total,
        "save_GBps": total / med(saves[0]) / 1e9,
        "load_GBps": total / med(loads[0]) / 1e9,
        "raw_save_GBps": total / med(saves[1]) / 1e9,
        "raw_load_GBps": total / med(loads[1]) / 1e9,
        "zero_copy_save_GBps": total / med(saves[2]) / 1e9,
        "zero_copy_load_GBps": total / med(loads[2]) / 1e9,
        # the target metric: ours vs the plain put/get of the same bytes
        "save_ratio": ratio(saves[1], saves[0]),
        "load_ratio": ratio(loads[1], loads[0]),
        "zero_copy_save_ratio": ratio(saves[2], saves[0]),
        "zero_copy_load_ratio": ratio(loads[2], loads[0]),
        "baseline": "raw Mooncake put_batch/get_batch (TCP, loopback master)",
    }


def _mooncake_rows(args: argparse.Namespace) -> tuple[list[dict[str, Any]], str | None]:
    """The Mooncake rows, or none and why (package or master missing)."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return [], f"mooncake package not importable ({exc})"
    from ascend_offload.store.services.mooncake_master import MooncakeMaster, master_binary

    total = args.mooncake_mib << 20
    sizes = (64 << 10, 256 << 10, 1 << 20)
    if args.mooncake_master:
        return [bench_mooncake(args.mooncake_master, o, total // o, args.repeats) for o in sizes], None
    if master_binary() is None:
        return [], "mooncake_master not found"
    with TemporaryDirectory() as tmp, MooncakeMaster(Path(tmp) / "master.log") as master:
        return [bench_mooncake(master.address, o, total // o, args.repeats) for o in sizes], None


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
    ap.add_argument("--mooncake", choices=("auto", "off", "only"), default="auto",
                    help="auto: add Mooncake rows when the package and mooncake_master are "
                         "installed; only: just those rows")
    ap.add_argument("--mooncake-master", default="",
                    help="host:port of a running mooncake_master (default: start one on 127.0.0.1)")
    ap.add_argument("--mooncake-mib", type=int, default=16, help="bytes per measured Mooncake call")
    ap.add_argument("--ssd", choices=("on", "off", "only"), default="on",
                    help="SSD tier load rows (bench/store_ssd.py); only: just those rows")
    ap.add_argument("--ssd-dir", default=None, help="file system of the SSD rows' file (default: the temp dir)")
    ap.add_argument("--eviction-blocks", type=int, default=4096,
                    help="store size (blocks) of the eviction-policy rows; 0: skip them")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    total = args.total_mib << 20
    rows: list[dict[str, Any]] = []
    if args.mooncake != "only" and args.ssd != "only":
        for obj in (64 << 10, 256 << 10, 1 << 20):  # tiny-model block .. a large-model layer group
            rows.append(bench_store(obj, total // obj, args.repeats))
        for layer_bytes, layers in ((16 << 10, 4), (16 << 10, 32), (144 << 10, 8)):
            rows.append(bench_worker(layer_bytes, layers, total // (layer_bytes * layers), args.repeats))
    mooncake_rows, mooncake_skip = (_mooncake_rows(args) if args.mooncake != "off" and args.ssd != "only"
                                    else ([], "off"))
    rows += mooncake_rows
    print(f"{'path':8} {'object':>9} {'objs':>6} {'save GB/s':>10} {'load GB/s':>10} {'copy GB/s':>10} {'save x':>7} {'load x':>7}")
    for r in rows:
        if r["path"] == "mooncake":
            continue
        print(
            f"{r['path']:8} {r['object_bytes']:>9} {r['objects']:>6} {r['save_GBps']:>10.2f} "
            f"{r['load_GBps']:>10.2f} {r['plain_copy_GBps']:>10.2f} {r['save_ratio']:>7.2f} {r['load_ratio']:>7.2f}"
        )
    if mooncake_rows:
        print("mooncake: ours vs raw put_batch/get_batch (x) and vs zero-copy batch_put_from/"
              "batch_get_into (zc x), same bytes, same rounds")
        print(f"{'object':>9} {'objs':>6} {'save':>6} {'raw':>6} {'zc':>6} {'load':>6} {'raw':>6} {'zc':>6}"
              f" {'save x':>7} {'load x':>7} {'zc sx':>6} {'zc lx':>6}   (GB/s)")
        for r in mooncake_rows:
            print(f"{r['object_bytes']:>9} {r['objects']:>6} {r['save_GBps']:>6.2f} {r['raw_save_GBps']:>6.2f} "
                  f"{r['zero_copy_save_GBps']:>6.2f} {r['load_GBps']:>6.2f} {r['raw_load_GBps']:>6.2f} "
                  f"{r['zero_copy_load_GBps']:>6.2f} {r['save_ratio']:>7.2f} {r['load_ratio']:>7.2f} "
                  f"{r['zero_copy_save_ratio']:>6.2f} {r['zero_copy_load_ratio']:>6.2f}")
    local = [r for r in rows if r["path"] != "mooncake"]
    worst = min((min(r["save_ratio"], r["load_ratio"]) for r in local), default=None)
    if worst is not None:
        print(f"worst ratio vs plain torch copy of the same bytes: {worst:.2f} (target >= {args.target})")
    result: dict[str, Any] = {"bench": "store", "threads": 1, "rows": rows, "worst_ratio": worst,
                              "target": args.target}
    if mooncake_rows:
        mc_worst = min(min(r["save_ratio"], r["load_ratio"]) for r in mooncake_rows)
        zc_worst = min(min(r["zero_copy_save_ratio"], r["zero_copy_load_ratio"]) for r in mooncake_rows)
        print(f"mooncake: worst ratio vs raw Mooncake put/get of the same bytes: {mc_worst:.2f} "
              f"(target >= {args.target}); vs zero-copy put/get: {zc_worst:.2f}")
        result["mooncake_zero_copy_worst_ratio"] = zc_worst
        result["mooncake_worst_ratio"] = mc_worst
    else:
        print(f"mooncake rows skipped: {mooncake_skip}")
        result["mooncake_skipped"] = mooncake_skip
    if args.ssd != "off":
        from ascend_offload.bench.store_ssd import print_ssd_rows, ssd_rows

        result["ssd_rows"] = ssd_rows(args.ssd_dir, args.total_mib, args.repeats)
        result["ssd_worst_direct_ratio"] = print_ssd_rows(result["ssd_rows"], args.target)
    if args.eviction_blocks and args.mooncake != "only" and args.ssd != "only":
        policy_rows = store_policy.compare(args.eviction_blocks, repeats=3)
        store_policy.print_rows(policy_rows)
        result["eviction"] = policy_rows
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0
