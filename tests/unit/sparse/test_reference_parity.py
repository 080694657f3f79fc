"""Offloaded sparse decoding gives bit-identical logits to the full-KV run."""

from __future__ import annotations

import random

import pytest
import torch

from ascend_offload.config import SparseOffloadConfig
from ascend_offload.sparse import native
from ascend_offload.sparse.manager import SparseOffloadManager
from ascend_offload.testing.sparse_reference import (
    FullKV,
    OffloadKV,
    RefConfig,
    RefDecoder,
    RefWeights,
)

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
    mgr = SparseOffloadManager(scfg, num_layers=cfg.num_layers, row_shape=(cfg.latent,),
                               dtype=torch.float32, block_size=BLOCK, max_requests=4)
    assert mgr.residency.kind == ("native" if use_native == "on" else "torch")
    off_logits, off_out = _run(cfg, OffloadKV(mgr))
    assert len(full_logits) == len(off_logits) == STEPS
    for step, (a, b) in enumerate(zip(full_logits, off_logits, strict=True)):
        assert torch.equal(a, b), f"logits differ at step {step}"
    assert full_out == off_out
    # The run really exercised the cache: misses, hits, request churn, a freed pool.
    st = mgr.stats
    assert st.miss_rows > 0 and 0.0 < st.hit_rate < 1.0
    assert st.offload_rows == sum(len(x) for x in full_logits) * cfg.num_layers
    assert mgr.active_requests == [] and mgr.pool.free_blocks == mgr.pool.num_blocks
    # hot buffer rows per request are far fewer than the longest context
    assert mgr.hot_size * 10 < max(n for _, n, _, _ in SCHEDULE)
