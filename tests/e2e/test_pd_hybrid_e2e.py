"""P/D with hybrid residency on the sparse decode: pulled prompts land straight in device
rows borrowed from vLLM's free KV blocks, and under pressure resident requests move to the
host pool (real vLLM CPU engines, our proxy, Mooncake TCP).

Our 4-layer sparse-MLA model (index_topk 32, hot buffers of 64 rows, float32). Prefill:
``SfaRemoteD2HConnector`` producer (no offload: its own answers are the baseline); decode:
the consumer with ``sparse_offload`` and ``hybrid: true``, given so little KV memory
(1.5 MiB: 76 indexer blocks after the hot buffers, a borrowed block holding 12-13 main-KV
rows, so a resident request takes 3.5 times the blocks of another) that not every
request fits resident: a pull is placed when it is registered while blocks are spare
(its main KV lands in its resident rows), and when vLLM needs blocks for the next pull
or a growing request, the longest-running residents move to the pool. 36 prompts of 60-250 tokens, 24-64 new
tokens each, 6 at a time through the proxy, decode running at most 4.

Greedy tokens must equal the prefill engine's own, no load may have failed, requests must
have started resident, some must have moved and others finished resident (the decode's
counters), nothing may have been recomputed, and once all finished vLLM's KV usage is
back to 0 (every borrowed block returned).
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

pytest.importorskip("mooncake.engine")
httpx = pytest.importorskip("httpx")

from ascend_offload.harness.tiny_sparse_model import make_tiny_sparse_model  # noqa: E402
from tests.e2e.harness import MODEL_CACHE  # noqa: E402
from tests.e2e.pd_cluster import (  # noqa: E402
    body,
    complete,
    idle_state,
    log_lines,
    log_sizes,
    metric,
    pd_cluster,
    rd2h_config,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

N_LAYERS = 4
TOPK = 32
HOT = 64
ROW_BYTES = (64 + 16) * 4  # latent + rope, float32
MAX_SEQS = 4
MAX_LEN = 512
DECODE_KV_BYTES = 3 << 19
POOL_ROWS = 12 * MAX_LEN  # every reservation at once
POOL_GB = POOL_ROWS * N_LAYERS * ROW_BYTES / 2**30 + 1e-9
_rng = random.Random(23)
LENGTHS = [_rng.randrange(60, 250) for _ in range(36)]
MAX_TOKENS = [_rng.randrange(24, 64) for _ in LENGTHS]
PROMPTS = [[_rng.randrange(3, 512) for _ in range(n)] for n in LENGTHS]
BAD = ("Recovered from KV load failure", "blocks failed to load", "decode did not read", "cannot send",
       "cannot receive", "Traceback", "admission failed", "not stashed", "stash not loaded")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    model = str(make_tiny_sparse_model(MODEL_CACHE / "tiny-sparse-mla-4l", index_topk=TOPK))
    extra = {"ack_timeout_s": 60, "request_timeout_s": 60, "registration_timeout_s": 30}
    sparse = {"enabled": True, "topk_buffer_size": HOT, "index_topk": TOPK,
              "dram_size_per_dp_GB": POOL_GB, "hybrid": True}
    with pd_cluster(model, tmp_path_factory.mktemp("pd-hybrid-e2e"),
                    lambda port: rd2h_config("kv_producer", port, extra),
                    lambda port: rd2h_config("kv_consumer", port, {**extra, "sparse_offload": sparse}),
                    decode_args=("--no-enable-prefix-caching", "--max-num-seqs", str(MAX_SEQS),
                                 "--max-model-len", str(MAX_LEN),
                                 "--kv-cache-memory-bytes", str(DECODE_KV_BYTES)),
                    # the legacy GiB setting would replace --kv-cache-memory-bytes
                    decode_env={"VLLM_CPU_KVCACHE_SPACE": None}) as c:
        yield c


def test_pd_hybrid_residency_lands_resident_moves_under_pressure_tokens_identical(
        cluster: dict[str, Any]) -> None:
    model = cluster["model"]
    since = log_sizes(cluster)
    bodies = [body(model, p, False, k, return_token_ids=True)
              for p, k in zip(PROMPTS, MAX_TOKENS, strict=True)]
    t0 = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        baseline = list(pool.map(lambda b: complete(cluster["prefill"], b), bodies))
    t1 = time.monotonic()
    with ThreadPoolExecutor(6) as pool:
        pd = list(pool.map(lambda b: complete(cluster["proxy"], b), bodies))
    t2 = time.monotonic()
    assert [len(a.token_ids or ()) for a in baseline] == MAX_TOKENS
    assert [a.token_ids for a in pd] == [a.token_ids for a in baseline]
    assert [line for b in BAD for line in log_lines(cluster, since, b)] == []
    assert log_lines(cluster, {k: 0 for k in since}, "hybrid residency: main KV resident in borrowed")
    text = httpx.get(f"{cluster['decode']}/metrics", timeout=10).text
    m = {name: metric(text, f"vllm:ascend_offload_rd2h_{name}_total") for name in (
        "sparse_placed_requests", "sparse_moved_requests", "sparse_moved_bytes",
        "sparse_resident_rows", "sparse_resident_query_tokens", "sparse_offload_rows",
        "sparse_recomputed_tokens", "sparse_admission_failures", "sparse_unmatched_rows",
        "sparse_stash_failures", "read_failures", "layers_pulled", "resident_pulls")}
    m["preemptions"] = metric(text, "vllm:num_preemptions_total")
    print(f"\nP/D hybrid residency: {len(PROMPTS)} prompts, 6 at a time ({t2 - t1:.1f} s; the "
          f"prefill's own answers {t1 - t0:.1f} s): {m}")
    assert m["layers_pulled"] == len(PROMPTS) * N_LAYERS and m["read_failures"] == 0, m
    # every request that started resident had its prompt pulled into its resident rows
    assert m["resident_pulls"] == m["sparse_placed_requests"] > 0, m
    # requests started resident (their pulled main KV in device rows), some moved, the
    # others finished resident
    assert m["sparse_placed_requests"] > m["sparse_moved_requests"] > 0, m
    assert m["sparse_placed_requests"] < len(PROMPTS), m  # the budget is tight: not all of them
    assert m["sparse_moved_bytes"] > 0 and m["sparse_resident_query_tokens"] > 0, m
    # every computed row went once to the device rows or the pool: the last prompt token
    # and the new tokens but the last (the pulled prompt is not computed)
    computed = sum(MAX_TOKENS)
    assert m["sparse_resident_rows"] + m["sparse_offload_rows"] == N_LAYERS * computed, m
    assert m["sparse_resident_rows"] > 0 and m["sparse_offload_rows"] > 0, m
    assert m["sparse_recomputed_tokens"] == 0 and m["sparse_stash_failures"] == 0, m
    assert m["sparse_admission_failures"] == 0 and m["sparse_unmatched_rows"] == 0, m
    # every borrowed block went back to vLLM
    state = idle_state(cluster['decode'], 30)
    assert state == (0.0, 0.0, 0.0), f"decode still holds (running, waiting, kv usage) = {state}"
