"""Offloaded sparse decoding gives bit-identical logits to the full-KV run."""

from __future__ import annotations

import random

import pytest
import torch

from ascend_offload import native
from ascend_offload.config import SparseOffloadConfig
from ascend_offload.sparse.manager import SparseOffloadManager
from ascend_offload.sparse.residency import make_residency
from tests.support.sparse_reference import (
    FullKV,
    OffloadKV,
    RefConfig,
    RefDecoder,
    RefWeights,
)
from tests.unit.sparse.sparse_oracle import Oracle

# (request, prompt length, join step, leave step): up to 4 concurrent, 5 in all,
# the fifth reusing the hot-buffer row of the first one to leave.
SCHEDULE = [
    ("a", 2048, 0, 70),
    ("b", 3100, 0, 30),
    ("c", 5000, 3, 70),
    ("d", 8000, 10, 60),
    ("e", 2600, 31, 70),
]
STEPS = 70
BLOCK = 32


class _Replayed:
    """The manager's residency table, with every call replayed on the naive oracle:
    ``expected_misses`` is what an independent exact-LRU model says the schedule
    must miss (the test compares it with the rows the manager copied)."""

    def __init__(self, inner, hot_size: int) -> None:
        self.inner = inner
        self.oracle = Oracle(hot_size, "lru")
        self.expected_misses = 0
        self._step: tuple | None = None

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def bind_step(self, rows, tags, stable, lens, block_table, block_size) -> None:
        self._step = (rows.tolist(), tags.tolist(), stable.tolist(), block_table.tolist(), block_size)
        self.inner.bind_step(rows, tags, stable, lens, block_table, block_size)

    def resolve_layer(self, layer: int, topk: torch.Tensor):
        assert self._step is not None
        rows, tags, stable, table, bs = self._step
        for b, row in enumerate(rows):
            _, misses = self.oracle.resolve(layer, row, tags[b], stable[b], topk[b].tolist(),
                                            table[b], bs)
            self.expected_misses += len(misses)
        return self.inner.resolve_layer(layer, topk)

    def release(self, row: int) -> None:
        self.oracle.release(row)
        self.inner.release(row)


def _run(cfg: RefConfig, backend) -> tuple[list[torch.Tensor], dict[str, list[int]]]:
    dec = RefDecoder(cfg, RefWeights(cfg), backend)
    rng = random.Random(1)
    prompts = {r: [rng.randrange(cfg.vocab) for _ in range(n)] for r, n, _, _ in SCHEDULE}
    logits, outputs, active = [], {}, []
    for step in range(STEPS):
        for r, _, _join, leave in SCHEDULE:
            if leave == step and r in active:
                outputs[r] = dec.finish(r)
                active.remove(r)
        for r, _, join, leave in SCHEDULE:
            if join == step:
                dec.add_request(r, prompts[r], max_new_tokens=leave - join + 1)
                active.append(r)
        logits.append(dec.step(list(active)))
    for r in list(active):
        outputs[r] = dec.finish(r)
    return logits, outputs


