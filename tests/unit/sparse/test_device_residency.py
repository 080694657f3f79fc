"""The device residency against the native table, the torch twin and the naive oracle:
position for position, slot for slot, state included; its row movement keeps every
resolved hot row equal to the pool row of its position (I4). Both of its kernels: the
tensor ops (``use_native='off'``, what an accelerator runs) and the C++ host kernel
(``'on'``), and the two against each other output for output."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from sparse_oracle import Oracle
from test_residency import BLOCK, _block_table, call_args, traces

from ascend_offload import native
from ascend_offload.bench.sparse_traces import TRACE_KINDS
from ascend_offload.config import ConfigError, SparseOffloadConfig, parse
from ascend_offload.sparse.device_residency import (
    DeviceResidency,
    scatter_new_rows,
    state_bytes_per_row,
)
from ascend_offload.sparse.residency import (
    NativeResidency,
    ResidencyError,
    TorchResidency,
    make_residency,
)

# use_native of the device table: the tensor ops, the C++ host kernel
KERNELS = pytest.mark.parametrize("use_native", ["off", "on"], ids=["ops", "native"])


def _compact(res) -> tuple[list[int], list[int]]:
    """A device result's misses as the host tables list them (batch order)."""
    src, dst = [], []
    for b, m in enumerate(res.counts[:, 1].tolist()):
        src += res.miss_src[b, :m].tolist()
        dst += res.miss_dst[b, :m].tolist()
    return src, dst


def _host_tables(layers: int, rows: int, hot: int) -> list:
    out: list = [TorchResidency(layers, rows, hot)]
    if native.available():
        out.append(NativeResidency(layers, rows, hot))
    return out


def _replay(tr: dict, device: DeviceResidency) -> None:
    hosts = _host_tables(tr["layers"], tr["rows"], tr["hot"])
    oracle = Oracle(tr["hot"])
    bt_all = _block_table(tr["rows"], tr["max_len"])
    for n, (layer, entries) in enumerate(tr["calls"]):
        if n in tr["release"]:
            for impl in (*hosts, device):
                impl.release(entries[0][0])
            oracle.release(entries[0][0])
        rows = [e[0] for e in entries]
        args = call_args(layer, entries, bt_all)
        got = device.resolve(*args)
        assert device.check() == (sum(p >= 0 for e in entries for p in e[4]),
                                  int(got.counts[:, 1].sum()))
        want_out, want_miss = [], []
        for r, tag, stable, _, topk in entries:
            o, m = oracle.resolve(layer, r, tag, stable, topk, bt_all[r].tolist(), BLOCK)
            want_out.append(o)
            want_miss += m
        assert got.slots.tolist() == want_out, f"call {n}"
        src, dst = _compact(got)
        assert list(zip(src, dst, strict=True)) == want_miss, f"call {n}"
        for host in hosts:
            res = host.resolve(*args)
            assert torch.equal(res.slots, got.slots) and torch.equal(res.counts, got.counts)
        for r in rows:
            want = oracle.view(layer, r)[:2]
            assert device.inspect(layer, r) == want, f"slots after call {n}"
            assert all(h.inspect(layer, r) == want for h in hosts)


@KERNELS
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tr=traces())
def test_device_matches_native_twin_and_oracle(use_native: str, tr: dict) -> None:
    """Duplicates, padding, tag changes (a new request in a row), stable-length rollback,
    releases: the device table equals the host tables call for call."""
    _replay(tr, DeviceResidency(tr["layers"], tr["rows"], tr["hot"], max_positions=tr["max_len"],
                                use_native=use_native))


@KERNELS
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tr=traces(max_hot=48, max_len_cap=160))
def test_device_matches_on_wide_traces_padded_to_a_fixed_batch(use_native: str, tr: dict) -> None:
    """Top-k of 8 and more, every step padded to one batch size (trash-row entries)."""
    _replay(tr, DeviceResidency(tr["layers"], tr["rows"], tr["hot"], max_positions=tr["max_len"],
                                batch_sizes=[tr["rows"] + 1], use_native=use_native))


