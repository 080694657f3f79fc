"""One layer's device resolve + miss gather + new-row scatter captured in a CUDA graph
and replayed over a multi-step trace: outputs, state, hot buffer and pool equal eager
and the host table. Skipped without CUDA; imports torch and the package's torch-only
modules (no vLLM). Run it on a CUDA machine with::

    python -m pytest -p no:xdist -m cuda tests/unit/sparse/test_device_residency_cuda.py
"""

from __future__ import annotations

import pytest
import torch

from ascend_offload import device as dev
from ascend_offload.sparse.device_residency import (
    DeviceResidency,
    gather_misses,
    resolve_lru,
    scatter_new_rows,
)
from ascend_offload.sparse.residency import make_residency

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

B, ROWS, H, K, L, D, BLOCK, STEPS = 4, 4, 64, 32, 512, 8, 16, 40


def _layer(dv: DeviceResidency, topk: torch.Tensor, pool: torch.Tensor, hot: torch.Tensor,
           new: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, ...]:
    assert dv.step is not None
    scatter_new_rows(pool, new, dst)
    slots, miss_src, miss_dst, copy_src, copy_dst, counts = resolve_lru(
        *dv.layer_state(0), *dv.step.args(), topk, BLOCK)
    gather_misses(pool, hot, copy_src, copy_dst)
    return slots, miss_src, miss_dst, counts


def test_cuda_graph_replay_equals_eager_and_the_host_table() -> None:
    cuda = torch.device("cuda")
    g = torch.Generator().manual_seed(2)
    tabs = {n: DeviceResidency(1, ROWS, H, max_positions=L, device=cuda, batch_sizes=[B])
            for n in ("graph", "eager")}
    host = make_residency(1, ROWS, H)
    init = torch.randn(ROWS * L, D, generator=g)
    pools_host = {n: init.clone().pin_memory() for n in tabs}
    pools = {n: dev.device_view_of_host(t) for n, t in pools_host.items()}
    assert all(p is not None and p.device.type == "cuda" for p in pools.values())
    hots = {n: torch.zeros(ROWS * H, D, device=cuda) for n in tabs}
    host_pool, host_hot = init.clone(), torch.zeros(ROWS * H, D)
    table = torch.randperm(ROWS * L // BLOCK, generator=g).to(torch.int32).view(ROWS, -1)
    rows, tags = [1, 3, 0, 2], [1, 1, 1, 1]
    length = [300, 120, 40, 200]

    # static inputs of the graph
    topk_s = torch.full((B, K), -1, dtype=torch.int32, device=cuda)
    new_s = torch.zeros(B, D, device=cuda)
    dst_s = torch.zeros(B, dtype=torch.int64, device=cuda)

    def bind(dv_or_host: object, stable: list[int]) -> None:
        dv_or_host.bind_step(torch.tensor(rows), torch.tensor(tags), torch.tensor(stable),  # type: ignore[attr-defined]
                             torch.tensor(length), table[rows], BLOCK)

    # warm-up (executes; on every table alike, top-k all padding) and capture (records only)
    for t in (*tabs.values(), host):
        bind(t, length)
    dst_s.copy_(torch.tensor([r * L for r in rows]))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _layer(tabs["graph"], topk_s, pools["graph"], hots["graph"], new_s, dst_s)
    torch.cuda.current_stream().wait_stream(side)
    _layer(tabs["eager"], topk_s, pools["eager"], hots["eager"], new_s, dst_s)
    host.resolve_layer(0, torch.full((B, K), -1, dtype=torch.int32))
    host_pool[[r * L for r in rows]] = 0.0
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _layer(tabs["graph"], topk_s, pools["graph"], hots["graph"], new_s, dst_s)

    for step in range(STEPS):
        length = [n + 1 for n in length]
        stable = [n - 1 - (step % 3 if b == 1 else 0) for b, n in enumerate(length)]
        if step == STEPS // 2:
            tags[2] = 2  # a new request in row 0
        bt = table[rows]
        new = torch.randn(B, D, generator=g)
        dst = torch.tensor([int(bt[b, (n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK
                            for b, n in enumerate(length)])
        topk = torch.stack([torch.randint(-1, n, (K,), generator=g) for n in length]).to(torch.int32)
        topk[:, 0] = torch.tensor(length) - 1
        for t in (*tabs.values(), host):
            bind(t, stable)
        topk_s.copy_(topk)
        new_s.copy_(new)
        dst_s.copy_(dst)
        graph.replay()
        eager = _layer(tabs["eager"], topk.to(cuda), pools["eager"], hots["eager"], new.to(cuda),
                       dst.to(cuda))
        torch.cuda.synchronize()
        for a, b in zip(captured, eager, strict=True):
            assert torch.equal(a, b), step
        assert torch.equal(hots["graph"], hots["eager"]), step
        assert torch.equal(pools_host["graph"], pools_host["eager"]), step
        host_pool[dst] = new
        res = host.resolve_layer(0, topk)
        host_hot[res.miss_dst.long()] = host_pool[res.miss_src.long()]
        assert torch.equal(res.slots, captured[0].cpu()), step
        assert torch.equal(host_hot, hots["graph"].cpu()), step
        assert torch.equal(pools_host["graph"], host_pool), step
    for name in ("pos_slot", "slot_pos", "stamp"):
        a, b = getattr(tabs["graph"], name), getattr(tabs["eager"], name)
        assert torch.equal(a[:, :ROWS, :-1], b[:, :ROWS, :-1]), name
    assert tabs["graph"].check() == tabs["eager"].check()
