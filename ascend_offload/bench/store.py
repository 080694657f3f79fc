"""``ascend-offload bench store``: save/load throughput of block-sized objects.

Each path against a baseline moving the same byte count, measured in the same run
(the ratio is what matters on a noisy machine); for ``store`` and ``worker`` a plain
contiguous torch copy:

* ``store``: ``LocalStore`` allocate + ``write_batch`` + commit, and pin +
  ``read_batch`` + unpin — the contract any backend serves;
* ``worker``: ``WorkerPagePool.save/load`` between a paged KV cache (random,
  scattered block ids, several layers) and host pages — the connector's path;
* ``mooncake``: ``MooncakeStore`` (the same contract calls as ``store``) against a
  loopback ``mooncake_master`` started by the bench; its baseline is not a torch
  copy but a raw Mooncake ``batch_put_from`` / ``batch_get_into`` of the same bytes
  between registered buffers, through the same client, in the same run;
* ``shared_tier``: the connector's own shared tier (``store/shared/mooncake.py``:
  ``RemotePages`` over the page planes of ``ScheduledPageStore``) publishing N blocks
  from its registered pages and fetching them into other pages, against a raw
  zero-copy ``batch_put_from`` / ``batch_get_into`` of the same bytes (same object
  count, one contiguous registered buffer per object) and against the same spans
  (one per layer row, plus the trailer) through ``batch_put_from_multi_buffers`` /
  ``batch_get_into_multi_buffers``, through the tier's own client, same rounds.

And the eviction policies' hit rates on the same traces (``bench/store_policy.py``):
ARC vs LRU through the scheduler's index, ``LocalStore(with_data=False)``.
"""

from __future__ import annotations

import argparse
import dataclasses
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
            between: Callable[[], Any] | None = None, *, rotate: bool = False) -> list[list[float]]:
    """Seconds of every ``fns[j]`` in each of ``repeats`` rounds, run back to back so all
    see the same machine load (one warm-up round first); ``between`` runs untimed.
    ``rotate``: round ``r`` starts with ``fns[r % len(fns)]`` (none always runs first)."""
    out: list[list[float]] = [[] for _ in fns]
    for r in range(repeats + 1):
        first = r % len(fns) if rotate else 0
        for j in [*range(first, len(fns)), *range(first)]:
            t0 = time.perf_counter()
            fns[j]()
            if r:
                out[j].append(time.perf_counter() - t0)
        if between is not None:
            between()
    return out


def _median_ratio(base: list[float], ours: list[float]) -> float:
    """Median over rounds of baseline seconds / our seconds (> 1: ours is faster)."""
    return statistics.median([b / o for b, o in zip(base, ours, strict=True)])


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

    ratio = _median_ratio
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


#: Page layouts of the shared-tier rows: (bytes of one layer's block on a rank, layers).
#: One published object is one block of every layer on one rank (plus a 16-byte trailer):
#: 4 x 16 KiB = 64 KiB (a small model); 32 x 16 KiB = 512 KiB (Llama-3-8B at TP8, bf16:
#: K+V x 1 KV head x 128 dims x 32-token blocks); 32 x 64 KiB = 2 MiB (the same with
#: 128-token blocks, vllm-ascend's default block size).
SHARED_TIER_LAYOUTS = ((16 << 10, 4), (16 << 10, 32), (64 << 10, 32))


