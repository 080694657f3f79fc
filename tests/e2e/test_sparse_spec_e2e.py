"""Speculative decoding (vLLM's n-gram proposer) with sparse decode offload: real vLLM
CPU engines (colocated ``AscendSparseDecodeConnector``), float32.

Our 4-layer sparse-MLA model (index_topk 32) with small weights (initializer range
0.02: its greedy text repeats itself often enough that n-gram drafts are sometimes
accepted, sometimes rejected). Three engines, the same prompts, greedy:

* ``plain``: no speculation, no connector (the reference tokens);
* ``spec``: n-gram speculation (3 draft tokens), no connector;
* ``offload``: the same speculation with sparse decode offload, hot buffers of
  4 x 32 = 128 rows (a verification row of 1 + 3 query tokens resolves the union of
  its top-k sets at once), so little KV memory that vLLM preempts decoding requests.

32 prompts, 16 of them 512-700 tokens (>= 4x the hot buffer), at most 4 running. What
must hold: tokens identical on all three; acceptance strictly between 0 and 1 and the
same with and without offload; every verification row attended over the hot buffers
(``verify_rows`` = vLLM's draft count; the pool served only prompt tokens); at least
one preemption, resumed from the stash without recomputation; rolled-back drafts were
rewritten but not counted as recomputed. The draft and acceptance counts can be compared
exactly because the schedules are fixed by the inputs: every request is added before the
first long prompt's chunks have used up the first steps' token budget, and the offload
engine preempted at the same points in every run (2 preemptions; the counts equal the
speculating engine's in all five runs so far). (In P/D, where requests arrive as their
pulls land, the counts differ from run to run: tests/e2e/test_sparse_preemption_pd_e2e.py.)

The speculating engines run in their own processes: vLLM's n-gram proposer loads numba
(llvmlite), after which vLLM 0.32's CPU kernel-override scan fails in any engine
started later in the same process (``'_lib_fn_wrapper' object has no attribute 'get'``).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from ascend_offload.harness.engines import (
    StepRecorder,
    ngram_speculative_config,
    owned_engine,
    run_requests,
    stepped_engine,
)
from tests.e2e.harness import ngram_sparse_model, registry_value, sparse_decode_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

N_LAYERS = 4
TOPK = 32
DRAFTS = 3
HOT = (1 + DRAFTS) * TOPK
BLOCK = 32
ROW_BYTES = (64 + 16) * 4  # latent + rope, float32
MAX_SEQS = 4
SPEC = ngram_speculative_config(DRAFTS)
ENGINE_ARGS: dict[str, Any] = dict(
    dtype="float32", block_size=BLOCK, enforce_eager=True, enable_prefix_caching=False, seed=0,
    max_num_batched_tokens=128, max_model_len=800, max_num_seqs=MAX_SEQS)
# Offload engine: hot buffers (4 layers x 4 requests x 128 rows x 320 B = 640 KiB) plus
# about 50 indexer blocks of 16 KiB: about two of the long requests at full length while
# four run, so decoding requests are preempted. (vLLM checks max_model_len against this
# memory before the cut, at main KV + indexer bytes.)
OFFLOAD_KV_BYTES = 1_500_000
PLAIN_KV_BYTES = 256 * 2**20
POOL_BLOCKS = 32 * 26  # every reservation at once: preemption never frees pool rows
POOL_GB = POOL_BLOCKS * BLOCK * N_LAYERS * ROW_BYTES / 2**30 + 1e-9

_rng = random.Random(17)
LENGTHS = [_rng.randrange(512, 701) if i % 2 == 0 else _rng.randrange(40, 300) for i in range(32)]
MAX_TOKENS = [_rng.randrange(12, 33) for _ in LENGTHS]
PROMPTS = [[_rng.randrange(3, 512) for _ in range(n)] for n in LENGTHS]


SPARSE = ("verify_rows", "pool_query_tokens", "preempted_requests", "resumed_tokens",
          "recomputed_tokens", "stash_failures", "offload_rows", "resolved_positions",
          "hit_positions", "miss_rows", "admission_failures", "unmatched_rows")


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    from vllm import SamplingParams

    model = ngram_sparse_model(TOPK)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    out: dict[str, Any] = {"tokens": {}, "preempted": {}, "peak": {}, "spec": {}}
    engines = (("plain", {"kv_cache_memory_bytes": PLAIN_KV_BYTES}, True),
               ("spec", {"kv_cache_memory_bytes": PLAIN_KV_BYTES, "speculative_config": SPEC}, False),
               ("offload", {"kv_cache_memory_bytes": OFFLOAD_KV_BYTES, "speculative_config": SPEC,
                            "kv_transfer_config": sparse_decode_config(
                                {"topk_buffer_size": HOT, "index_topk": TOPK,
                                 "dram_size_per_dp_GB": POOL_GB})}, False))
    for name, kw, in_process in engines:
        rec = StepRecorder()
        with owned_engine(lambda rec=rec, kw=kw: stepped_engine(rec, model=model, **ENGINE_ARGS,
                                                                 **kw),
                          in_process=in_process) as eng:
            d0 = {n: registry_value(f"vllm:spec_decode_{n}") for n in ("num_drafts", "num_draft_tokens",
                                                           "num_accepted_tokens")}
            out["tokens"][name] = run_requests(eng, PROMPTS, params)
            out["spec"][name] = {n: registry_value(f"vllm:spec_decode_{n}") - v for n, v in d0.items()}
            out["preempted"][name] = rec.preempted()
            out["peak"][name] = rec.peak_running()
            if name == "offload":
                out["metrics"] = {n: registry_value(f"vllm:ascend_offload_sparse_{n}") for n in SPARSE}
    return out


def test_greedy_tokens_identical_with_speculation_and_offload(runs: dict[str, Any]) -> None:
    toks = runs["tokens"]
    assert len(PROMPTS) >= 30 and sum(n >= 4 * HOT for n in LENGTHS) >= 16
    assert [len(t) for t in toks["offload"]] == MAX_TOKENS
    assert toks["spec"] == toks["plain"]
    assert toks["offload"] == toks["plain"]
    assert len({tuple(t) for t in toks["plain"]}) == len(PROMPTS)


def test_acceptance_between_0_and_1_and_equal_with_and_without_offload(
        runs: dict[str, Any]) -> None:
    spec = runs["spec"]
    print(f"\nspeculation {spec}, preemptions {runs['preempted']}, peak {runs['peak']}")
    s = spec["spec"]
    assert 0 < s["num_accepted_tokens"] < s["num_draft_tokens"], s  # accepted and rejected
    assert spec["offload"] == s
    assert spec["plain"]["num_drafts"] == 0


def test_every_verification_row_went_through_the_hot_buffers(runs: dict[str, Any]) -> None:
    m, s = runs["metrics"], runs["spec"]["offload"]
    print(f"\nsparse metrics {m}")
    assert m["admission_failures"] == 0 and m["unmatched_rows"] == 0, m
    # one verification row per request-step with drafts, each resolved in the hot buffers
    assert m["verify_rows"] == s["num_drafts"] > 0, (m, s)
    # the pool itself served prompt tokens only (prefill chunks): not one output token
    assert 0 < m["pool_query_tokens"] <= N_LAYERS * sum(LENGTHS), m
    assert m["hit_positions"] > 0 and m["miss_rows"] > 0, m


def test_preempted_requests_resumed_without_recomputation(runs: dict[str, Any]) -> None:
    m, pre = runs["metrics"], runs["preempted"]
    assert pre["offload"] > 0 and pre["plain"] == pre["spec"] == 0, pre
    assert runs["peak"]["offload"] >= 2, runs["peak"]
    assert m["preempted_requests"] == pre["offload"], (m, pre)
    assert m["stash_failures"] == 0 and m["resumed_tokens"] > 0, m
    # rejected drafts' positions were written again by later steps: not a recomputation
    assert m["recomputed_tokens"] == 0, m
    # every layer wrote each computed position once, plus the rewrites of rejected drafts
    computed = sum(n + k - 1 for n, k in zip(LENGTHS, MAX_TOKENS, strict=True))
    assert m["offload_rows"] >= N_LAYERS * computed, m
