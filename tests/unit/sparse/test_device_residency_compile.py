"""One layer's device resolve + miss gather + new-row scatter compiles as one graph:
``torch.compile(fullgraph=True, dynamic=False)`` raises on any graph break, and the
compiled step equals eager over a multi-step trace, state included, and the host table.

One compile per session (about 30-40 s on two shared cores): small fixed shapes, and a
recompile is an error."""

from __future__ import annotations

import pytest
import torch

from ascend_offload.sparse.device_residency import (
    DeviceResidency,
    gather_misses,
    resolve_lru,
    scatter_new_rows,
)
from ascend_offload.sparse.residency import make_residency

B, ROWS, H, K, L, D, BLOCK = 2, 3, 16, 8, 64, 4, 4


def layer_step(pos_slot: torch.Tensor, slot_pos: torch.Tensor, stamp: torch.Tensor,
               tag: torch.Tensor, clock: torch.Tensor, report: torch.Tensor, rows: torch.Tensor,
               tags: torch.Tensor, stable: torch.Tensor, lens: torch.Tensor, real: torch.Tensor,
               block_table: torch.Tensor, topk: torch.Tensor, pool: torch.Tensor, hot: torch.Tensor,
               new_rows: torch.Tensor, new_dst: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What one layer of a decode step does on the device path."""
    scatter_new_rows(pool, new_rows, new_dst)
    slots, miss_src, miss_dst, copy_src, copy_dst, counts = resolve_lru(
        pos_slot, slot_pos, stamp, tag, clock, report, rows, tags, stable, lens, real,
        block_table, topk, BLOCK)
    gather_misses(pool, hot, copy_src, copy_dst)
    return slots, miss_src, miss_dst, counts


@pytest.fixture(scope="module")
def compiled() -> object:
    return torch.compile(layer_step, fullgraph=True, dynamic=False)


def _state(dv: DeviceResidency) -> list[torch.Tensor]:
    """Everything but the trash row and columns (their contents are unspecified)."""
    return [dv.pos_slot[:, :ROWS, :L], dv.slot_pos[:, :ROWS, :H], dv.stamp[:, :ROWS, :H],
            dv.tag[:, :ROWS], dv.clock[:, :ROWS], dv.report]


def test_compiled_layer_step_equals_eager_and_the_host_table(compiled) -> None:
    import torch._dynamo.config as dynamo_config

    g = torch.Generator().manual_seed(4)
    tables = {n: DeviceResidency(1, ROWS, H, max_positions=L, batch_sizes=[B])
              for n in ("compiled", "eager")}
    host = make_residency(1, ROWS, H)
    pools = {n: torch.randn(ROWS * L, D, generator=g) for n in tables}
    pools["eager"].copy_(pools["compiled"])
    hots = {n: torch.zeros(ROWS * H, D) for n in tables}
    host_pool, host_hot = pools["eager"].clone(), torch.zeros(ROWS * H, D)
    table = torch.randperm(ROWS * L // BLOCK, generator=g).to(torch.int32).view(ROWS, -1)
    rows, length, tags = [2, 0], [20, 9], [1, 1]
    with dynamo_config.patch(error_on_recompile=True):
        for step in range(12):
            if step == 6:  # a new request takes row 0
                tags[1], length[1] = 2, 5
            length = [n + 1 for n in length]
            stable = [length[0] - 1, length[1] - 1 - step % 2]  # a rolled-back tail every other step
            bt = table[rows]
            new = torch.randn(B, D, generator=g)
            dst = torch.tensor([int(bt[b, (n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK
                                for b, n in enumerate(length)])
            topk = torch.stack([torch.randint(-1, n, (K,), generator=g) for n in length])
            topk[:, 0] = torch.tensor(length) - 1
            topk[1, 1] = topk[1, 2]  # a duplicate
            out = {}
            for name, dv in tables.items():
                step_buf = dv.bind_step(rows, tags, stable, length, bt, BLOCK)
                fn = compiled if name == "compiled" else layer_step
                out[name] = fn(*dv.layer_state(0), *step_buf.args(), topk, pools[name],
                               hots[name], new, dst)
            for a, b in zip(out["compiled"], out["eager"], strict=True):
                assert torch.equal(a, b), step
            for a, b in zip(_state(tables["compiled"]), _state(tables["eager"]), strict=True):
                assert torch.equal(a, b), step
            assert torch.equal(pools["compiled"], pools["eager"])
            assert torch.equal(hots["compiled"], hots["eager"])
            # the host table, with the host path's row copies
            host_pool[dst] = new
            res = host.resolve(0, torch.tensor(rows), torch.tensor(tags), torch.tensor(stable),
                               torch.tensor(length), topk, bt, BLOCK)
            host_hot[res.miss_dst.long()] = host_pool[res.miss_src.long()]
            assert torch.equal(res.slots, out["compiled"][0]), step
            assert torch.equal(host_hot, hots["compiled"]), step
    for name, dv in tables.items():
        valid, misses = dv.check()
        assert valid > 0 and misses > 0, name