def bench_shared_tier(master_address: str, layer_bytes: int, layers: int, num_objects: int,
                      repeats: int) -> dict[str, Any]:
    """The connector's shared tier on Mooncake: ``RemotePages.publish`` of ``num_objects``
    blocks from its registered page planes and ``RemotePages.fetch`` of them into other
    pages of the same planes, against two zero-copy baselines moving the same bytes (payload
    and trailer, same object count) through the tier's own client, in the same rounds
    (the order rotates every round):

    * ``zc``: ``batch_put_from`` / ``batch_get_into`` between registered buffers holding
      each object contiguously: the floor for these bytes (the target's baseline);
    * ``mb``: ``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers`` of the
      same spans the tier names (one per layer row, then the trailer) between registered
      planes of the same layout: the tier's transfer without the tier (the difference to
      ``zc`` is the cost of the scattered layout, the rest is the tier's own work: keys,
      trailers, the xxh3 of every object on publish and verification on fetch).

    A fourth entry of the publish rounds times the tier's own hash of the same pages
    alone (``xxh3``: what a publish and a fetch each add to the transfer; a fetch also
    compares the trailers). The planes are ``ScheduledPageStore``'s (the connector's layerwise pages; the
    whole-prefix ``WorkerPagePool`` allocates its planes the same way) and the client is
    built the way the connector builds it (``store/shared/mooncake.py: connect``, no
    transfer deadline set). Raises when a byte differs after the fetch (parity)."""
    import numpy as np
    from mooncake.store import ReplicateConfig

    from ascend_offload.config import MooncakeStoreConfig
    from ascend_offload.store.pages.scheduled_store import ScheduledPageStore
    from ascend_offload.store.shared import mooncake as mc
    from ascend_offload.store.shared.tier import TRAILER_BYTES, shard_key

    n = num_objects
    obj = layer_bytes * layers
    wire = obj + TRAILER_BYTES  # bytes of one published object
    total = wire * n
    seg = max(64 << 20, 8 * total)  # three sets of objects stored at once, never evicted
    cfg = MooncakeStoreConfig(master_address=master_address, global_segment_bytes=seg)
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)

    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    pages = ScheduledPageStore(dict.fromkeys(names, layer_bytes), 2 * n)  # publish [0, n), fetch into [n, 2n)
    planes = [pages.planes[name] for name in names]
    for p in planes:
        p[:n] = rand(n, layer_bytes)
        p[n:].zero_()
    raw = mc.connect(cfg, global_segment_bytes=seg)
    tier = mc.RemotePages(cfg, pages.planes, rank=0, client=raw)  # registers the planes
    zc_src, zc_dst = rand(n, wire), torch.zeros((n, wire), dtype=torch.uint8)
    mb_src = [rand(n, layer_bytes) for _ in names] + [rand(n, TRAILER_BYTES)]
    mb_dst = [torch.zeros_like(t) for t in mb_src]
    ours = [zc_src, zc_dst, *mb_src, *mb_dst]
    registered: list[torch.Tensor] = []
    rep = ReplicateConfig()
    rep.replica_num = cfg.replica_num
    round_no = [0]
    keys: dict[str, list[str]] = {}

    def spans(ts: list[torch.Tensor]) -> list[list[int]]:
        return [[t[i].data_ptr() for t in ts] for i in range(n)]

    zc_src_ptrs = [zc_src[i].data_ptr() for i in range(n)]
    zc_dst_ptrs = [zc_dst[i].data_ptr() for i in range(n)]
    mb_src_ptrs, mb_dst_ptrs = spans(mb_src), spans(mb_dst)
    mb_lens = [[layer_bytes] * layers + [TRAILER_BYTES] for _ in range(n)]
    src_pages, dst_pages = list(range(n)), list(range(n, 2 * n))

    def fresh() -> None:
        round_no[0] += 1
        for name in ("tier", "zc", "mb"):
            keys[name] = [f"st-{name}{round_no[0]}:{i}" for i in range(n)]

    def publish() -> None:
        before = tier.counts.published_blocks
        assert tier.publish(keys["tier"], src_pages), "shared-tier publish outlived its deadline"
        assert tier.counts.published_blocks - before == n, f"shared-tier publish skipped: {tier.counts}"

    def zc_put() -> None:
        codes = raw.batch_put_from(keys["zc"], zc_src_ptrs, [wire] * n, rep)
        assert all(c == 0 for c in codes), f"batch_put_from failed: {codes[:4]}"

    def mb_put() -> None:
        codes = raw.batch_put_from_multi_buffers(keys["mb"], mb_src_ptrs, mb_lens, rep)
        assert all(c == 0 for c in codes), f"batch_put_from_multi_buffers failed: {codes[:4]}"

    def fetch() -> None:
        got = tier.fetch(keys["tier"], dst_pages)
        assert got == (True, True), f"shared-tier fetch failed: {got}, {tier.counts}"

    def zc_get() -> None:
        codes = raw.batch_get_into(keys["zc"], zc_dst_ptrs, [wire] * n)
        assert all(c == wire for c in codes), f"batch_get_into failed: {codes[:4]}"

    def mb_get() -> None:
        codes = raw.batch_get_into_multi_buffers(keys["mb"], mb_dst_ptrs, mb_lens)
        assert all(c == wire for c in codes), f"batch_get_into_multi_buffers failed: {codes[:4]}"

    src_idx = np.asarray(src_pages, dtype=np.int64)

    def hash_pass() -> None:  # the tier's payload hash of every published page, nothing else
        tier._hasher.payload_hashes(src_idx)

    def drop() -> None:  # keep the segment from filling (eviction would skew timings)
        raw.batch_remove([shard_key(k, tier.rank) for k in keys["tier"]] + keys["zc"] + keys["mb"], True)
        fresh()

    fresh()
    try:
        for t in ours:
            if raw.register_buffer(t.data_ptr(), t.nbytes) != 0:
                raise RuntimeError("register_buffer failed")
            registered.append(t)
        puts = _rounds([publish, zc_put, mb_put, hash_pass], repeats, between=drop, rotate=True)
        publish()
        zc_put()
        mb_put()
        gets = _rounds([fetch, zc_get, mb_get], repeats, rotate=True)
        drop()
        parity = (all(torch.equal(p[n:], p[:n]) for p in planes) and torch.equal(zc_dst, zc_src)
                  and all(torch.equal(d, s) for d, s in zip(mb_dst, mb_src, strict=True)))
        assert parity, "shared-tier round trip changed bytes"
        counts = dataclasses.asdict(tier.counts)
    finally:
        for t in registered:
            raw.unregister_buffer(t.data_ptr())
        tier.close()  # unregisters the planes, closes the client

    def gbps(ts: list[float]) -> float:
        return total / statistics.median(ts) / 1e9

    return {
        "path": "shared_tier",
        "layer_bytes": layer_bytes,
        "layers": layers,
        "object_bytes": obj,
        "wire_bytes": wire,
        "objects": n,
        "total_bytes": total,
        "publish_GBps": gbps(puts[0]),
        "zero_copy_put_GBps": gbps(puts[1]),
        "multi_buffer_put_GBps": gbps(puts[2]),
        "fetch_GBps": gbps(gets[0]),
        "zero_copy_get_GBps": gbps(gets[1]),
        "multi_buffer_get_GBps": gbps(gets[2]),
        "xxh3_GBps": gbps(puts[3]),  # the tier's hash of the same pages alone
        # the target metric: the tier vs a zero-copy put/get of the same bytes
        "publish_ratio": _median_ratio(puts[1], puts[0]),
        "fetch_ratio": _median_ratio(gets[1], gets[0]),
        "multi_buffer_publish_ratio": _median_ratio(puts[2], puts[0]),
        "multi_buffer_fetch_ratio": _median_ratio(gets[2], gets[0]),
        # against what one core can do at best: the same spans' multi-buffer transfer plus
        # one hash pass of the bytes, one after the other (> 1: faster than that)
        "one_core_bound_publish_ratio": _median_ratio([m + h for m, h in zip(puts[2], puts[3], strict=True)],
                                                      puts[0]),
        "one_core_bound_fetch_ratio": _median_ratio([m + statistics.median(puts[3]) for m in gets[2]], gets[0]),
        "parity": parity,
        "tier_counts": counts,
        # whether the tier's calls were two transfers with the hash overlapped (needs a spare core)
        "two_part_calls": n >= 2 and total >= tier.pipeline_min_bytes,
        "baseline": "Mooncake batch_put_from/batch_get_into between registered buffers "
                    "(TCP, loopback master), the tier's own client",
    }