@KERNELS
@pytest.mark.parametrize("kind", ["drift", "uniform", "sink_window"])
def test_device_matches_host_on_bench_traces(kind: str, use_native: str) -> None:
    """The bench's top-k traces (two requests, two layers, context growing per step)."""
    fn, kw = TRACE_KINDS[kind]
    K, H, ctx0, steps = 64, 128, 1500, 24
    if kind == "drift":
        kw = {**kw, "width": 256}
    elif kind == "sink_window":
        kw = {**kw, "sink": 4, "window": 16}
    rng = np.random.default_rng(3)
    tr = {(layer, r): fn(rng, steps=steps, k=K, ctx0=ctx0, **kw) for layer in range(2)
          for r in range(2)}
    cap = ctx0 + steps + BLOCK
    dv = DeviceResidency(2, 2, H, max_positions=cap, use_native=use_native)
    hosts = _host_tables(2, 2, H)
    bt = torch.arange(2 * (cap // BLOCK), dtype=torch.int32).view(2, -1)
    for t in range(steps):
        lens = torch.full((2,), ctx0 + t + 1)
        args = (torch.tensor([0, 1]), torch.ones(2, dtype=torch.int64), lens, lens, bt, BLOCK)
        dv.bind_step(*args)
        for host in hosts:
            host.bind_step(*args)
        for layer in range(2):
            topk = torch.from_numpy(np.stack([tr[(layer, 0)][t], tr[(layer, 1)][t]]))
            got = dv.resolve_layer(layer, topk)
            for host in hosts:
                res = host.resolve_layer(layer, topk)
                assert torch.equal(res.slots, got.slots), (kind, t, layer, host.kind)
                assert _compact(got) == (res.miss_src.tolist(), res.miss_dst.tolist())
        dv.check()
    for layer in range(2):
        for r in range(2):
            assert all(dv.inspect(layer, r) == h.inspect(layer, r) for h in hosts)


@KERNELS
def test_long_trace_with_rolling_speculative_tails(use_native: str) -> None:
    """Hundreds of calls, 90 % overlap, a stable length that rolls back every step."""
    g = torch.Generator().manual_seed(3)
    H, K, L = 64, 32, 600
    dv = DeviceResidency(1, 2, H, max_positions=L, use_native=use_native)
    hosts = _host_tables(1, 2, H)
    bt = torch.arange(2 * (L // BLOCK), dtype=torch.int32).view(2, -1)
    cur = torch.randperm(L, generator=g)[:K]
    for step in range(300):
        keep = cur[torch.randperm(K, generator=g)[: int(K * 0.9)]]
        cur = torch.cat([keep, torch.randint(0, L, (K - keep.numel(),), generator=g)])
        args = (0, torch.tensor([0, 1]), torch.tensor([1, 1]), torch.tensor([L, L - step % 5]),
                torch.tensor([L, L]), torch.stack([cur, cur.flip(0)]), bt, BLOCK)
        got = dv.resolve(*args)
        for host in hosts:
            res = host.resolve(*args)
            assert torch.equal(res.slots, got.slots)
            assert _compact(got) == (res.miss_src.tolist(), res.miss_dst.tolist())
    dv.check()
    assert all(dv.inspect(0, r) == h.inspect(0, r) for h in hosts for r in range(2))


@KERNELS
def test_row_movement_keeps_hot_rows_equal_to_their_pool_rows(use_native: str) -> None:
    """Resolve + gather_misses + scatter_new_rows over a growing trace: after every
    layer call each selected position's hot row holds its pool row, padding descriptors
    included (they rewrite a row with its own contents)."""
    g = torch.Generator().manual_seed(9)
    B, H, K, L, D = 3, 24, 12, 200, 5
    dv = DeviceResidency(2, 4, H, max_positions=L, batch_sizes=[4], use_native=use_native)
    pool = torch.zeros((2, 4 * L, D))
    hot = torch.full((2, 4 * H, D), float("nan"))
    perm = torch.randperm(4 * L // BLOCK, generator=g).to(torch.int32)
    bt = perm.view(4, -1)[[2, 0, 3]]
    length = 40
    for step in range(60):
        length += 1
        lens = torch.tensor([length, length - 3, length - 7])
        dv.bind_step(torch.tensor([2, 0, 3]), torch.ones(B, dtype=torch.int64), lens - 1, lens,
                     bt, BLOCK)
        new_pos = lens - 1  # one new token per request
        host_rows = (bt.long()[torch.arange(B), new_pos // BLOCK] * BLOCK + new_pos % BLOCK)
        for layer in range(2):
            scatter_new_rows(pool[layer], torch.randn(B, D, generator=g), host_rows)
            topk = torch.stack([torch.randint(-1, int(n), (K,), generator=g) for n in lens])
            topk[:, 0] = new_pos  # the current token is in its own top-k
            res = dv.resolve_layer(layer, topk)
            dv.gather_misses(pool[layer], hot[layer], res)
            rows = bt.long()[torch.arange(B)[:, None], topk.clamp(min=0) // BLOCK] * BLOCK \
                + topk.clamp(min=0) % BLOCK
            sel = topk >= 0
            assert torch.equal(hot[layer][res.slots[sel].long()], pool[layer][rows[sel]]), step
        dv.check()


@KERNELS
def test_bad_top_k_is_raised_at_check_and_changes_nothing(use_native: str) -> None:
    dv = DeviceResidency(1, 2, 8, max_positions=20, use_native=use_native)
    tw = TorchResidency(1, 2, 8)
    bt = torch.arange(10, dtype=torch.int32).view(2, 5)

    def call(impl, topk: list[list[int]]):
        n = len(topk)
        return impl.resolve(0, torch.arange(n), torch.ones(n, dtype=torch.int64),
                            torch.full((n,), 20), torch.full((n,), 20), torch.tensor(topk),
                            bt[:n], BLOCK)

    call(dv, [[3, 4], [5, -1]])
    call(tw, [[3, 4], [5, -1]])
    dv.check()
    before = [dv.inspect(0, r) for r in range(2)]
    res = call(dv, [[6, 7], [8, 20]])  # position 20 is outside [-1, len=20)
    assert res.slots.tolist() == [[-1, -1], [-1, -1]] and res.counts.sum() == 0
    with pytest.raises(ResidencyError, match=r"layer 0, batch entry 1 \(row 1\): top-k\[1\]=20 "
                                             r"outside \[-1, len=20\)"):
        dv.check()
    assert [dv.inspect(0, r) for r in range(2)] == before
    assert dv.check() == (0, 0)  # the flag was cleared
    a, b = call(dv, [[3, 9], [5, 1]]), call(tw, [[3, 9], [5, 1]])
    assert torch.equal(a.slots, b.slots) and [dv.inspect(0, r) for r in range(2)] == \
        [tw.inspect(0, r) for r in range(2)]


def test_host_side_inputs_are_refused_at_bind() -> None:
    dv = DeviceResidency(2, 2, 4, max_positions=16)
    bt = torch.zeros((1, 4), dtype=torch.int32)
    one = torch.tensor([1])
    with pytest.raises(ResidencyError, match="K=5"):
        dv.resolve(0, torch.tensor([0]), one, one, one, torch.zeros((1, 5), dtype=torch.int32),
                   bt, BLOCK)
    with pytest.raises(ResidencyError, match="repeated"):
        dv.bind_step(torch.tensor([1, 1]), one.repeat(2), one.repeat(2), one.repeat(2),
                     bt.repeat(2, 1), BLOCK)
    with pytest.raises(ResidencyError, match="len=17"):
        dv.bind_step(torch.tensor([0]), one, one, torch.tensor([17]), bt, BLOCK)
    with pytest.raises(ResidencyError, match="len=17 exceeds the 16 positions"):
        dv.bind_step(torch.tensor([0]), one, one, torch.tensor([17]), bt.repeat(1, 2), BLOCK)
    with pytest.raises(ResidencyError, match="before bind_step"):
        DeviceResidency(1, 1, 4, max_positions=4).resolve_layer(0, torch.zeros((1, 1)))
    with pytest.raises(ResidencyError, match="largest padded batch size 1"):
        DeviceResidency(1, 2, 4, max_positions=4, batch_sizes=[1]).padded_size(2)


def _kernel_trace(seed: int, *, hot: int, k: int, cap: int, block: int, steps: int = 30,
                  topk_dtype: torch.dtype = torch.int64) -> None:
    """Random steps (batch 1-3 of 4 rows padded to 4, new requests, rollback, duplicates,
    now and then a bad position) through both kernels: every output (the padding copy
    descriptors included), the report and the state outside the scratch row equal."""
    rng = np.random.default_rng(seed)
    L, R = 2, 4
    tabs = [DeviceResidency(L, R, hot, max_positions=cap, batch_sizes=[4], use_native=u)
            for u in ("off", "on")]
    assert [t.kernel for t in tabs] == ["ops", "native"]
    lens: dict[int, int] = {}
    tags: dict[int, int] = {}
    bt = torch.from_numpy(rng.permutation(R * cap // block).astype(np.int32)).view(R, -1)
    for _ in range(steps):
        rows = [int(r) for r in rng.choice(R, size=int(rng.integers(1, 4)), replace=False)]
        for r in rows:
            if r not in lens or rng.random() < 0.1:
                lens[r], tags[r] = int(rng.integers(1, cap // 2)), int(rng.integers(0, 5))
            lens[r] = min(cap, lens[r] + 1)
        n = [lens[r] for r in rows]
        stable = [max(0, x - int(rng.integers(0, 3))) for x in n]
        bad = rng.random() < 0.05
        for layer in range(L):
            topk = torch.from_numpy(np.stack([rng.integers(-1, x, size=k) for x in n])).to(topk_dtype)
            if bad:
                topk[int(rng.integers(len(rows))), int(rng.integers(k))] = n[0] + 5
            outs = []
            for t in tabs:
                t.bind_step(rows, [tags[r] for r in rows], stable, n, bt[rows], block)
                res = t.resolve_layer(layer, topk)
                outs.append([x.clone().to(torch.int64) for x in (
                    res.slots, res.miss_src, res.miss_dst, res.counts, res.copy_src, res.copy_dst)])
            for name, a, b in zip(("slots", "miss_src", "miss_dst", "counts", "copy_src",
                                   "copy_dst"), *outs, strict=True):
                assert torch.equal(a, b), (seed, layer, name)
        checks = []
        for t in tabs:
            try:
                checks.append(t.check())
            except ResidencyError as exc:
                checks.append(str(exc))
        assert checks[0] == checks[1]
        ops, nat = tabs
        assert torch.equal(ops.pos_slot[:, :R, :cap], nat.pos_slot[:, :R, :cap])
        for name in ("slot_pos", "stamp"):
            assert torch.equal(getattr(ops, name)[:, :R, :hot], getattr(nat, name)[:, :R, :hot])
        assert torch.equal(ops.tag[:, :R], nat.tag[:, :R])
        assert torch.equal(ops.clock[:, :R], nat.clock[:, :R])


@pytest.mark.skipif(not native.available(), reason="the native library does not load here")
@pytest.mark.parametrize("hot,k,cap,block", [(16, 8, 80, 4), (32, 32, 200, 4), (8, 8, 320, 16)])
def test_native_kernel_equals_the_tensor_ops_output_for_output(hot: int, k: int, cap: int,
                                                               block: int) -> None:
    for seed in range(12):
        _kernel_trace(seed, hot=hot, k=k, cap=cap, block=block,
                      topk_dtype=torch.int32 if seed % 2 else torch.int64)


def test_kernel_choice() -> None:
    """``auto`` runs the C++ kernel on a host table when the library loads; ``on`` without
    it, or on a table that is not on the host, is refused naming the key."""
    auto = DeviceResidency(1, 1, 4, max_positions=8)
    assert auto.kernel == ("native" if native.available() else "ops")
    assert DeviceResidency(1, 1, 4, max_positions=8, use_native="off").kernel == "ops"
    assert make_residency(1, 1, 4, backend="device", max_positions=8,
                          use_native="off").kernel == "ops"
    with pytest.raises(ResidencyError, match="'use_native'='maybe'"):
        DeviceResidency(1, 1, 4, max_positions=8, use_native="maybe")
    meta = torch.device("meta")
    with pytest.raises(ResidencyError, match=r"'use_native'='on'.*not the host"):
        DeviceResidency(1, 1, 4, max_positions=8, device=meta, use_native="on")
    assert DeviceResidency(1, 1, 4, max_positions=8, device=meta).kernel == "ops"


@pytest.mark.skipif(not native.available(), reason="the native library does not load here")
def test_native_gather_refuses_a_descriptor_outside_its_buffer() -> None:
    dv = DeviceResidency(1, 1, 4, max_positions=8, use_native="on")
    dv.bind_step([0], [1], [3], [3], torch.zeros((1, 2), dtype=torch.int32), BLOCK)
    res = dv.resolve_layer(0, torch.tensor([[0, 2]]))
    pool, hot = torch.arange(16.0).view(8, 2), torch.zeros(4, 2)
    dv.gather_misses(pool, hot, res)
    assert hot[res.slots[0].long()].tolist() == [[0.0, 1.0], [4.0, 5.0]]
    res.copy_src[1] = 8  # one past the pool's last row
    with pytest.raises(IndexError, match=r"descriptor 1 \(pool row 8 of 8"):
        dv.gather_misses(pool, hot, res)


def test_state_memory_is_bounded_at_deepseek_v32_geometry() -> None:
    """int16 map at 128K context + slot positions + stamps: <= 15 % of the hot buffer of
    4096 rows of 656 bytes, per (layer, request row)."""
    per_row = state_bytes_per_row(4096, 128 * 1024)
    assert per_row / (4096 * 656) <= 0.15
    assert per_row == 2 * (128 * 1024 + 1) + 12 * 4097 + 16
    dv = DeviceResidency(3, 2, 16, max_positions=100)
    assert dv.state_bytes == 3 * 3 * state_bytes_per_row(16, 100) + 3 * 8 * 8
    assert DeviceResidency(1, 1, 40000, max_positions=8).pos_slot.dtype == torch.int32


def test_constructed_like_the_host_tables() -> None:
    dv = make_residency(2, 3, 8, backend="device", max_positions=64)
    assert isinstance(dv, DeviceResidency) and dv.kind == "device"
    assert make_residency(2, 3, 8).kind in ("native", "torch")
    with pytest.raises(ResidencyError, match="'residency_backend'='gpu'"):
        make_residency(2, 3, 8, backend="gpu")
    with pytest.raises(ResidencyError, match="exact LRU only"):
        make_residency(2, 3, 8, backend="device", policy="arc", max_positions=64)
    with pytest.raises(ResidencyError, match="max_positions"):
        make_residency(2, 3, 8, backend="device")
    assert parse(SparseOffloadConfig, {"residency_backend": "device"}, where="t").residency_backend \
        == "device"
    with pytest.raises(ConfigError, match=r"'residency_backend'='device'.*'lru'"):
        parse(SparseOffloadConfig, {"residency_backend": "device", "residency_policy": "arc"},
              where="t")


def test_importable_with_torch_alone() -> None:
    """No vLLM, no pydantic at import time (a kernel bench or graph check imports it)."""
    code = ("import sys; sys.modules['pydantic'] = None; sys.modules['vllm'] = None; "
            "import ascend_offload.sparse.device_residency as d; print(d.DeviceResidency.kind)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "device", out.stderr[-2000:]
