"""A preempted sparse-decode request resumes from the host pool without recomputing
its history: one real vLLM CPU engine (colocated ``AscendSparseDecodeConnector``)
against the same model without the connector, float32.

Our 4-layer sparse-MLA model (index_topk 32, hot buffers of 64 rows). The offload
engine gets so little KV memory that its indexer blocks hold about two of the
requests at their full length, while ``max_num_seqs`` lets four run: as they
decode, vLLM runs out of blocks and preempts. The host pool holds every
reservation at once, so preempted requests keep their pool rows.

What must hold:

* vLLM really preempted (its per-step stats, :class:`StepRecorder`), and the
  connector saw every preemption (``sparse_preempted_requests``);
* greedy tokens are identical to the plain engine;
* resumptions loaded their history instead of recomputing it
  (``sparse_resumed_tokens`` > 0, ``sparse_recomputed_tokens`` == 0, no stash
  failure);
* nothing of the main-KV history was written again: every layer wrote exactly
  one pool row per computed position (``offload_rows`` = layers x the positions
  each request computes once: prompt + new tokens - 1).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from ascend_offload.harness.engines import StepRecorder, owned_engine, run_requests, stepped_engine
from ascend_offload.harness.tiny_sparse_model import make_tiny_sparse_model
from tests.e2e.harness import MODEL_CACHE, registry_value, sparse_decode_config

N_LAYERS = 4
TOPK = 32
HOT = 64
BLOCK = 32
ROW_BYTES = (64 + 16) * 4  # latent + rope, float32
MAX_SEQS = 4
ENGINE_ARGS: dict[str, Any] = dict(
    dtype="float32", block_size=BLOCK, enforce_eager=True, enable_prefix_caching=False, seed=0,
    max_num_batched_tokens=128, max_model_len=512, max_num_seqs=MAX_SEQS)
# Offload engine: hot buffers (4 layers x 4 requests x 64 rows x 320 B = 320 KiB) plus
# about 40 indexer blocks of 16 KiB (32 tokens x 128 B x 4 layers): under three requests
# of ~450 tokens fill them, four run at once, so decoding requests get preempted. (vLLM
# checks max_model_len against this memory before the cut, at main KV + indexer bytes.)
OFFLOAD_KV_BYTES = 1 << 20
BASELINE_KV_BYTES = 256 * 2**20
POOL_BLOCKS = 200  # every request's reservation at once: preemption never frees pool rows
POOL_GB = POOL_BLOCKS * BLOCK * N_LAYERS * ROW_BYTES / 2**30 + 1e-9

_rng = random.Random(11)
LENGTHS = [_rng.randrange(300, 460) for _ in range(10)]
MAX_TOKENS = [_rng.randrange(24, 48) for _ in LENGTHS]
PROMPTS = [[_rng.randrange(3, 512) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    from vllm import SamplingParams

    model = str(make_tiny_sparse_model(MODEL_CACHE / "tiny-sparse-mla-4l", index_topk=TOPK))
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    out: dict[str, Any] = {"tokens": {}, "preempted": {}, "peak": {}, "blocks": {}}
    # baseline first: the offload engine's Prometheus logger must be the registered one
    for name, kw in (("baseline", {"kv_cache_memory_bytes": BASELINE_KV_BYTES}),
                     ("offload", {"kv_cache_memory_bytes": OFFLOAD_KV_BYTES,
                                  "kv_transfer_config": sparse_decode_config(
                                      {"topk_buffer_size": HOT, "index_topk": TOPK,
                                       "dram_size_per_dp_GB": POOL_GB})})):
        rec = StepRecorder()
        with owned_engine(lambda rec=rec, kw=kw: stepped_engine(rec, model=model, **ENGINE_ARGS,
                                                                 **kw), in_process=True) as eng:
            out["blocks"][name] = eng.vllm_config.cache_config.num_gpu_blocks
            out["tokens"][name] = run_requests(eng, PROMPTS, params)
            out["preempted"][name] = rec.preempted()
            out["peak"][name] = rec.peak_running()
            if name == "offload":
                out["metrics"] = {n: registry_value(f"vllm:ascend_offload_sparse_{n}") for n in (
                    "preempted_requests", "resumed_tokens", "recomputed_tokens", "stash_failures",
                    "offload_rows", "admission_failures", "unmatched_rows", "resolved_positions",
                    "miss_rows", "stash_seconds", "steps")}
    return out


def test_vllm_preempted_and_the_connector_saw_every_preemption(runs: dict[str, Any]) -> None:
    pre, m = runs["preempted"], runs["metrics"]
    print(f"\npreemptions {pre}, peak running {runs['peak']}, blocks {runs['blocks']}, "
          f"metrics {m}")
    assert pre["offload"] > 0, pre
    assert runs["peak"]["offload"] >= 2, runs["peak"]
    assert m["preempted_requests"] == pre["offload"], (m, pre)
    assert m["admission_failures"] == 0 and m["unmatched_rows"] == 0, m


def test_greedy_tokens_identical_to_the_plain_engine(runs: dict[str, Any]) -> None:
    toks = runs["tokens"]
    assert [len(t) for t in toks["offload"]] == MAX_TOKENS
    assert toks["offload"] == toks["baseline"]
    assert len({tuple(t) for t in toks["baseline"]}) == len(PROMPTS)


def test_resumed_requests_loaded_their_history_instead_of_recomputing_it(
        runs: dict[str, Any]) -> None:
    m = runs["metrics"]
    assert m["stash_failures"] == 0, m
    assert m["resumed_tokens"] > 0, m
    # every preemption was resumed with its computed tokens (none was lost to recompute)
    assert m["resumed_tokens"] >= m["preempted_requests"], m
    assert m["recomputed_tokens"] == 0, m


def test_no_main_kv_history_was_written_again(runs: dict[str, Any]) -> None:
    """Every layer wrote one pool row per position each request computes (its prompt and
    all new tokens but the last): a resumption moved none of its history into the pool."""
    m = runs["metrics"]
    computed = sum(n + k - 1 for n, k in zip(LENGTHS, MAX_TOKENS, strict=True))
    assert m["offload_rows"] == N_LAYERS * computed, (m, computed)
    # and every decode token still went through the hot buffers
    assert m["resolved_positions"] >= N_LAYERS * TOPK * sum(k - 1 for k in MAX_TOKENS), m