@pytest.mark.parametrize("use_native", ["on", "off"])
@pytest.mark.parametrize("topk", [64, 256])
def test_offloaded_logits_bit_identical(topk: int, use_native: str) -> None:
    if use_native == "on" and not native.available():
        pytest.skip("native residency library unavailable (no g++)")
    cfg = RefConfig(topk=topk)
    full_logits, full_out = _run(cfg, FullKV(cfg.num_layers, cfg.latent))
    scfg = SparseOffloadConfig(enabled=True, topk_buffer_size=2 * topk, index_topk=topk,
                               dram_size_per_dp_GB=0.01, use_native=use_native)
    table = _Replayed(make_residency(cfg.num_layers, 4, 2 * topk, use_native=use_native), 2 * topk)
    mgr = SparseOffloadManager(scfg, num_layers=cfg.num_layers, row_shape=(cfg.latent,),
                               dtype=torch.float32, block_size=BLOCK, max_requests=4,
                               residency=table)
    assert mgr.residency.kind == ("native" if use_native == "on" else "torch")
    off_logits, off_out = _run(cfg, OffloadKV(mgr))
    assert len(full_logits) == len(off_logits) == STEPS
    for step, (a, b) in enumerate(zip(full_logits, off_logits, strict=True)):
        assert torch.equal(a, b), f"logits differ at step {step}"
    assert full_out == off_out
    # The run really exercised the cache: misses, hits, request churn, a freed pool.
    st = mgr.stats
    # exactly the rows an independent exact-LRU model of this schedule misses
    assert st.miss_rows == table.expected_misses and 0 < st.miss_rows < st.resolved_positions
    assert st.offload_rows == sum(len(x) for x in full_logits) * cfg.num_layers
    assert mgr.active_requests == [] and mgr.pool.free_blocks == mgr.pool.num_blocks
    # hot buffer rows per request are far fewer than the longest context
    assert mgr.hot_size * 10 < max(n for _, n, _, _ in SCHEDULE)


class _TwoRankOffloadKV:
    """TP=2 on one shared host pool: rank 0 writes, both ranks onload and attend."""

    def __init__(self, m0: SparseOffloadManager, m1: SparseOffloadManager) -> None:
        self.r0, self.r1 = OffloadKV(m0), OffloadKV(m1)

    def add(self, req_id: str, max_tokens: int) -> None:
        self.r0.add(req_id, max_tokens)
        self.r1.add(req_id, max_tokens)

    def remove(self, req_id: str) -> None:
        self.r0.remove(req_id)
        self.r1.remove(req_id)

    def write_prompt(self, layer: int, req_id: str, kv: torch.Tensor) -> None:
        self.r0.write_prompt(layer, req_id, kv)  # the shared pool: written once

    def begin_step(self, entries) -> None:
        self.r0.begin_step(entries)
        self.r1.begin_step(entries)

    def offload_new(self, layer: int, kv: torch.Tensor, positions: torch.Tensor) -> None:
        self.r0.offload_new(layer, kv, positions)
        self.r1.offload_new(layer, torch.full_like(kv, float("nan")), positions)  # must not write

    def select(self, layer: int, topk: torch.Tensor) -> torch.Tensor:
        a, b = self.r0.select(layer, topk), self.r1.select(layer, topk)
        assert torch.equal(a, b)
        return b

    def end_step(self) -> None:
        self.r1.end_step()  # the reader first: rank 0 waits for it to finish the step
        self.r0.end_step()


def test_tp2_shared_pool_bit_identical() -> None:
    import uuid

    from ascend_offload.sparse.pools import HostKVPool

    cfg = RefConfig(topk=64)
    full_logits, _ = _run(cfg, FullKV(cfg.num_layers, cfg.latent))
    scfg = SparseOffloadConfig(enabled=True, topk_buffer_size=128, index_topk=64)
    name = f"parity_{uuid.uuid4().hex[:8]}"
    rows = 32 * 1024
    p0 = HostKVPool(cfg.num_layers, rows, (cfg.latent,), torch.float32, BLOCK, shared_name=name)
    try:
        p1 = HostKVPool(cfg.num_layers, rows, (cfg.latent,), torch.float32, BLOCK,
                        shared_name=name, create=False)
        kw = dict(num_layers=cfg.num_layers, row_shape=(cfg.latent,), dtype=torch.float32,
                  block_size=BLOCK, max_requests=4)
        m0 = SparseOffloadManager(scfg, pool=p0, tp_rank=0, **kw)
        m1 = SparseOffloadManager(scfg, pool=p1, tp_rank=1, fence_timeout_s=5.0, **kw)
        tp_logits, _ = _run(cfg, _TwoRankOffloadKV(m0, m1))
    finally:
        p0.unlink()
    for step, (a, b) in enumerate(zip(full_logits, tp_logits, strict=True)):
        assert torch.equal(a, b), f"logits differ at step {step}"
    assert m1.stats.offload_rows == 0 and m0.stats.offload_rows > 0
