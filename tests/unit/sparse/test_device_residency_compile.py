"""The device table's compiled kernel (``compile_kernel='on'``, kernel ``ops_compiled``):
``torch.compile(fullgraph=True, dynamic=False)`` of its resolve raises on any graph break,
and a compiled table equals the plain tensor ops over a multi-step, two-layer trace,
outputs and state included, and the host table. The row movement between two resolves
(the previous step's miss gather, this step's new-row scatter) compiles as one graph too.
Also: where ``auto`` compiles (never on the CPU), and how bad values are refused.

One compile of the resolve per session (the table's compiled function is shared
module-wide) plus a small one of the row movement: together about 20 s on an idle
2-vCPU VM with a cold inductor cache, a few seconds with a warm one. Small fixed shapes,
and a recompile (another layer's state views included) is an error."""

from __future__ import annotations

import pytest
import torch

from ascend_offload import device as dev
from ascend_offload import native
from ascend_offload.sparse import device_residency
from ascend_offload.sparse.device_residency import (
    DeviceResidency,
    gather_misses,
    scatter_new_rows,
)
from ascend_offload.sparse.residency import ResidencyError, make_residency

B, ROWS, H, K, L, D, BLOCK, LAYERS = 2, 3, 16, 8, 64, 4, 4, 2


def move_rows(pool: torch.Tensor, hot: torch.Tensor, copy_src: torch.Tensor,
              copy_dst: torch.Tensor, new_rows: torch.Tensor, new_dst: torch.Tensor) -> None:
    """What a layer's device path runs between two resolves: the previous step's miss
    gather, then this step's new-row scatter (both before this step's resolve)."""
    gather_misses(pool, hot, copy_src, copy_dst)
    scatter_new_rows(pool, new_rows, new_dst)


@pytest.fixture(scope="module")
def compiled_moves() -> object:
    return torch.compile(move_rows, fullgraph=True, dynamic=False)


def _state(dv: DeviceResidency) -> list[torch.Tensor]:
    """Everything but the trash row and columns (their contents are unspecified)."""
    return [dv.pos_slot[:, :ROWS, :L], dv.slot_pos[:, :ROWS, :H], dv.stamp[:, :ROWS, :H],
            dv.tag[:, :ROWS], dv.clock[:, :ROWS], dv.report]


