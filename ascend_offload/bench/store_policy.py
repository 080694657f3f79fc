"""``bench store``'s eviction-policy rows: hit rate of each policy on the same traces.

Every trace is replayed against the scheduler's real index, ``LocalStore(with_data=False)``,
through the calls the connector makes per request: ``lookup_prefix`` of the request's
block keys; on a hit, ``pin`` + ``unpin`` of the hit prefix (the load); on a miss,
``allocate`` + ``commit`` of the missing tail (the save). One block is one page, and
the store holds ``capacity`` blocks. The traces (seeded, so every policy sees the same
one):

* ``scan_loop``: a hot set of multi-block prefixes (a quarter of the store) re-requested
  in a loop, each hot request followed by one-off scan prefixes; the scan between two
  requests of one hot prefix is larger than the store, so LRU loses the hot set;
* ``recency``: every prefix is requested twice, the second time soon after the first,
  then never again - recency is everything, LRU's best case;
* ``fits``: the hot loop alone, smaller than the store - both policies keep it.

A row reports the block hit rate over the whole trace (cold misses included), the hit
rate of the hot requests only, and microseconds per request of the index path.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

from ascend_offload.store.local import LocalStore

Trace = list[tuple[str, tuple[str, ...]]]  # (request kind, block keys in prefix order)


def _prefix(tag: str, i: int, blocks: int) -> tuple[str, ...]:
    """Block keys shaped like the connector's (model, layout fingerprint, group, hash)."""
    return tuple(f"m:5f0c2a9e41d7b3c8:g0:{tag}{i:08x}{b:08x}" for b in range(blocks))


def scan_loop_trace(capacity: int, prefix_blocks: int = 16, hot_fraction: float = 0.25,
                    scan_per_hot: int = 4, rounds: int = 20, seed: int = 0) -> Trace:
    """Hot prefixes (``hot_fraction`` of the store) in a shuffled loop; after every hot
    request ``scan_per_hot`` never-repeated scan prefixes."""
    rng = random.Random(seed)
    n_hot = max(1, int(capacity * hot_fraction) // prefix_blocks)
    hot = [_prefix("h", i, prefix_blocks) for i in range(n_hot)]
    trace: Trace = []
    scans = 0
    for _ in range(rounds):
        order = list(range(n_hot))
        rng.shuffle(order)
        for i in order:
            trace.append(("hot", hot[i]))
            for _ in range(scan_per_hot):
                trace.append(("scan", _prefix("s", scans, prefix_blocks)))
                scans += 1
    return trace


def recency_trace(capacity: int, prefix_blocks: int = 16, requests: int = 2000,
                  window: int = 16, seed: int = 0) -> Trace:
    """Every prefix twice: again within ``window`` requests (always < the store), then never."""
    if window * prefix_blocks >= capacity:
        raise ValueError("recency window must fit in the store")
    rng = random.Random(seed)
    due: dict[int, list[int]] = {}
    trace: Trace = []
    fresh = 0
    for t in range(requests):
        for i in due.pop(t, []):
            trace.append(("hot", _prefix("r", i, prefix_blocks)))
        trace.append(("scan", _prefix("r", fresh, prefix_blocks)))
        due.setdefault(t + rng.randint(1, window), []).append(fresh)
        fresh += 1
    return trace


def replay(trace: Trace, capacity: int, eviction: str) -> dict[str, Any]:
    """Run ``trace`` through a fresh index of ``capacity`` one-page blocks."""
    store = LocalStore(capacity, 1, eviction, with_data=False)
    kind_hits: dict[str, list[int]] = {}
    lookup, pin, unpin = store.lookup_prefix, store.pin, store.unpin
    allocate, commit = store.allocate, store.commit
    t0 = time.perf_counter()
    for kind, keys in trace:
        n = lookup(keys)
        if n:
            p = pin(keys[:n])
            if p is not None:
                unpin(p)
        if n < len(keys):
            tail = keys[n:]
            hs = allocate(tail, [1] * len(tail))
            if hs is not None:
                commit([h for h in hs if h is not None])
        acc = kind_hits.setdefault(kind, [0, 0])
        acc[0] += n
        acc[1] += len(keys)
    seconds = time.perf_counter() - t0
    s = store.stats()
    hot = kind_hits.get("hot", [0, 0])
    return {
        "eviction": eviction,
        "hit_rate": s.hit_objects / max(1, s.hit_objects + s.miss_objects),
        "hot_hit_rate": hot[0] / max(1, hot[1]),
        "us_per_request": seconds / max(1, len(trace)) * 1e6,
        "evicted_objects": s.evicted_objects,
        "skipped_stores": s.skipped_stores,
    }


def compare(capacity: int = 4096, repeats: int = 3,
            policies: Sequence[str] = ("lru", "arc")) -> list[dict[str, Any]]:
    """One row per trace: every policy's replay (median time of ``repeats``) and the
    ARC/LRU hit-rate ratio."""
    traces = {
        "scan_loop": scan_loop_trace(capacity),
        "recency": recency_trace(capacity),
        "fits": scan_loop_trace(capacity, hot_fraction=0.5, scan_per_hot=0),
    }
    rows = []
    for name, trace in traces.items():
        row: dict[str, Any] = {"trace": name, "capacity_blocks": capacity, "requests": len(trace),
                               "blocks": sum(len(k) for _, k in trace)}
        for policy in policies:
            runs = [replay(trace, capacity, policy) for _ in range(max(1, repeats))]
            best = dict(runs[0])  # hit counts are deterministic; only the time varies
            best["us_per_request"] = statistics.median(r["us_per_request"] for r in runs)
            row[policy] = best
        if "lru" in row and "arc" in row:
            lru_rate = row["lru"]["hit_rate"]
            row["arc_over_lru"] = row["arc"]["hit_rate"] / lru_rate if lru_rate else None
        rows.append(row)
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    print("eviction policy: block hit rate of the same trace through LocalStore(with_data=False)")
    print(f"{'trace':10} {'policy':6} {'hit rate':>9} {'hot hit':>8} {'us/req':>7} {'evicted':>8}"
          f" {'arc/lru':>8}")
    for row in rows:
        for policy in ("lru", "arc"):
            r = row.get(policy)
            if r is None:
                continue
            ratio = row.get("arc_over_lru") if policy == "arc" else None
            ratio_s = "inf" if policy == "arc" and ratio is None else (f"{ratio:.2f}" if ratio else "")
            print(f"{row['trace']:10} {policy:6} {r['hit_rate']:>9.3f} {r['hot_hit_rate']:>8.3f} "
                  f"{r['us_per_request']:>7.1f} {r['evicted_objects']:>8} {ratio_s:>8}")


def main() -> None:
    """``python -m ascend_offload.bench.store_policy``: the rows alone (a second or two)."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--capacity", type=int, default=4096, help="store size in blocks")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--policies", default="lru,arc")
    args = ap.parse_args()
    print_rows(compare(args.capacity, args.repeats, tuple(args.policies.split(","))))


if __name__ == "__main__":
    main()
