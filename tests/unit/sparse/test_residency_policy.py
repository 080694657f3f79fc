"""Residency replacement policies: ARC's rules by example, what it buys over exact
LRU on the bench's trace kinds (deterministic seeded traces), Belady as the bound,
the vector paths under every SIMD cap, and the config key."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ascend_offload import native
from ascend_offload.bench.sparse_traces import (
    TRACE_KINDS,
    belady_hits,
    drift_trace,
    overlap_trace,
    recur_trace,
    sink_window_trace,
)
from ascend_offload.config import ConfigError, SparseOffloadConfig, parse
from ascend_offload.sparse.residency import (
    POLICIES,
    NativeResidency,
    PolicyState,
    TorchResidency,
    make_residency,
)

BLOCK = 4


def _tables(policy: str, layers: int = 1, rows: int = 1, hot: int = 4) -> list:
    out: list = [TorchResidency(layers, rows, hot, policy=policy)]
    if native.available():
        out.append(NativeResidency(layers, rows, hot, policy=policy))
    return out


@pytest.mark.parametrize("impl", _tables("arc"), ids=lambda t: t.kind)
def test_arc_keeps_a_reselected_row_that_lru_evicts(impl) -> None:
    """H = 4. Position 0 is selected twice, then two calls of fresh positions: ARC
    evicts the rows seen once (T1) and keeps 0 (T2); exact LRU evicts 0, its least
    recent row. A ghost miss (3, evicted from T1) raises T1's target and goes to T2."""
    lru = TorchResidency(1, 1, 4)
    bt = torch.arange(8, dtype=torch.int32).view(1, 8)

    def call(t, topk: list[int]):
        return t.resolve(0, torch.tensor([0]), torch.tensor([1]), torch.tensor([32]),
                         torch.tensor([32]), torch.tensor([topk]), bt, BLOCK)

    for topk in ([0, 1], [0, 2], [3, 4]):
        call(impl, topk)
        call(lru, topk)
    # [3, 4]: 3 takes free slot 3, 4 evicts T1's least recent (1, slot 1)
    assert impl.policy_state(0, 0) == PolicyState(3, 1, [1], [], 0)
    r = call(impl, [5, 6])  # two victims from T1 (2, 3); 0 stays in T2
    assert r.miss_dst.tolist() == [2, 3]
    assert impl.inspect(0, 0) == ([0, 4, 5, 6], [1, 2, 3, 0])  # T1 = 4, 5, 6; T2 = 0
    # B1 = 1, 2, 3 trimmed to |T1| + |B1| <= H: only 3 remains
    assert impl.policy_state(0, 0) == PolicyState(3, 1, [3], [], 0)
    assert call(lru, [5, 6]).miss_dst.tolist() == [0, 2]  # LRU evicts 0 and 2
    r = call(impl, [3, 0])  # ARC misses 3 (a ghost), LRU misses 0 (it kept 3)
    assert r.slots.tolist() == [[1, 0]] and r.miss_src.tolist() == [3] and r.miss_dst.tolist() == [1]
    assert call(lru, [3, 0]).miss_src.tolist() == [0]
    # 3 was in B1: p 0 -> 1; victim T1's least recent (4, slot 1); 0 and 3 in T2
    assert impl.policy_state(0, 0) == PolicyState(2, 2, [4], [], 1)
    assert impl.inspect(0, 0)[1] == [2, 3, 0, 1]


@pytest.mark.parametrize("impl", _tables("arc", hot=8), ids=lambda t: t.kind)
def test_arc_speculative_positions_leave_ghost_lists_and_a_new_request_starts_empty(impl) -> None:
    bt = torch.arange(16, dtype=torch.int32).view(1, 16)

    def call(tag: int, stable: int, topk: list[int]):
        return impl.resolve(0, torch.tensor([0]), torch.tensor([tag]), torch.tensor([stable]),
                            torch.tensor([40]), torch.tensor([topk]), bt, BLOCK)

    call(1, 40, [1, 2, 3, 4])
    call(1, 40, [1, 2, 3, 4, 30])  # T2 = 1..4, T1 = 30
    call(1, 40, [31, 32, 33, 34])  # 34 evicts 30 (T1) into B1
    call(1, 40, [5, 6])  # evicts 31, 32
    assert impl.policy_state(0, 0) == PolicyState(4, 4, [30, 31, 32], [], 0)
    # stable 31: 33, 34 leave T1 and 31, 32 leave B1 (their rows may be rewritten)
    call(1, 31, [5])
    assert impl.policy_state(0, 0) == PolicyState(1, 5, [30], [], 0)
    r = call(1, 40, [30])  # a ghost miss from B1: p += max(1, |B2| // |B1|) = 1, 30 -> T2
    assert r.miss_dst.tolist() == [4]  # the lowest free slot: 34's, freed by stable 31
    assert impl.policy_state(0, 0) == PolicyState(1, 6, [], [], 1)
    call(2, 40, [2])  # a new request in the row: no ghosts, p = 0
    assert impl.policy_state(0, 0) == PolicyState(1, 0, [], [], 0)