def test_compiled_table_equals_the_tensor_ops_and_the_host_table(compiled_moves) -> None:
    import torch._dynamo.config as dynamo_config

    g = torch.Generator().manual_seed(4)
    tables = {n: DeviceResidency(LAYERS, ROWS, H, max_positions=L, batch_sizes=[B],
                                 use_native="off", compile_kernel=c)
              for n, c in (("compiled", "on"), ("eager", "off"))}
    assert tables["compiled"].kernel == "ops_compiled" and tables["eager"].kernel == "ops"
    host = make_residency(LAYERS, ROWS, H)
    pool0 = torch.randn(LAYERS, ROWS * L, D, generator=g)
    pools = {n: pool0.clone() for n in tables}
    hots = {n: torch.zeros(LAYERS, ROWS * H, D) for n in tables}
    host_pool, host_hot = pool0.clone(), torch.zeros(LAYERS, ROWS * H, D)
    # before the first resolve no gather is pending: descriptors that keep every row
    keep = (torch.full((B * K,), -1, dtype=torch.int64), torch.zeros(B * K, dtype=torch.int64))
    pending = {(n, layer): keep for n in tables for layer in range(LAYERS)}
    table = torch.randperm(ROWS * L // BLOCK, generator=g).to(torch.int32).view(ROWS, -1)
    rows, length, tags = [2, 0], [20, 9], [1, 1]
    with dynamo_config.patch(error_on_recompile=True):
        for step in range(8):
            if step == 4:  # a new request takes row 0
                tags[1], length[1] = 2, 5
            length = [n + 1 for n in length]
            stable = [length[0] - 1, length[1] - 1 - step % 2]  # a rolled-back tail every other step
            bt = table[rows]
            dst = torch.tensor([int(bt[b, (n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK
                                for b, n in enumerate(length)])
            new = torch.randn(LAYERS, B, D, generator=g)
            topks = []
            for _ in range(LAYERS):
                topk = torch.stack([torch.randint(-1, n, (K,), generator=g) for n in length])
                topk[:, 0] = torch.tensor(length) - 1
                topk[1, 1] = topk[1, 2]  # a duplicate
                topks.append(topk)
            out = {}
            for name, dv in tables.items():
                dv.bind_step(rows, tags, stable, length, bt, BLOCK)
                moves = compiled_moves if name == "compiled" else move_rows
                for layer in range(LAYERS):
                    moves(pools[name][layer], hots[name][layer], *pending[name, layer],
                          new[layer], dst)
                    res = dv.resolve_layer(layer, topks[layer])
                    out[name, layer] = (res.slots, res.miss_src, res.miss_dst, res.counts,
                                        res.copy_src, res.copy_dst)
                    pending[name, layer] = (res.copy_src, res.copy_dst)
            for layer in range(LAYERS):
                for a, b in zip(out["compiled", layer], out["eager", layer], strict=True):
                    assert torch.equal(a, b), (step, layer)
            for a, b in zip(_state(tables["compiled"]), _state(tables["eager"]), strict=True):
                assert torch.equal(a, b), step
            assert torch.equal(pools["compiled"], pools["eager"])
            assert torch.equal(hots["compiled"], hots["eager"])
            # the host table, with the host path's row copies (the device hot buffers get
            # this step's misses at the next step's move: applied to a copy here)
            for layer in range(LAYERS):
                host_pool[layer, dst] = new[layer]
                res = host.resolve(layer, torch.tensor(rows), torch.tensor(tags),
                                   torch.tensor(stable), torch.tensor(length), topks[layer],
                                   bt, BLOCK)
                host_hot[layer, res.miss_dst.long()] = host_pool[layer, res.miss_src.long()]
                assert torch.equal(res.slots, out["compiled", layer][0]), (step, layer)
                hot = hots["compiled"][layer].clone()
                gather_misses(pools["compiled"][layer], hot, *pending["compiled", layer])
                assert torch.equal(host_hot[layer], hot), (step, layer)
    compiled_totals = tables["compiled"].check()
    assert compiled_totals == tables["eager"].check()
    assert compiled_totals[0] > 0 and compiled_totals[1] > 0


@pytest.fixture
def no_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any request for the compiled resolve fails the test (none may happen)."""
    def refuse() -> None:
        raise AssertionError("compiled_resolve_lru() called")

    monkeypatch.setattr(device_residency, "compiled_resolve_lru", refuse)


def test_auto_never_compiles_on_the_cpu(no_compile: None) -> None:
    assert not dev.compiles_tensor_ops("cpu") and not dev.compiles_tensor_ops("meta")
    auto = DeviceResidency(1, 2, 4, max_positions=8)
    assert auto.kernel == ("native" if native.available() else "ops")
    ops = DeviceResidency(1, 2, 4, max_positions=8, use_native="off")
    assert ops.kernel == "ops"
    res = ops.resolve(0, [0], [1], [3], [3], torch.tensor([[2, 0, -1]]),
                      torch.zeros((1, 2), dtype=torch.int32), 4)
    assert res.counts.tolist() == [[2, 2]]
    assert DeviceResidency(1, 1, 4, max_positions=8, device="meta").kernel == "ops"
    mgr_table = make_residency(1, 2, 4, backend="device", max_positions=8, use_native="off")
    assert mgr_table.kernel == "ops"  # type: ignore[union-attr]


def test_compile_choice_and_kernel_name(monkeypatch: pytest.MonkeyPatch) -> None:
    # compile is lazy: handing out the compiled function compiles nothing yet
    monkeypatch.setattr(device_residency, "compiled_resolve_lru", lambda: device_residency.resolve_lru)
    monkeypatch.setattr(device_residency, "compiles_tensor_ops", lambda where: True)
    def kernel(**kw: str) -> str:
        return DeviceResidency(1, 1, 4, max_positions=8, **kw).kernel

    assert kernel(use_native="off") == "ops_compiled"  # auto, where the platform compiles well
    assert kernel(use_native="off", compile_kernel="off") == "ops"
    monkeypatch.setattr(device_residency, "compiles_tensor_ops", lambda where: False)
    assert kernel(use_native="off") == "ops"
    assert kernel(use_native="off", compile_kernel="on") == "ops_compiled"
    if native.available():  # the C++ kernel is never compiled
        assert kernel(compile_kernel="on") == "native"
    table = make_residency(1, 1, 4, backend="device", max_positions=8, use_native="off",
                           device_compile="on")
    assert table.kernel == "ops_compiled"  # type: ignore[union-attr]


def test_compiled_tables_pad_steps_to_few_shapes() -> None:
    """One compile per batch shape, and a limit on them: a compiled table given no batch
    sizes pads a step to the next power of two (or its row count), so 1..100 requests
    run at 8 shapes; given sizes, or not compiled, it keeps them."""
    table = DeviceResidency(1, 100, 4, max_positions=8, use_native="off", compile_kernel="on")
    assert table.batch_sizes == [1, 2, 4, 8, 16, 32, 64, 100]
    assert {table.padded_size(b) for b in range(1, 101)} == set(table.batch_sizes)
    assert table.padded_size(5) == 8 and table.padded_size(65) == 100
    assert DeviceResidency(1, 3, 4, max_positions=8, use_native="off",
                           compile_kernel="on").batch_sizes == [1, 2, 3]
    assert DeviceResidency(1, 100, 4, max_positions=8, use_native="off", compile_kernel="on",
                           batch_sizes=[100]).batch_sizes == [100]
    assert DeviceResidency(1, 100, 4, max_positions=8, use_native="off",
                           compile_kernel="off").batch_sizes == []


@pytest.mark.parametrize("backend", ["host", "device"])
def test_bad_compile_values_are_refused_naming_the_key(backend: str) -> None:
    with pytest.raises(ResidencyError, match=r"key 'device_compile'='yes': accepted 'auto', "
                                              r"'on', 'off'"):
        make_residency(1, 1, 4, backend=backend, max_positions=8, device_compile="yes")
    with pytest.raises(ResidencyError, match="key 'device_compile'=True"):
        DeviceResidency(1, 1, 4, max_positions=8, compile_kernel=True)  # type: ignore[arg-type]
