"""Synthetic top-k traces for ``bench sparse`` and the residency policy tests, and the
offline-optimal (Belady) hit rate they are judged against.

Every trace is ``[steps, k]`` int32 positions of one (layer, request): distinct,
no padding, in random order; the context starts at ``ctx0`` tokens and grows by
one per step, and the newest token is always selected (the current token is in
its own top-k). Deterministic for a given ``numpy.random.Generator`` state.

Kinds (why each): ``overlap`` keeps a random share of the previous top-k and
draws the rest uniformly: memoryless, so no policy can beat LRU by much and
none should lose to it (the bench's timing trace); ``uniform`` is ``overlap`` at
0: no locality at all; ``sink_window`` always selects the first tokens
(attention sinks) and a window of the most recent ones, the rest uniform;
``drift`` selects most of its top-k from a focus region that moves through the
context, the rest uniform: the rows of the focus come back often, the
background rows almost never, which exact LRU cannot tell apart; ``recur``
re-selects rows exactly once a fixed number of steps later: recency is all
that predicts reuse (the adversary of frequency-minded policies).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["TRACE_KINDS", "belady_hits", "drift_trace", "overlap_trace", "recur_trace",
           "sink_window_trace"]


def _fill_uniform(rng: np.random.Generator, member: np.ndarray, ctx: int, need: int) -> np.ndarray:
    """``need`` distinct positions in ``[0, ctx)`` not yet in ``member`` (marked as
    taken). Rejection sampling: the selection is a small share of the context."""
    fresh: list[np.ndarray] = []
    while need > 0:
        cand = np.unique(rng.integers(0, ctx, size=need * 2 + 16).astype(np.int32))
        cand = cand[~member[cand]]
        cand = rng.permutation(cand)[:need]
        member[cand] = True
        fresh.append(cand)
        need -= cand.size
    return np.concatenate(fresh) if fresh else np.empty(0, dtype=np.int32)


def overlap_trace(rng: np.random.Generator, *, steps: int, k: int, ctx0: int, overlap: float
                  ) -> np.ndarray:
    """Each step keeps a random ``overlap`` share of the previous top-k, selects the
    newest token, and draws the rest uniformly from the context outside them."""
    out = np.empty((steps, k), dtype=np.int32)
    ctx = ctx0
    cur = rng.choice(ctx, size=k, replace=False).astype(np.int32)
    member = np.zeros(ctx0 + steps + 1, dtype=bool)
    for t in range(steps):
        ctx += 1
        newest = ctx - 1
        keep = cur[rng.permutation(k)[: round(overlap * k)]]
        keep = keep[keep != newest]
        member[:] = False
        member[keep] = True
        member[newest] = True
        fresh = _fill_uniform(rng, member, ctx, k - keep.size - 1)
        cur = np.concatenate([keep, np.array([newest], dtype=np.int32), fresh])
        out[t] = rng.permutation(cur)
    return out


def drift_trace(rng: np.random.Generator, *, steps: int, k: int, ctx0: int, focus: float = 0.6,
                width: int = 4096, speed: int = 32) -> np.ndarray:
    """A ``focus`` share of each top-k is drawn uniformly from a window of ``width``
    tokens whose start moves ``speed`` tokens per step (from a random start,
    wrapping at the end of the context); then the newest token; the rest uniformly
    from the whole context. With the defaults a focus row is selected at about
    every third step while the window covers it (128 steps), a background row at
    about every 40th."""
    nf = round(focus * k)
    if not 0 <= nf < k or nf > width or width >= ctx0:
        raise ValueError(f"drift trace: focus {focus} of k={k} must leave room for the newest "
                         f"token and fit the window ({width} tokens, context {ctx0})")
    out = np.empty((steps, k), dtype=np.int32)
    start = int(rng.integers(0, ctx0))
    member = np.zeros(ctx0 + steps + 1, dtype=bool)
    for t in range(steps):
        ctx = ctx0 + t + 1
        newest = ctx - 1
        # window positions wrap over [0, newest): the newest token is selected anyway
        win = (start + speed * t + rng.choice(width, size=nf, replace=False)) % newest
        member[:] = False
        member[win] = True
        member[newest] = True
        fresh = _fill_uniform(rng, member, ctx, k - nf - 1)
        cur = np.concatenate([win.astype(np.int32), np.array([newest], dtype=np.int32), fresh])
        out[t] = rng.permutation(cur)
    return out


def sink_window_trace(rng: np.random.Generator, *, steps: int, k: int, ctx0: int, sink: int = 64,
                      window: int = 1024) -> np.ndarray:
    """The first ``sink`` tokens and the ``window`` most recent ones (the newest
    included) every step; the rest uniformly from the context between them."""
    if sink + window >= k or sink + window >= ctx0:
        raise ValueError(f"sink+window trace: sink {sink} + window {window} must be < k={k} "
                         f"and < the context {ctx0}")
    out = np.empty((steps, k), dtype=np.int32)
    member = np.zeros(ctx0 + steps + 1, dtype=bool)
    for t in range(steps):
        ctx = ctx0 + t + 1
        fixed = np.concatenate([np.arange(sink), np.arange(ctx - window, ctx)]).astype(np.int32)
        member[:] = False
        member[fixed] = True
        fresh = _fill_uniform(rng, member, ctx, k - fixed.size)
        out[t] = rng.permutation(np.concatenate([fixed, fresh]))
    return out


def recur_trace(rng: np.random.Generator, *, steps: int, k: int, ctx0: int, gap: int = 2,
                share: float = 0.5) -> np.ndarray:
    """A ``share`` of each top-k re-selects rows that were drawn uniformly ``gap``
    steps earlier, each exactly once; then the newest token; the rest uniformly
    from the context. A row's second use is its last, so keeping re-selected rows
    (ARC's T2) buys nothing, and exact LRU with ``gap`` steps of history in the hot
    buffer gets every return: the case where ARC trails LRU."""
    nr = round(share * k)
    if not 0 <= nr < k or gap < 1:
        raise ValueError(f"recur trace: share {share} of k={k} and gap {gap} (>= 1)")
    out = np.empty((steps, k), dtype=np.int32)
    member = np.zeros(ctx0 + steps + 1, dtype=bool)
    drawn: list[np.ndarray] = []
    for t in range(steps):
        ctx = ctx0 + t + 1
        newest = ctx - 1
        back = drawn[t - gap][:nr] if t >= gap else np.empty(0, dtype=np.int32)
        back = back[back != newest]
        member[:] = False
        member[back] = True
        member[newest] = True
        fresh = rng.permutation(_fill_uniform(rng, member, ctx, k - back.size - 1))
        drawn.append(fresh)
        out[t] = rng.permutation(np.concatenate([back, np.array([newest], dtype=np.int32), fresh]))
    return out


TraceFn = Callable[..., np.ndarray]

# name -> (generator, its keyword arguments besides steps / k / ctx0)
TRACE_KINDS: dict[str, tuple[TraceFn, dict]] = {
    "overlap": (overlap_trace, {"overlap": 0.6}),
    "uniform": (overlap_trace, {"overlap": 0.0}),
    "sink_window": (sink_window_trace, {}),
    "drift": (drift_trace, {}),
    "recur": (recur_trace, {}),
}


def belady_hits(trace: np.ndarray, hot: int) -> list[int]:
    """Hits per step of the optimal offline policy for batched demand (every
    position of a step must be resident; evict the farthest next use)."""
    steps = trace.shape[0]
    nxt: list[dict[int, int]] = [dict() for _ in range(steps)]
    last: dict[int, int] = {}
    for t in range(steps - 1, -1, -1):
        d = nxt[t]
        for p in trace[t].tolist():
            d[p] = last.get(p, steps + 1)
            last[p] = t
    cache: dict[int, int] = {}  # position -> next use
    hits = []
    for t in range(steps):
        req = nxt[t]
        h = sum(1 for p in req if p in cache)
        hits.append(h)
        over = len(cache) + (len(req) - h) - hot
        if over > 0:
            cand = sorted(((nu, p) for p, nu in cache.items() if p not in req), reverse=True)
            for _, p in cand[:over]:
                del cache[p]
        cache.update(req)
    return hits