def _hit_rate(traces: list[np.ndarray], hot: int, policy: str, warm: int) -> float:
    """The policy's hit rate over the steps after ``warm``, one table row per trace."""
    n, (steps, k) = len(traces), traces[0].shape
    table = make_residency(1, n, hot, policy=policy)
    length = max(int(tr.max()) for tr in traces) + 1
    bt = torch.arange(n * (-(-length // BLOCK)), dtype=torch.int32).view(n, -1)
    lens = torch.full((n,), length, dtype=torch.int32)
    misses = 0
    for t in range(steps):
        topk = torch.from_numpy(np.stack([tr[t] for tr in traces]))
        r = table.resolve(0, torch.arange(n, dtype=torch.int32), torch.ones(n, dtype=torch.int64),
                          lens, lens, topk, bt, BLOCK)
        misses += r.num_misses if t >= warm else 0
    return 1 - misses / (n * k * (steps - warm))


K, HOT, CTX, STEPS, WARM = 256, 512, 4096, 40, 8  # the bench's shape scaled down 8x


def _traces(fn, **kw) -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    return [fn(rng, steps=STEPS, k=K, ctx0=CTX, **kw) for _ in range(4)]


def test_arc_closes_a_third_of_the_lru_belady_gap_on_a_drifting_focus() -> None:
    """The focus window (2K tokens, a 0.6 share of the top-k) moves 4 tokens a step
    over a uniform background: LRU ranks every one-off background miss above the
    focus rows, ARC does not. (At this seed: LRU 0.380, ARC 0.473, Belady 0.621.)"""
    traces = _traces(drift_trace, width=2 * K, speed=4)
    lru, arc = (_hit_rate(traces, HOT, p, WARM) for p in ("lru", "arc"))
    belady = sum(sum(belady_hits(tr, HOT)[WARM:]) for tr in traces) / (4 * K * (STEPS - WARM))
    assert belady > arc and arc - lru >= (belady - lru) / 3, (lru, arc, belady)


@pytest.mark.parametrize("kind", ["uniform", "overlap", "sink_window"])
def test_arc_is_lru_where_nothing_predicts_reuse(kind: str) -> None:
    """On these traces every resident row that is not selected by rule has the same
    chance to be selected next, so no online policy can gain on LRU in expectation
    (and ARC must not lose): equal within sampling noise (~0.001 at this size)."""
    fn, kw = TRACE_KINDS[kind]
    if kind == "sink_window":
        kw = {"sink": 8, "window": 128}
    traces = _traces(fn, **kw)
    lru, arc = (_hit_rate(traces, HOT, p, WARM) for p in ("lru", "arc"))
    assert abs(arc - lru) < 0.002, (lru, arc)


def test_arc_trails_lru_by_little_where_only_recency_predicts_reuse() -> None:
    """Rows selected again exactly 2 steps later, once: LRU's two steps of history get
    every return; ARC spends room on rows that were re-selected and will not return
    (0.537 against 0.544 here), which is why exact LRU stays the default. One step
    more of gap and ARC's ghosts win (0.250 against 0.143)."""
    lru, arc = (_hit_rate(_traces(recur_trace), HOT, p, WARM) for p in ("lru", "arc"))
    assert lru - 0.02 < arc < lru, (lru, arc)
    lru, arc = (_hit_rate(_traces(recur_trace, gap=3, share=0.3), HOT, p, WARM)
                for p in ("lru", "arc"))
    assert arc > lru + 0.05, (lru, arc)


@st.composite
def small_traces(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    hot = draw(st.integers(2, 10))
    k = draw(st.integers(1, hot))
    ctx = draw(st.integers(k, 3 * hot))
    steps = draw(st.integers(1, 14))
    rows = [draw(st.permutations(range(ctx)))[:k] for _ in range(steps)]
    return np.array(rows, dtype=np.int32), hot


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_traces())
def test_belady_bounds_every_policy(policy: str, case: tuple[np.ndarray, int]) -> None:
    """Belady (farthest next use, batched demand) is the offline optimum the bench
    measures the policies against: no policy gets more hits on any trace."""
    trace, hot = case
    table = TorchResidency(1, 1, hot, policy=policy)
    ctx = int(trace.max()) + 1
    bt = torch.arange(ctx, dtype=torch.int32).view(1, ctx)
    hits = 0
    for step in trace:
        r = table.resolve(0, torch.tensor([0]), torch.tensor([1]), torch.tensor([ctx]),
                          torch.tensor([ctx]), torch.from_numpy(step).view(1, -1), bt, 1)
        hits += step.size - r.num_misses
    assert sum(belady_hits(trace, hot)) >= hits


def test_traces_are_seeded_and_shaped_as_documented() -> None:
    for fn, kw in [(overlap_trace, {"overlap": 0.6}), (drift_trace, {"width": 512, "speed": 4}),
                   (sink_window_trace, {"sink": 8, "window": 128}), (recur_trace, {"gap": 2})]:
        a = fn(np.random.default_rng(3), steps=6, k=K, ctx0=CTX, **kw)
        b = fn(np.random.default_rng(3), steps=6, k=K, ctx0=CTX, **kw)
        assert np.array_equal(a, b) and a.shape == (6, K) and a.dtype == np.int32
        for t, row in enumerate(a):
            assert len(set(row.tolist())) == K and row.min() >= 0
            assert row.max() == CTX + t  # the newest token is always selected
    sw = sink_window_trace(np.random.default_rng(1), steps=3, k=K, ctx0=CTX, sink=8, window=128)
    for t, row in enumerate(sw):
        assert {*range(8), *range(CTX + t + 1 - 128, CTX + t + 1)} <= set(row.tolist())
    dr = drift_trace(np.random.default_rng(1), steps=2, k=K, ctx0=CTX, focus=0.5, width=512,
                     speed=4)
    # half the top-k inside one 512-token window (modulo the context)
    for row in dr:
        s = np.sort(row[row < CTX])
        assert max(np.sum((s >= x) & (s < x + 512)) for x in s) >= K // 2
    rc = recur_trace(np.random.default_rng(1), steps=5, k=K, ctx0=CTX, gap=2, share=0.5)
    for t in range(2, 5):  # half of each top-k is rows first drawn 2 steps before
        assert len(set(rc[t].tolist()) & set(rc[t - 2].tolist())) >= K // 2
    with pytest.raises(ValueError, match="sink 200 \\+ window 100"):
        sink_window_trace(np.random.default_rng(0), steps=1, k=256, ctx0=CTX, sink=200,
                          window=100)


_SIMD_SCRIPT = textwrap.dedent("""
    import hashlib, sys, torch
    from ascend_offload.sparse.residency import NativeResidency
    g = torch.Generator().manual_seed(17)
    H, K, L, B = 96, 40, 700, 3
    h = hashlib.sha256()
    for policy in ("lru", "arc"):
        t = NativeResidency(2, B, H, policy=policy)
        bt = torch.arange(B * (L // 4), dtype=torch.int32).view(B, -1)
        for step in range(300):
            topk = torch.randint(-1, L // (1 + step % 4), (B, K), generator=g)
            stable = torch.tensor([L, L - step % 7, L - 1])
            tags = torch.tensor([1 + step // 120, 1, 1 + step // 70])
            r = t.resolve(step % 2, torch.arange(B), tags, stable, torch.full((B,), L), topk,
                          bt, 4)
            h.update(repr((r.slots.tolist(), r.miss_src.tolist(), r.miss_dst.tolist())).encode())
        for layer in range(2):
            for row in range(B):
                h.update(repr((t.inspect(layer, row), t.policy_state(layer, row))).encode())
    print(h.hexdigest())
""")


@pytest.mark.skipif(not native.available(), reason="native library unavailable")
def test_vector_and_scalar_paths_agree_for_every_policy() -> None:
    """ASCEND_OFFLOAD_NATIVE_SIMD=0 (scalar), =2 (AVX2 at most) and the default path
    (AVX-512 where the CPU has it) give identical outputs and states, ARC included
    (it shares the scans and adds its own ghost pass)."""
    root = Path(__file__).resolve().parents[3]
    digests = set()
    for simd in ("0", "2", ""):
        env = {**os.environ, "ASCEND_OFFLOAD_NATIVE_SIMD": simd,
               "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
        res = subprocess.run([sys.executable, "-c", _SIMD_SCRIPT], env=env, capture_output=True,
                             text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        digests.add(res.stdout.strip())
    assert len(digests) == 1, digests


def test_config_key_selects_the_policy() -> None:
    assert SparseOffloadConfig().residency_policy == "lru"
    cfg = parse(SparseOffloadConfig, {"residency_policy": "arc"}, where="sparse_offload")
    assert make_residency(1, 1, 4, use_native="off", policy=cfg.residency_policy).policy == "arc"
    with pytest.raises(ConfigError, match=r"key 'residency_policy'='lfu'.*'lru', 'arc'"):
        parse(SparseOffloadConfig, {"residency_policy": "lfu"}, where="sparse_offload")