def _mooncake_rows(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str | None]:
    """The standalone Mooncake rows and the shared-tier rows (one loopback master for
    both), or none and why (package or master missing)."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return [], [], f"mooncake package not importable ({exc})"
    from ascend_offload.store.services.mooncake_master import MooncakeMaster, master_binary

    total = args.mooncake_mib << 20

    def run(address: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]], None]:
        standalone = [] if args.shared_tier == "only" else [
            bench_mooncake(address, o, total // o, args.repeats) for o in (64 << 10, 256 << 10, 1 << 20)]
        tier = [] if args.shared_tier == "off" else [
            bench_shared_tier(address, lb, n, max(2, total // (lb * n)), args.repeats)
            for lb, n in SHARED_TIER_LAYOUTS]
        return standalone, tier, None

    if args.mooncake_master:
        return run(args.mooncake_master)
    if master_binary() is None:
        return [], [], "mooncake_master not found"
    with TemporaryDirectory() as tmp, MooncakeMaster(Path(tmp) / "master.log") as master:
        return run(master.address)


def print_shared_tier_rows(rows: list[dict[str, Any]], target: float) -> float:
    """Print the shared-tier rows; the worst publish / fetch ratio vs the zero-copy put/get."""
    print("shared tier (the connector's RemotePages over Mooncake: publish from / fetch into its "
          "registered page planes) vs zero-copy batch_put_from/batch_get_into of the same bytes (zc) "
          "and the same spans through the multi-buffer calls (mb), same client, same rounds")
    print(f"{'object':>9} {'layers':>6} {'objs':>5} {'publish':>7} {'zc put':>7} {'mb put':>7} {'fetch':>7} "
          f"{'zc get':>7} {'mb get':>7} {'xxh3':>6} {'pub x':>6} {'fetch x':>7} {'mb px':>6} {'mb fx':>6}"
          "   (GB/s; x: ours / zero-copy)")
    for r in rows:
        print(f"{r['object_bytes']:>9} {r['layers']:>6} {r['objects']:>5} {r['publish_GBps']:>7.2f} "
              f"{r['zero_copy_put_GBps']:>7.2f} {r['multi_buffer_put_GBps']:>7.2f} {r['fetch_GBps']:>7.2f} "
              f"{r['zero_copy_get_GBps']:>7.2f} {r['multi_buffer_get_GBps']:>7.2f} {r['xxh3_GBps']:>6.2f} "
              f"{r['publish_ratio']:>6.2f} {r['fetch_ratio']:>7.2f} {r['multi_buffer_publish_ratio']:>6.2f} "
              f"{r['multi_buffer_fetch_ratio']:>6.2f}")
    worst = min(min(r["publish_ratio"], r["fetch_ratio"]) for r in rows)
    mb_worst = min(min(r["multi_buffer_publish_ratio"], r["multi_buffer_fetch_ratio"]) for r in rows)
    print(f"shared tier: worst ratio vs zero-copy put/get of the same bytes: {worst:.2f} (goal >= {target}); "
          f"vs the same spans through the multi-buffer calls: {mb_worst:.2f}; vs one core's bound "
          f"(multi-buffer transfer + one hash pass): {one_core_bound_worst(rows):.2f}; parity "
          f"{'held' if all(r['parity'] for r in rows) else 'FAILED'}")
    return worst


def one_core_bound_worst(rows: list[dict[str, Any]]) -> float:
    """The worst publish / fetch against one core's bound (the row's multi-buffer transfer
    plus one hash pass): where the hash cannot overlap the transfer, what is left to win."""
    return min(min(r["one_core_bound_publish_ratio"], r["one_core_bound_fetch_ratio"]) for r in rows)


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
    ap.add_argument("--shared-tier", choices=("on", "off", "only"), default="on",
                    help="rows of the connector's shared tier (store/shared/) against zero-copy "
                         "Mooncake put/get, on the Mooncake rows' master; only: just those rows")
    ap.add_argument("--shared-tier-target", type=float, default=0.8,
                    help="goal of the shared-tier rows (ours / zero-copy)")
    ap.add_argument("--ssd", choices=("on", "off", "only"), default="on",
                    help="SSD tier load rows (bench/store_ssd.py); only: just those rows")
    ap.add_argument("--ssd-dir", default=None, help="file system of the SSD rows' file (default: the temp dir)")
    ap.add_argument("--eviction-blocks", type=int, default=4096,
                    help="store size (blocks) of the eviction-policy rows; 0: skip them")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    total = args.total_mib << 20
    rows: list[dict[str, Any]] = []
    only_other = args.mooncake == "only" or args.ssd == "only" or args.shared_tier == "only"
    if not only_other:
        for obj in (64 << 10, 256 << 10, 1 << 20):  # tiny-model block .. a large-model layer group
            rows.append(bench_store(obj, total // obj, args.repeats))
        for layer_bytes, layers in ((16 << 10, 4), (16 << 10, 32), (144 << 10, 8)):
            rows.append(bench_worker(layer_bytes, layers, total // (layer_bytes * layers), args.repeats))
    mooncake_rows, tier_rows, mooncake_skip = (
        _mooncake_rows(args) if args.mooncake != "off" and args.ssd != "only" else ([], [], "off"))
    if rows:
        print(f"{'path':8} {'object':>9} {'objs':>6} {'save GB/s':>10} {'load GB/s':>10} {'copy GB/s':>10} {'save x':>7} {'load x':>7}")
    for r in rows:
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
    worst = min((min(r["save_ratio"], r["load_ratio"]) for r in rows), default=None)
    if worst is not None:
        print(f"worst ratio vs plain torch copy of the same bytes: {worst:.2f} (target >= {args.target})")
    rows += mooncake_rows
    result: dict[str, Any] = {"bench": "store", "threads": 1, "rows": rows, "worst_ratio": worst,
                              "target": args.target}
    if mooncake_rows:
        mc_worst = min(min(r["save_ratio"], r["load_ratio"]) for r in mooncake_rows)
        zc_worst = min(min(r["zero_copy_save_ratio"], r["zero_copy_load_ratio"]) for r in mooncake_rows)
        print(f"mooncake: worst ratio vs raw Mooncake put/get of the same bytes: {mc_worst:.2f} "
              f"(target >= {args.target}); vs zero-copy put/get: {zc_worst:.2f}")
        result["mooncake_zero_copy_worst_ratio"] = zc_worst
        result["mooncake_worst_ratio"] = mc_worst
    elif args.shared_tier != "only":
        print(f"mooncake rows skipped: {mooncake_skip}")
        result["mooncake_skipped"] = mooncake_skip
    if tier_rows:
        result["shared_tier_rows"] = tier_rows
        # the goal's metric: the worst of (publish, fetch) ratio over the sizes
        result["shared_tier_zero_copy_worst_ratio"] = print_shared_tier_rows(tier_rows, args.shared_tier_target)
        result["shared_tier_multi_buffer_worst_ratio"] = min(
            min(r["multi_buffer_publish_ratio"], r["multi_buffer_fetch_ratio"]) for r in tier_rows)
        result["shared_tier_one_core_bound_worst_ratio"] = one_core_bound_worst(tier_rows)
        result["shared_tier_parity"] = all(r["parity"] for r in tier_rows)
        result["shared_tier_target"] = args.shared_tier_target
    elif args.shared_tier != "off":
        why = mooncake_skip or "off"
        print(f"shared-tier rows skipped: {why}")
        result["shared_tier_skipped"] = why
    if args.ssd != "off" and args.shared_tier != "only":
        from ascend_offload.bench.store_ssd import print_ssd_rows, ssd_rows

        result["ssd_rows"] = ssd_rows(args.ssd_dir, args.total_mib, args.repeats)
        result["ssd_worst_direct_ratio"] = print_ssd_rows(result["ssd_rows"], args.target)
    if args.eviction_blocks and not only_other:
        policy_rows = store_policy.compare(args.eviction_blocks, repeats=3)
        store_policy.print_rows(policy_rows)
        result["eviction"] = policy_rows
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0
