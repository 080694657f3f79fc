"""Native residency, its torch twin and a naive oracle agree on random traces, for
every replacement policy."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sparse_oracle import Oracle

from ascend_offload import native
from ascend_offload.sparse.residency import (
    POLICIES,
    NativeResidency,
    PolicyState,
    ResidencyError,
    TorchResidency,
    make_residency,
)

needs_native = pytest.mark.skipif(not native.available(), reason="native library unavailable")

BLOCK = 4


@st.composite
def traces(draw: st.DrawFn, max_hot: int = 12, max_len_cap: int = 40) -> dict:
    layers = draw(st.integers(1, 2))
    rows = draw(st.integers(1, 3))
    hot = draw(st.integers(1, max_hot))
    k = draw(st.integers(1, hot))
    max_len = draw(st.integers(1, max_len_cap))
    calls = []
    state = {r: {"tag": 1, "len": draw(st.integers(1, max_len))} for r in range(rows)}
    for _ in range(draw(st.integers(1, 25))):
        batch = draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=rows, unique=True))
        entries = []
        for r in batch:
            s = state[r]
            if draw(st.integers(0, 9)) == 0:  # the row gets a new request
                s["tag"] += 1
            s["len"] = draw(st.integers(1, max_len))
            stable = draw(st.integers(0, s["len"]))
            topk = draw(st.lists(st.integers(-1, s["len"] - 1), min_size=k, max_size=k))
            entries.append((r, s["tag"], stable, s["len"], topk))
        calls.append((draw(st.integers(0, layers - 1)), entries))
    release = draw(st.lists(st.integers(0, len(calls)), max_size=3))
    return {"layers": layers, "rows": rows, "hot": hot, "k": k, "max_len": max_len,
            "calls": calls, "release": release}


def _block_table(rows: int, max_len: int) -> torch.Tensor:
    nblk = -(-max_len // BLOCK)
    # distinct, shuffled blocks per row so source rows are not just positions
    perm = torch.randperm(rows * nblk, generator=torch.Generator().manual_seed(7))
    return perm.view(rows, nblk).to(torch.int32)


def call_args(layer: int, entries: list, bt_all: torch.Tensor) -> tuple:
    """One trace call's ``resolve`` arguments: (row, tag, stable, length, top-k) per entry."""
    rows = [e[0] for e in entries]
    return (layer, torch.tensor(rows), torch.tensor([e[1] for e in entries]),
            torch.tensor([e[2] for e in entries]), torch.tensor([e[3] for e in entries]),
            torch.tensor([e[4] for e in entries]), bt_all[rows], BLOCK)


def _replay(impls: list, oracle: Oracle, tr: dict) -> None:
    bt_all = _block_table(tr["rows"], tr["max_len"])
    for n, (layer, entries) in enumerate(tr["calls"]):
        if n in tr["release"]:
            for impl in impls:
                impl.release(entries[0][0])
            oracle.release(entries[0][0])
        rows = [e[0] for e in entries]
        args = call_args(layer, entries, bt_all)
        results = [impl.resolve(*args) for impl in impls]
        want_out, want_miss = [], []
        for r, tag, stable, _, topk in entries:
            o, m = oracle.resolve(layer, r, tag, stable, topk, bt_all[r].tolist(), BLOCK)
            want_out.append(o)
            want_miss += m
        for res in results:
            assert res.slots.tolist() == want_out, f"call {n}"
            assert list(zip(res.miss_src.tolist(), res.miss_dst.tolist(), strict=True)) == want_miss
            assert res.counts[:, 1].sum().item() == len(want_miss)
            assert res.counts[:, 0].tolist() == [sum(p >= 0 for p in e[4]) for e in entries]
            assert res.num_valid == sum(res.counts[:, 0].tolist())
        for r in rows:
            pos, order, b1, b2, n1, p = oracle.view(layer, r)
            want_state = PolicyState(n1, len(order) - n1, b1, b2, p)
            for impl in impls:
                assert impl.inspect(layer, r) == (pos, order), f"{impl.kind}: slots after call {n}"
                assert impl.policy_state(layer, r) == want_state, f"{impl.kind}: call {n}"


