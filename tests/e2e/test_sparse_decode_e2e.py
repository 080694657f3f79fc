"""Sparse decode offload in one real vLLM CPU engine (colocated mode), float32.

Our 4-layer sparse-MLA model (index_topk 32) with ``AscendSparseDecodeConnector``:
hot buffers of 64 rows, contexts of 300-600 tokens (>= 4x the hot buffer) and a
few short ones, 12 prompts with different ``max_tokens`` at most 4 at a time
(``max_num_seqs``), prefill in chunks of 128 tokens mixed with decode rows. The
host pool holds only about four requests' reservations, so later requests reuse
rows (and hot-buffer rows) freed by finished ones while others continue.

Two engines: the same model without the connector (the baseline) and with it.
Greedy tokens must be identical, every decode token of every layer must have
been resolved through the hot buffers, and the run must really hit and miss.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from ascend_offload.testing.tiny_sparse_model import make_tiny_sparse_model
from tests.e2e.harness import MODEL_CACHE, make_engine

N_LAYERS = 4
TOPK = 32
HOT = 64
BLOCK = 32
ROW_BYTES = (64 + 16) * 4  # latent + rope, float32
LENGTHS = (300, 420, 512, 600, 20, 333, 470, 560, 64, 389, 600, 301)
MAX_TOKENS = (24, 8, 16, 12, 20, 9, 24, 14, 10, 18, 6, 22)
MAX_SEQS = 4
ENGINE_ARGS: dict[str, Any] = dict(max_num_batched_tokens=128, max_model_len=1024,
                                   max_num_seqs=MAX_SEQS, block_size=BLOCK,
                                   disable_log_stats=False)
# Pool rows per layer for about MAX_SEQS of the longest reservations (600 + 24 tokens ->
# 20 blocks): 102 blocks, far less than the 12 prompts reserve in total.
POOL_ROWS = 3264
POOL_GB = POOL_ROWS * N_LAYERS * ROW_BYTES / 2**30 + 1e-9


def _prompts() -> list[list[int]]:
    rng = random.Random(23)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in LENGTHS]


PROMPTS = _prompts()


def _sparse_config(**over: Any) -> dict[str, Any]:
    sparse = {"enabled": True, "topk_buffer_size": HOT, "index_topk": TOPK,
              "dram_size_per_dp_GB": POOL_GB, **over}
    return {"kv_connector": "AscendSparseDecodeConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"sparse_offload": sparse}}


def _generate(llm: Any) -> list[list[int]]:
    from vllm import SamplingParams

    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _metric(name: str) -> float:
    """A metric of this process's Prometheus registry (where the LLM's stat loggers
    export). Not ``LLM.get_metrics()``: it truncates counters to integers, and the
    time counters are fractions of a second here."""
    from prometheus_client import REGISTRY

    want = {f"vllm:ascend_offload_sparse_{name}", f"vllm:ascend_offload_sparse_{name}_total"}
    return sum(s.value for fam in REGISTRY.collect() for s in fam.samples if s.name in want)


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(make_tiny_sparse_model(MODEL_CACHE / "tiny-sparse-mla-4l", index_topk=TOPK))


@pytest.fixture(scope="module")
def runs(model_dir: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with make_engine(model=model_dir, core=0, **ENGINE_ARGS) as llm:
        out["baseline"] = _generate(llm)
    with make_engine(model=model_dir, core=0, kv_transfer_config=_sparse_config(),
                     **ENGINE_ARGS) as llm:
        out["offload"] = _generate(llm)
        out["metrics"] = {n: _metric(n) for n in (
            "steps", "resolved_positions", "hit_positions", "miss_rows", "miss_bytes",
            "offload_rows", "admission_failures", "unmatched_rows", "resolve_seconds",
            "copy_seconds", "pool_rows_used")}
    return out


def test_greedy_tokens_identical_to_the_model_without_offload(runs: dict[str, Any]) -> None:
    assert [len(t) for t in runs["offload"]] == list(MAX_TOKENS)
    assert runs["offload"] == runs["baseline"]
    # the prompts really differ in what they generate (not one degenerate answer)
    assert len({tuple(t) for t in runs["baseline"]}) == len(PROMPTS)


def test_every_decode_token_went_through_the_hot_buffers(runs: dict[str, Any]) -> None:
    m = runs["metrics"]
    assert m["admission_failures"] == 0 and m["unmatched_rows"] == 0, m
    # every decode step of every request resolves min(topk, context) positions per layer
    decode_positions = N_LAYERS * sum(min(TOPK, n) * (k - 1)
                                      for n, k in zip(LENGTHS, MAX_TOKENS, strict=True))
    assert m["resolved_positions"] >= decode_positions, m
    assert m["hit_positions"] > 0 and m["miss_rows"] > 0, m  # selection and eviction happened
    assert m["hit_positions"] + m["miss_rows"] == m["resolved_positions"], m
    assert m["miss_bytes"] == m["miss_rows"] * ROW_BYTES, m
    # every computed main-KV row of every layer went to the host pool
    computed = sum(n + k - 1 for n, k in zip(LENGTHS, MAX_TOKENS, strict=True))
    assert m["offload_rows"] == N_LAYERS * computed, m
    assert m["resolve_seconds"] > 0 and m["copy_seconds"] > 0, m
    print(f"\nsparse decode offload metrics: {m}; hit rate "
          f"{m['hit_positions'] / m['resolved_positions']:.3f}, miss rows per step "
          f"{m['miss_rows'] / m['steps']:.1f}")


def test_the_pool_must_be_reused() -> None:
    """The prompts reserve more pool blocks than the pool has, so the run above (no
    admission failure) admitted later requests into rows freed by finished ones."""
    reserved = sum(-(-(n + k) // BLOCK) for n, k in zip(LENGTHS, MAX_TOKENS, strict=True))
    assert reserved > POOL_ROWS // BLOCK >= MAX_SEQS * -(-(max(LENGTHS) + max(MAX_TOKENS)) // BLOCK)
