"""P/D: a preempted request on the sparse decode resumes from the host pool without
recomputing its history (the RD2H decode reuses the colocated connector's objects).

Our 4-layer sparse-MLA model (index_topk 32, hot buffers of 64 rows) with small weights
(initializer range 0.02: its greedy text repeats itself, so n-gram drafts are accepted
now and then). Prefill:
``SfaRemoteD2HConnector`` producer; decode: the consumer with ``sparse_offload``,
given so little KV memory (1 MiB: 44 indexer blocks after the hot buffers) that
decoding requests outgrow it and vLLM preempts: prompts of 150-260 tokens (a
request's prompt blocks must fit before its pull starts) grow by 180-240 tokens
each, four at a time. The pool
holds every reservation, so preempted requests keep their rows. The decode speculates
(vLLM's n-gram proposer, one draft token: verification rows of two query tokens, whose
top-k union fits the 64-row hot buffer). Greedy tokens
must equal the prefill engine's own answer (no offload, the same speculation; both
accept some drafts and reject others), no load may have
failed, the decode's preemptions (vLLM's counter) must all have been resumed from the
stash (``..._rd2h_sparse_resumed_tokens`` > 0, nothing recomputed), every verification
row must have attended over the hot buffers (none over the pool), and the decode must
have written only the rows of the tokens it computed (the last prompt token, the new
ones and the drafts it verified): no main-KV history moved on resumption.

The decode's prefix cache is on (``prefix_cache_blocks``): a second batch of 24 prompts,
three per first-batch prompt, starts with 2-6 blocks of that prompt (its blocks are in
the cache once the first batch finished) and goes on with a tail of its own, 8 at a
time. Tokens must equal the prefill engine's own answers again, with preemptions, with
cached blocks served (rows shared in the pool, indexer rows loaded, not pulled) and none
failing, nothing recomputed.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

pytest.importorskip("mooncake.engine")
httpx = pytest.importorskip("httpx")

from ascend_offload.harness.engines import ngram_speculative_config  # noqa: E402
from tests.e2e.harness import ngram_sparse_model  # noqa: E402
from tests.e2e.pd_cluster import body, complete, log_lines, log_sizes, pd_cluster, rd2h_config  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

N_LAYERS = 4
TOPK = 32
HOT = 64
ROW_BYTES = (64 + 16) * 4  # latent + rope, float32
MAX_SEQS = 4
MAX_LEN = 512
DECODE_KV_BYTES = 1 << 20
SPEC = ngram_speculative_config(1)
POOL_ROWS = 12 * MAX_LEN  # every reservation at once
PREFIX_CACHE_BLOCKS = 96
POOL_GB = POOL_ROWS * N_LAYERS * ROW_BYTES / 2**30 + 1e-9
_rng = random.Random(17)
LENGTHS = [_rng.randrange(150, 260) for _ in range(8)]
MAX_TOKENS = [_rng.randrange(180, 240) for _ in LENGTHS]
PROMPTS = [[_rng.randrange(3, 512) for _ in range(n)] for n in LENGTHS]
# second batch: three per first-batch prompt, its first 2-6 blocks then a tail of their own
SHARED = [PROMPTS[i // 3][:32 * min(_rng.randrange(2, 7), (LENGTHS[i // 3] - 1) // 32)]
          + [_rng.randrange(3, 512) for _ in range(_rng.randrange(60, 140))] for i in range(24)]
SHARED_MAX_TOKENS = [_rng.randrange(100, 160) for _ in SHARED]
BAD = ("Recovered from KV load failure", "blocks failed to load", "decode did not read", "cannot send",
       "cannot receive", "Traceback", "admission failed", "not stashed", "stash not loaded")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    model = ngram_sparse_model(TOPK)
    extra = {"ack_timeout_s": 60, "request_timeout_s": 60, "registration_timeout_s": 30}
    sparse = {"enabled": True, "topk_buffer_size": HOT, "index_topk": TOPK,
              "dram_size_per_dp_GB": POOL_GB, "prefix_cache_blocks": PREFIX_CACHE_BLOCKS}
    with pd_cluster(model, tmp_path_factory.mktemp("pd-sparse-preempt-e2e"),
                    lambda port: rd2h_config("kv_producer", port, extra),
                    lambda port: rd2h_config("kv_consumer", port, {**extra, "sparse_offload": sparse}),
                    # the prefill's own answers (the baseline) speculate the same way
                    prefill_args=("--speculative-config", json.dumps(SPEC)),
                    decode_args=("--no-enable-prefix-caching", "--max-num-seqs", str(MAX_SEQS),
                                 "--max-model-len", str(MAX_LEN),
                                 "--kv-cache-memory-bytes", str(DECODE_KV_BYTES),
                                 "--speculative-config", json.dumps(SPEC)),
                    # the legacy GiB setting would replace --kv-cache-memory-bytes
                    decode_env={"VLLM_CPU_KVCACHE_SPACE": None}) as c:
        yield c


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def test_pd_preempted_requests_resume_from_the_pool(cluster: dict[str, Any]) -> None:
    model = cluster["model"]
    since = log_sizes(cluster)
    bodies = [body(model, p, False, k, return_token_ids=True)
              for p, k in zip(PROMPTS, MAX_TOKENS, strict=True)]
    # the reference answers all at once, as the second batch's: greedy tokens do not
    # depend on which other requests share a step
    with ThreadPoolExecutor(8) as pool:
        baseline = list(pool.map(lambda b: complete(cluster["prefill"], b), bodies))
    with ThreadPoolExecutor(8) as pool:
        pd = list(pool.map(lambda b: complete(cluster["proxy"], b), bodies))
    assert [len(a.token_ids or ()) for a in baseline] == MAX_TOKENS
    assert [a.token_ids for a in pd] == [a.token_ids for a in baseline]
    assert [line for b in BAD for line in log_lines(cluster, since, b)] == []
    text = httpx.get(f"{cluster['decode']}/metrics", timeout=10).text
    preemptions = _metric(text, "vllm:num_preemptions_total")
    m = {name: _metric(text, f"vllm:ascend_offload_rd2h_{name}_total") for name in (
        "sparse_preempted_requests", "sparse_resumed_tokens", "sparse_recomputed_tokens",
        "sparse_stash_failures", "sparse_offload_rows", "sparse_admission_failures",
        "sparse_unmatched_rows", "sparse_verify_rows", "sparse_pool_query_tokens")}
    spec = {n: _metric(text, f"vllm:spec_decode_{n}_total") for n in (
        "num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    ptext = httpx.get(f"{cluster['prefill']}/metrics", timeout=10).text
    plain_spec = {n: _metric(ptext, f"vllm:spec_decode_{n}_total") for n in spec}
    print(f"\nP/D sparse preemption: vLLM preemptions {preemptions}, speculation {spec} "
          f"(without offload: {plain_spec}), metrics {m}")
    assert preemptions > 0, (preemptions, m)
    assert m["sparse_preempted_requests"] == preemptions, (preemptions, m)
    assert m["sparse_resumed_tokens"] >= preemptions, m
    assert m["sparse_recomputed_tokens"] == 0 and m["sparse_stash_failures"] == 0, m
    assert m["sparse_admission_failures"] == 0 and m["sparse_unmatched_rows"] == 0, m
    # drafts accepted and rejected, here and in the prefill engine's own speculating
    # answers. The counts are not compared: they depend on the steps vLLM forms (the
    # prefill ran the eight together from the first step, the decode as their pulls
    # landed and preempted; a resumed request's first step has no draft), which differ
    # from run to run. Equal counts under the same schedule:
    # tests/e2e/test_sparse_spec_e2e.py (stepped engines).
    assert 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"], spec
    assert 0 < plain_spec["num_accepted_tokens"] < plain_spec["num_draft_tokens"], plain_spec
    # every verification row (one per request-step with a draft) used the hot buffers
    assert spec["num_drafts"] > 0 and m["sparse_verify_rows"] == spec["num_drafts"], (m, spec)
    assert m["sparse_pool_query_tokens"] == 0, m
    # decode computed the last prompt token and the new ones but the last, once each, and
    # the drafts it verified: a rejected draft's row is written again by the next step
    # (rows = steps + drafts, tokens = steps + accepted - drafts accepted past max_tokens,
    # at most one step's drafts per request)
    rows = m["sparse_offload_rows"] / N_LAYERS
    rejected = spec["num_draft_tokens"] - spec["num_accepted_tokens"]
    past_end = len(PROMPTS) * SPEC["num_speculative_tokens"]
    assert sum(MAX_TOKENS) <= rows <= sum(MAX_TOKENS) + rejected + past_end, (m, spec)


def test_pd_shared_prefixes_served_from_the_cache_with_preemption(cluster: dict[str, Any]) -> None:
    """After the first batch: its prompts' blocks are cached on the decode; the second
    batch starts from them (not pulled) while vLLM preempts, and answers as the prefill."""
    model = cluster["model"]
    since = log_sizes(cluster)
    names = ("sparse_prefix_loaded_blocks", "sparse_prefix_load_failures", "sparse_preempted_requests",
             "sparse_recomputed_tokens", "sparse_stash_failures", "sparse_admission_failures",
             "sparse_pool_query_tokens", "sparse_resumed_tokens")

    def counters() -> dict[str, float]:
        text = httpx.get(f"{cluster['decode']}/metrics", timeout=10).text
        out = {n: _metric(text, f"vllm:ascend_offload_rd2h_{n}_total") for n in names}
        out["preemptions"] = _metric(text, "vllm:num_preemptions_total")
        return out

    bodies = [body(model, p, False, k, return_token_ids=True)
              for p, k in zip(SHARED, SHARED_MAX_TOKENS, strict=True)]
    with ThreadPoolExecutor(4) as pool:
        baseline = list(pool.map(lambda b: complete(cluster["prefill"], b), bodies))
    before = counters()
    with ThreadPoolExecutor(8) as pool:
        pd = list(pool.map(lambda b: complete(cluster["proxy"], b), bodies))
    assert [a.token_ids for a in pd] == [a.token_ids for a in baseline]
    assert [line for b in BAD for line in log_lines(cluster, since, b)] == []
    after = counters()
    m = {k: after[k] - before[k] for k in after}
    print(f"\nP/D shared prefixes from the decode's cache, with preemption: {m}")
    assert m["preemptions"] > 0 and m["sparse_preempted_requests"] == m["preemptions"], m
    assert m["sparse_prefix_loaded_blocks"] > 0 and m["sparse_prefix_load_failures"] == 0, m
    assert m["sparse_recomputed_tokens"] == 0 and m["sparse_stash_failures"] == 0, m
    assert m["sparse_admission_failures"] == 0 and m["sparse_pool_query_tokens"] == 0, m