def _pair(tr: dict, policy: str) -> list:
    return [NativeResidency(tr["layers"], tr["rows"], tr["hot"], policy=policy),
            TorchResidency(tr["layers"], tr["rows"], tr["hot"], policy=policy)]


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces())
def test_twin_matches_oracle(policy: str, tr: dict) -> None:
    impls = [TorchResidency(tr["layers"], tr["rows"], tr["hot"], policy=policy)]
    _replay(impls, Oracle(tr["hot"], policy), tr)


@needs_native
@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces())
def test_native_matches_twin_and_oracle(policy: str, tr: dict) -> None:
    _replay(_pair(tr, policy), Oracle(tr["hot"], policy), tr)


@needs_native
@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(max_hot=48, max_len_cap=160))
def test_native_matches_twin_and_oracle_wide(policy: str, tr: dict) -> None:
    """Top-k of 8 and more: exercises the 8-lane (AVX2) lookup and eviction paths,
    including groups that hold padding, duplicates and speculative entries."""
    _replay(_pair(tr, policy), Oracle(tr["hot"], policy), tr)


@needs_native
@pytest.mark.parametrize("policy", POLICIES)
def test_native_matches_twin_on_long_trace(policy: str) -> None:
    """Hundreds of calls on two rows with 90 % overlap and rolling speculative tails."""
    g = torch.Generator().manual_seed(3)
    H, K, L = 64, 32, 600
    nat, tw = NativeResidency(1, 2, H, policy=policy), TorchResidency(1, 2, H, policy=policy)
    bt = torch.arange(2 * (L // BLOCK), dtype=torch.int32).view(2, -1)
    cur = torch.randperm(L, generator=g)[:K]
    for step in range(500):
        keep = cur[torch.randperm(K, generator=g)[: int(K * 0.9)]]
        fresh = torch.randint(0, L, (K - keep.numel(),), generator=g)
        cur = torch.cat([keep, fresh])
        topk = torch.stack([cur, cur.flip(0)])
        stable = torch.tensor([L, L - (step % 5)])
        args = (0, torch.tensor([0, 1]), torch.tensor([1, 1]), stable, torch.tensor([L, L]),
                topk, bt, BLOCK)
        a, b = nat.resolve(*args), tw.resolve(*args)
        assert torch.equal(a.slots, b.slots) and torch.equal(a.miss_src, b.miss_src)
        assert torch.equal(a.miss_dst, b.miss_dst)
    assert nat.inspect(0, 0) == tw.inspect(0, 0) and nat.inspect(0, 1) == tw.inspect(0, 1)
    assert nat.policy_state(0, 1) == tw.policy_state(0, 1)


@needs_native
@pytest.mark.parametrize("policy", POLICIES)
def test_bound_step_layers_match_per_call_resolve(policy: str) -> None:
    """bind_step once per step + resolve_layer per layer (what the manager does) gives
    what a full resolve per layer gives, over steps whose batch and lengths change."""
    g = torch.Generator().manual_seed(5)
    H, K, L, layers = 32, 16, 240, 3
    bound = NativeResidency(layers, 3, H, policy=policy)
    per_call = TorchResidency(layers, 3, H, policy=policy)
    for step in range(40):
        B = 1 + step % 3
        rows = torch.randperm(3, generator=g)[:B].to(torch.int32)
        lens = torch.randint(K, L, (B,), generator=g).to(torch.int32)
        stable = lens - torch.randint(0, 3, (B,), generator=g).to(torch.int32)
        tags = torch.ones(B, dtype=torch.int64)
        bt = torch.arange(B * (L // BLOCK), dtype=torch.int32).view(B, -1)
        bound.bind_step(rows, tags, stable, lens, bt, BLOCK)
        for layer in range(layers):
            topk = torch.stack([torch.randint(-1, int(n), (K,), generator=g) for n in lens])
            a = bound.resolve_layer(layer, topk)
            b = per_call.resolve(layer, rows, tags, stable, lens, topk, bt, BLOCK)
            assert torch.equal(a.slots, b.slots) and torch.equal(a.counts, b.counts)
            assert torch.equal(a.miss_src, b.miss_src) and torch.equal(a.miss_dst, b.miss_dst)
            assert a.num_valid == b.num_valid


@needs_native
@pytest.mark.parametrize("policy", POLICIES)
def test_fast_call_and_ctypes_paths_agree(policy: str) -> None:
    """resolve_layer through the CPython trampoline (when it builds) and through ctypes
    give identical results and states; batches > 1 take the GIL-releasing variant."""
    fast = NativeResidency(2, 3, 32, policy=policy)
    slow = NativeResidency(2, 3, 32, policy=policy)
    slow._call3 = None
    if fast._call3 is None:
        pytest.skip("fast-call module unavailable (no Python headers)")
    g = torch.Generator().manual_seed(11)
    for step in range(30):
        B = 1 + step % 3
        rows = torch.randperm(3, generator=g)[:B].to(torch.int32)
        lens = torch.randint(24, 200, (B,), generator=g).to(torch.int32)
        tags = torch.ones(B, dtype=torch.int64)
        bt = torch.arange(B * 50, dtype=torch.int32).view(B, -1)
        for r in (fast, slow):
            r.bind_step(rows, tags, lens, lens, bt, BLOCK)
        for layer in range(2):
            topk = torch.stack([torch.randint(-1, int(n), (24,), generator=g) for n in lens])
            a, b = fast.resolve_layer(layer, topk), slow.resolve_layer(layer, topk)
            assert torch.equal(a.slots, b.slots) and torch.equal(a.counts, b.counts)
            assert a.num_misses == b.num_misses
            assert torch.equal(a.miss_src[: a.num_misses], b.miss_src[: b.num_misses])
    assert all(fast.inspect(lay, r) == slow.inspect(lay, r) for lay in range(2) for r in range(3))


def test_fast_call_rejects_bad_arguments() -> None:
    call3 = native.fastcall()
    if call3 is None:
        pytest.skip("fast-call module unavailable (no Python headers)")
    with pytest.raises(TypeError, match="3 arguments given"):
        call3(1, 2, 3)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="fn is NULL"):
        call3(0, 0, 0, 0, False)
    with pytest.raises(TypeError):
        call3("x", 0, 0, 0, False)  # type: ignore[arg-type]


@pytest.mark.parametrize("impl", ["native", "torch"])
def test_resolve_layer_needs_a_matching_bound_step(impl: str) -> None:
    if impl == "native" and not native.available():
        pytest.skip("native library unavailable")
    r = NativeResidency(1, 4, 8) if impl == "native" else TorchResidency(1, 4, 8)
    with pytest.raises(ResidencyError, match="before bind_step"):
        r.resolve_layer(0, torch.zeros((1, 4), dtype=torch.int32))
    bt = torch.arange(8, dtype=torch.int32).view(2, 4)
    r.bind_step(torch.tensor([0, 1]), torch.tensor([1, 1]), torch.tensor([10, 10]),
                torch.tensor([10, 10]), bt, BLOCK)
    if impl == "native":
        with pytest.raises(ResidencyError, match="3 requests, the bound step has 2"):
            r.resolve_layer(0, torch.zeros((3, 4), dtype=torch.int32))


def _impls(layers: int, rows: int, hot: int) -> list:
    out: list = [TorchResidency(layers, rows, hot)]
    if native.available():
        out.append(NativeResidency(layers, rows, hot))
    return out


@pytest.mark.parametrize("impl", _impls(1, 2, 8), ids=lambda i: i.kind)
def test_semantics_by_example(impl) -> None:
    bt = torch.arange(2 * 8, dtype=torch.int32).view(2, 8)  # identity-ish blocks of 4

    def call(row: int, tag: int, stable: int, length: int, topk: list[int]):
        return impl.resolve(0, torch.tensor([row]), torch.tensor([tag]), torch.tensor([stable]),
                            torch.tensor([length]), torch.tensor([topk]), bt[[row]], BLOCK)

    r = call(1, 5, 20, 20, [3, -1, 7, 3])
    assert r.slots.tolist() == [[8, -1, 9, 8]]  # row 1 owns slots 8..15; duplicate shares
    assert r.miss_src.tolist() == [8 * 4 + 3, 8 * 4 + 7] and r.miss_dst.tolist() == [8, 9]
    assert call(1, 5, 20, 20, [7, 3]).num_misses == 0
    # stable length 5 drops the resident position 7 (>= 5) but keeps 3
    r = call(1, 5, 5, 20, [3, 7])
    assert r.num_misses == 1 and r.miss_src.tolist() == [8 * 4 + 7]
    # a new request in the row starts from scratch
    assert call(1, 6, 20, 20, [3]).num_misses == 1
    # rejected input names the offender and changes nothing
    with pytest.raises(ResidencyError, match=r"top-k\[1\]=20"):
        call(1, 6, 20, 20, [3, 20])
    with pytest.raises(ResidencyError, match="stable=21"):
        call(1, 6, 21, 20, [3])
    assert call(1, 6, 20, 20, [3]).num_misses == 0


def test_lru_eviction_order() -> None:
    for impl in _impls(1, 1, 4):
        bt = torch.arange(8, dtype=torch.int32).view(1, 8)

        def call(topk: list[int], impl=impl, bt=bt):
            return impl.resolve(0, torch.tensor([0]), torch.tensor([1]), torch.tensor([32]),
                                torch.tensor([32]), torch.tensor([topk]), bt, BLOCK)

        call([0, 1])
        call([2, 3])
        call([1, -1])  # 1 is now the most recent; LRU order: 0, 2, 3, 1
        r = call([10, 11])  # evicts 0 then 2
        assert impl.inspect(0, 0)[0] == [10, 1, 11, 3], impl.kind
        assert r.miss_dst.tolist() == [0, 2]


def test_bad_arguments() -> None:
    for impl in _impls(2, 2, 4):
        bt = torch.zeros((1, 4), dtype=torch.int32)
        with pytest.raises(ResidencyError, match="K=5"):
            impl.resolve(0, torch.tensor([0]), torch.tensor([1]), torch.tensor([1]),
                         torch.tensor([1]), torch.zeros((1, 5), dtype=torch.int32), bt, BLOCK)
        with pytest.raises(ResidencyError, match="repeated"):
            impl.resolve(0, torch.tensor([1, 1]), torch.tensor([1, 1]), torch.tensor([1, 1]),
                         torch.tensor([1, 1]), torch.zeros((2, 2), dtype=torch.int32),
                         bt.repeat(2, 1), BLOCK)
        with pytest.raises(ResidencyError, match="len=17"):
            impl.resolve(0, torch.tensor([0]), torch.tensor([1]), torch.tensor([1]),
                         torch.tensor([17]), torch.zeros((1, 2), dtype=torch.int32), bt, BLOCK)
    with pytest.raises(ResidencyError, match="topk_buffer_size=70000"):
        TorchResidency(1, 1, 70000)
    with pytest.raises(ResidencyError, match="use_native"):
        make_residency(1, 1, 4, use_native="maybe")
    with pytest.raises(ResidencyError, match="'residency_policy'='lfu': accepted lru, arc"):
        make_residency(1, 1, 4, policy="lfu")
    assert make_residency(1, 1, 4, use_native="off").kind == "torch"
    assert make_residency(1, 1, 4, use_native="off", policy="arc").policy == "arc"


@needs_native
@pytest.mark.parametrize("policy", POLICIES)
def test_native_parallel_rows_match_single_thread(policy: str) -> None:
    """The OpenMP path (several threads over the requests of a batch) gives the same results."""
    g = torch.Generator().manual_seed(11)
    B, H, K, L = 6, 32, 16, 200
    one = NativeResidency(2, B, H, nthreads=1, policy=policy)
    par = NativeResidency(2, B, H, nthreads=3, policy=policy)
    bt = torch.arange(B * (L // BLOCK), dtype=torch.int32).view(B, -1)
    for step in range(120):
        layer = step % 2
        topk = torch.randint(-1, L, (B, K), generator=g)
        stable = torch.randint(L - 3, L + 1, (B,), generator=g)
        args = (layer, torch.arange(B), torch.ones(B, dtype=torch.int64), stable,
                torch.full((B,), L), topk, bt, BLOCK)
        a, b = one.resolve(*args), par.resolve(*args)
        assert torch.equal(a.slots, b.slots) and torch.equal(a.counts, b.counts)
        assert torch.equal(a.miss_src, b.miss_src) and torch.equal(a.miss_dst, b.miss_dst)


@needs_native
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("L", [64, 4096])  # bitmap cleared by memset / per top-k position
def test_membership_bits_never_leak_into_the_next_call(L: int, policy: str) -> None:
    """The per-thread top-k membership bitmap is shared by every table and row a
    thread resolves. A position marked by one call must not look resident-and-hit
    to a later call on another table (the bits are cleared before a call returns,
    on the error path too)."""
    lib = native.load()
    H = 32
    bt = torch.arange(L // BLOCK, dtype=torch.int32).view(1, -1)

    def call(impl, topk: list[int]):
        return impl.resolve(0, torch.tensor([0]), torch.tensor([1]), torch.tensor([L]),
                            torch.tensor([L]), torch.tensor([topk]), bt, BLOCK)

    nat, tw = NativeResidency(1, 1, H, policy=policy), TorchResidency(1, 1, H, policy=policy)

    def both(topk: list[int]) -> None:
        a, b = call(nat, topk), call(tw, topk)
        assert a.slots.tolist() == b.slots.tolist(), topk
        assert a.miss_src.tolist() == b.miss_src.tolist(), topk
        assert lib.ao_res_debug_dirty_words() == 0

    both([0, 1, 2, 3])  # 0..3 resident in `nat`
    call(NativeResidency(1, 1, H, policy=policy), [3, 2, 1, 0, 40, 41])  # marks 0..3 elsewhere
    assert lib.ao_res_debug_dirty_words() == 0
    both([4, 5, 6, 7])  # a leaked bit would make 0..3 look hit and change the LRU order
    with pytest.raises(ResidencyError):
        call(nat, [8, L])  # position L is out of range: refused before any bit is set
    assert lib.ao_res_debug_dirty_words() == 0
    both([12, 13, 2, 20, 13])
    assert nat.inspect(0, 0) == tw.inspect(0, 0)
    assert nat.policy_state(0, 0) == tw.policy_state(0, 0)


@needs_native
def test_native_position_capacity_is_explicit() -> None:
    """An entry packs position and slot into 32 bits: at H = 65534 (16 slot bits) a
    request may reach 65536 positions. One more is refused naming the limit, and
    the refused call changes nothing (the next valid call behaves like the twin)."""
    H, block = 65534, 1024
    nat, tw = NativeResidency(1, 1, H), TorchResidency(1, 1, H)
    assert nat.max_positions == 1 << 16 and NativeResidency(1, 1, 4096).max_positions == 1 << 20
    assert tw.max_positions > 1 << 40
    bt = torch.arange(65, dtype=torch.int32).view(1, -1)

    def call(impl, length: int, topk: list[int]):
        return impl.resolve(0, torch.tensor([0]), torch.tensor([1]), torch.tensor([length]),
                            torch.tensor([length]), torch.tensor([topk]), bt, block)

    with pytest.raises(ResidencyError, match=r"len=65537 exceeds the 65536 positions.*"
                                             r"topk_buffer_size=65534"):
        call(nat, 65537, [65536, 3])
    a, b = call(nat, 65536, [65535, 3, 65535]), call(tw, 65536, [65535, 3, 65535])
    assert a.slots.tolist() == b.slots.tolist() and a.miss_src.tolist() == b.miss_src.tolist()
