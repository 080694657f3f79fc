"""P/D with sparse decode offload on vLLM CPU: the decode engine keeps no main KV on the device.

Our 4-layer sparse-MLA model (index_topk 32). Prefill: ``SfaRemoteD2HConnector``
producer. Decode: the consumer with ``sparse_offload`` (hot buffers of 64 rows):
its KV allocation holds only the indexer cache and the hot buffers; the prompt's
main KV arrives over Mooncake TCP into the host pool, the indexer into the
device blocks, and every decode step resolves the indexer's top-k against the
hot buffers. 32 prompts of 20-900 tokens (most >= 4x the hot buffer, all
beyond index_topk but the shortest), sent 6 at a time through our proxy while
decode runs at most 4 (``max_num_seqs``), so requests finish and free their pool
rows while others continue, and some wait for rows (the pool holds about five
of the longest reservations). Greedy tokens must equal the prefill engine's own
plain answer, and no load may have failed (parity after a silent recompute
would prove nothing about the pool path).
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

pytest.importorskip("mooncake.engine")
httpx = pytest.importorskip("httpx")

from ascend_offload.testing.tiny_sparse_model import make_tiny_sparse_model  # noqa: E402
from tests.e2e.harness import BLOCK_SIZE, MODEL_CACHE  # noqa: E402
from tests.e2e.pd_cluster import body, complete, log_lines, log_sizes, pd_cluster, rd2h_config  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

N_LAYERS = 4
TOPK = 32
HOT = 64
ROW_BYTES = (64 + 16) * 4  # latent + rope, float32
MAX_TOKENS = 10
MAX_SEQS = 4
MAX_LEN = 4096
# Pool rows per layer: max_model_len (one request of any length fits) plus a little more;
# five of the 900-token reservations at once, far less than all prompts together.
POOL_ROWS = MAX_LEN + 512
POOL_GB = POOL_ROWS * N_LAYERS * ROW_BYTES / 2**30 + 1e-9
LENGTHS = [300, 420, 512, 600, 20, 333, 470, 560, 64, 389, 900, 301, 256, 777, 45, 640,
           350, 880, 128, 505, 699, 280, 33, 455, 610, 820, 270, 390, 515, 900, 72, 430]


def _prompts() -> list[list[int]]:
    rng = random.Random(29)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in LENGTHS]


PROMPTS = _prompts()
BAD = ("Recovered from KV load failure", "blocks failed to load", "decode did not read", "cannot send",
       "cannot receive", "Traceback", "admission failed")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    model = str(make_tiny_sparse_model(MODEL_CACHE / "tiny-sparse-mla-4l", index_topk=TOPK))
    extra = {"ack_timeout_s": 60, "request_timeout_s": 60, "registration_timeout_s": 30}
    sparse = {"enabled": True, "topk_buffer_size": HOT, "index_topk": TOPK,
              "dram_size_per_dp_GB": POOL_GB}
    with pd_cluster(model, tmp_path_factory.mktemp("pd-sparse-e2e"),
                    lambda port: rd2h_config("kv_producer", port, extra),
                    lambda port: rd2h_config("kv_consumer", port, {**extra, "sparse_offload": sparse}),
                    decode_args=("--no-enable-prefix-caching", "--max-num-seqs", str(MAX_SEQS))) as c:
        yield c


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def _body(model: str, prompt: list[int]) -> dict[str, Any]:
    return body(model, prompt, False, MAX_TOKENS, return_token_ids=True)


def test_pd_sparse_decode_tokens_match_the_plain_engine(cluster: dict[str, Any]) -> None:
    model = cluster["model"]
    since = log_sizes(cluster)
    baseline = [complete(cluster["prefill"], _body(model, p)) for p in PROMPTS]
    with ThreadPoolExecutor(6) as pool:
        pd = list(pool.map(lambda p: complete(cluster["proxy"], _body(model, p)), PROMPTS))
    assert all(a.token_ids is not None and len(a.token_ids) == MAX_TOKENS for a in baseline)
    assert [a.token_ids for a in pd] == [a.token_ids for a in baseline]
    assert len({tuple(a.token_ids or ()) for a in baseline}) == len(PROMPTS)
    assert [line for b in BAD for line in log_lines(cluster, since, b)] == []
    # the decode engine really decoded from the host pool: its KV allocation was cut
    assert log_lines(cluster, {k: 0 for k in since}, "not on the device; device KV")
    assert log_lines(cluster, {k: 0 for k in since}, "into a host pool of")
    metrics = httpx.get(f"{cluster['decode']}/metrics", timeout=10).text
    m = {name: _metric(metrics, f"vllm:ascend_offload_rd2h_{name}_total") for name in (
        "bytes_pulled", "sparse_resolved_positions", "sparse_hit_positions", "sparse_miss_rows",
        "sparse_offload_rows", "sparse_admission_failures", "sparse_unmatched_rows")}
    assert m["bytes_pulled"] > 0, m
    # every decode token of every layer resolved its top-k through the hot buffers
    decode_positions = N_LAYERS * sum(min(TOPK, n) * (MAX_TOKENS - 1) for n in LENGTHS)
    assert m["sparse_resolved_positions"] >= decode_positions, m
    assert m["sparse_hit_positions"] > 0 and m["sparse_miss_rows"] > 0, m
    assert m["sparse_admission_failures"] == 0 and m["sparse_unmatched_rows"] == 0, m
    # decode computed only the last prompt token and the new ones: the pool got the rest over RD2H
    assert m["sparse_offload_rows"] == N_LAYERS * len(LENGTHS) * MAX_TOKENS, m
    print(f"\nP/D sparse decode metrics: {m}; hit rate "
          f"{m['sparse_hit_positions'] / m['sparse_resolved_positions']:.3f}")
    assert POOL_ROWS // BLOCK_SIZE * BLOCK_SIZE < sum(LENGTHS) + MAX_TOKENS * len(LENGTHS)
