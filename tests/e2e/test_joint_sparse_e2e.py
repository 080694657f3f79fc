"""The store tier and the joint prefill on our sparse-MLA model (vLLM CPU engines).

The model has two caches per decoder layer in one KV cache group with different
page sizes: the main KV (one ``kv_lora_rank + rope`` row per token) and the
lightning indexer's keys. A store object holds one block of *both* for every
layer; in layerwise mode an indexer cache follows its main layer's buffer.

* ``AscendStoreConnector`` alone, whole-prefix and layerwise (one shared buffer):
  a second pass loads every shared prefix from the store and answers exactly
  like a plain engine of the same model.
* Joint P/D: the prefill runs ``AscendMultiConnector`` (layerwise store with one
  shared buffer + the ``SfaRemoteD2HConnector`` producer), the decode the
  consumer with ``sparse_offload`` (main KV pulled into its host pool, the
  indexer into device blocks) and ``residency_backend: device`` (the P/D case of
  the device resolver; the host one runs P/D in the preemption and demo tests), speculating
  (vLLM's n-gram proposer, one draft token: verification rows of two query tokens through
  the device resolver). The producer-first order here (the demo runs the
  other) gives the plain engine's tokens, the store serves prefix hits, decode pulls.
* Multi-turn on the same cluster, the decode's prefix cache on
  (``prefix_cache_blocks``): a second turn (the first turn's prompt and answer, then a
  follow-up) pulls only the blocks the decode lacks; run with the cache reset before it
  and with the first turn's entries in it, the bytes pulled differ by exactly the cached
  blocks' bytes, and the decode's time to first token is printed for both.
* The same cluster at load: 32 prompts, 6 at a time, decode running at most 4, the
  pool too small for all of them at once (cache entries evicted as reservations need rows); tokens equal, every decode row resolved
  through the hot buffers, no load failed, and the decode's worker read no top-k and
  no new row back to the host (the device resolver's per-step report only), and every
  verification row attended over the hot buffers.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest

from ascend_offload.harness.engines import ngram_speculative_config
from ascend_offload.harness.tiny_sparse_model import make_tiny_sparse_model
from tests.e2e.harness import (
    BLOCK_SIZE,
    MODEL_CACHE,
    generate,
    make_engine,
    store_transfer_config,
    tokens,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

N_LAYERS = 4
TOPK = 32
MAX_TOKENS = 8
# One block on one rank, every layer: main row (64 latent + 16 rope) + indexer row (64), fp32.
OBJECT_BYTES = N_LAYERS * BLOCK_SIZE * (64 + 16 + 64) * 4


def _prompts() -> list[list[int]]:
    """12 prompts: three families of three sharing a 2-9 block prefix, three unrelated."""
    rng = random.Random(41)
    out = []
    for prefix_len, tails in ((70, (5, 40, 120)), (300, (1, 33, 90)), (150, (64, 7, 200)), (0, (20, 260, 45))):
        prefix = [rng.randrange(3, 512) for _ in range(prefix_len)]
        out += [prefix + [rng.randrange(3, 512) for _ in range(t)] for t in tails]
    return out


PROMPTS = _prompts()
# A second conversation turn: the first turn's prompt and answer, then a follow-up.
_mt = random.Random(53)
TURN1 = [[_mt.randrange(3, 512) for _ in range(n)] for n in (230, 410, 520, 305, 590, 380)]
FOLLOW_UPS = [[_mt.randrange(3, 512) for _ in range(n)] for n in (40, 75, 21, 60, 33, 90)]


def sparse_model() -> str:
    return str(make_tiny_sparse_model(MODEL_CACHE / "tiny-sparse-mla-4l", index_topk=TOPK))


@pytest.fixture(scope="module")
def plain_tokens() -> dict[str, list[list[int]]]:
    """Tokens of a plain engine of the same model (no connector), for both prompt sets."""
    with make_engine(model=sparse_model(), core=0) as llm:
        out = {"families": tokens(generate(llm, PROMPTS, MAX_TOKENS)),
               "load": tokens(generate(llm, LOAD_PROMPTS, LOAD_MAX_TOKENS)),
               "turn1": tokens(generate(llm, TURN1, MAX_TOKENS))}
        out["turn2_prompts"] = [p + a + f for p, a, f in zip(TURN1, out["turn1"], FOLLOW_UPS, strict=True)]
        out["turn2"] = tokens(generate(llm, out["turn2_prompts"], MAX_TOKENS))
        return out


@pytest.fixture(scope="module")
def baseline(plain_tokens: dict[str, list[list[int]]]) -> list[list[int]]:
    return plain_tokens["families"]


@pytest.fixture(scope="module")
def load_baseline(plain_tokens: dict[str, list[list[int]]]) -> list[list[int]]:
    return plain_tokens["load"]


def _store(out: Any) -> dict[str, Any]:
    assert out.kv_transfer_params is not None, "connector returned no stats"
    return out.kv_transfer_params["ascend_store"]


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole-prefix", "layerwise"])
def test_store_on_the_sparse_model_matches_plain(baseline: list[list[int]], layerwise: bool) -> None:
    extra: dict[str, Any] = {"local": {"capacity_bytes": 64 << 20}}
    if layerwise:
        extra.update(use_layerwise=True, layerwise_num_shared_buffers=1, layerwise_independent_layers=[0],
                     layerwise_prefetch_layers=1)
    with make_engine(model=sparse_model(), core=1, kv_transfer_config=store_transfer_config(extra),
                     disable_hybrid_kv_cache_manager=True) as llm:
        first = [generate(llm, [p], MAX_TOKENS)[0] for p in PROMPTS]  # one by one: family hits
        assert tokens(first) == baseline
        second = generate(llm, PROMPTS, MAX_TOKENS)
        assert tokens(second) == baseline
        # family members after the first loaded the shared prefix in the first pass
        assert sum(_store(o)["loaded_blocks"] for o in first) > 0
        for p, o in zip(PROMPTS, second, strict=True):
            assert _store(o)["loaded_blocks"] >= (len(p) - 1) // BLOCK_SIZE, (len(p), _store(o))
        # One more request alone: no load pin of the earlier ones is left. Whole-prefix
        # saves are committed within their step; a layerwise save is committed when a
        # later step reports it, so the lone request's own may still be pending here.
        last = generate(llm, PROMPTS[:1], MAX_TOKENS)
        assert tokens(last) == baseline[:1]
        store = _store(last[0])["store"]
        assert store["pinned_objects"] == 0
        if not layerwise:
            assert store["pending_objects"] == 0


# ------------------------------------------------------------------ joint P/D

HOT = 64
MAX_SEQS = 4
SPEC = ngram_speculative_config(1)
ROW_BYTES = (64 + 16) * 4  # main row: latent + rope, float32
MAX_LEN = 4096
POOL_ROWS = MAX_LEN + 512
POOL_GB = POOL_ROWS * N_LAYERS * ROW_BYTES / 2**30 + 1e-9
# One block of every layer over RD2H: main rows to the pool, indexer keys (index_head_dim 32)
# to device blocks, float32
WIRE_BLOCK_BYTES = N_LAYERS * BLOCK_SIZE * (ROW_BYTES + 32 * 4)
PREFIX_CACHE_BLOCKS = 128  # of the pool's 144: entries are evicted when reservations need rows
BAD = ("Recovered from KV load failure", "blocks failed to load", "decode did not read", "cannot send",
       "cannot receive", "Traceback", "has no reuse-gate token", "admission failed")


def joint_prefill_config(kv_port: int, rd2h_extra: dict[str, Any], producer_first: bool) -> dict[str, Any]:
    """AscendMultiConnector: layerwise store (one shared buffer) + RD2H producer, in either order."""
    from tests.e2e.pd_cluster import rd2h_config

    store = {"use_layerwise": True, "layerwise_num_shared_buffers": 1, "layerwise_independent_layers": [0],
             "layerwise_prefetch_layers": 1, "local": {"capacity_bytes": 64 << 20}, "save_timeout_s": 5.0,
             "load_timeout_s": 60.0}
    children = [{"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
                 "kv_connector_module_path": "ascend_offload.connectors.store", "kv_connector_extra_config": store},
                rd2h_config("kv_producer", kv_port, rd2h_extra)]
    if producer_first:
        children.reverse()
    return {"kv_connector": "AscendMultiConnector", "kv_role": "kv_producer", "kv_port": kv_port,
            "kv_connector_module_path": "ascend_offload.connectors.multi",
            "kv_connector_extra_config": {"connectors": children}}


def _counter(url: str, name: str) -> float:
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f"vllm:ascend_offload_{name}_total"))


@pytest.fixture(scope="module")
def joint_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One P/D cluster for the P/D tests below: the joint prefill (producer first) and the
    sparse decode (hot buffers of 64 rows, at most 4 running requests)."""
    pytest.importorskip("mooncake.engine")
    from tests.e2e.pd_cluster import pd_cluster, rd2h_config

    extra = {"ack_timeout_s": 30, "request_timeout_s": 60, "registration_timeout_s": 30}
    sparse = {"enabled": True, "topk_buffer_size": HOT, "index_topk": TOPK,
              "dram_size_per_dp_GB": POOL_GB, "residency_backend": "device",
              "prefix_cache_blocks": PREFIX_CACHE_BLOCKS}
    with pd_cluster(sparse_model(), tmp_path_factory.mktemp("joint-sparse"),
                    lambda port: joint_prefill_config(port, extra, producer_first=True),
                    lambda port: rd2h_config("kv_consumer", port, {**extra, "sparse_offload": sparse}),
                    prefill_args=("--disable-hybrid-kv-cache-manager",),
                    decode_args=("--no-enable-prefix-caching", "--max-num-seqs", str(MAX_SEQS),
                                 "--speculative-config", json.dumps(SPEC)),
                    # the dev endpoints: POST /reset_prefix_cache?reset_external=true
                    decode_env={"VLLM_SERVER_DEV_MODE": "1"}) as c:
        yield c


# The store-first order is what the demo runs (configs/cpu-demo/prefill-joint.json), with the
# same parity check, in tests/e2e/test_demo_e2e.py; here the other order.
def test_joint_prefill_feeding_sparse_decode_matches_plain(
        baseline: list[list[int]], joint_cluster: dict[str, Any]) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from tests.e2e.pd_cluster import body, complete, log_lines, log_sizes

    c = joint_cluster
    model = c["model"]
    prefill = c["servers"]["prefill"]
    assert "decode reads of each layer hold its physical buffer (8 layers on 4 buffers)" in prefill.text(), \
        [ln for ln in prefill.text().splitlines() if "physical buffer" in ln]
    since = log_sizes(c)
    pulled0 = _counter(c["decode"], "rd2h_layers_pulled")
    req = [body(model, p, False, MAX_TOKENS, return_token_ids=True) for p in PROMPTS]
    # The first member of each family alone (it stores the prefix), the rest 4 at a time.
    firsts = list(range(0, len(PROMPTS), 3))
    answers: dict[int, Any] = {i: complete(c["proxy"], req[i]) for i in firsts}
    rest = [i for i in range(len(PROMPTS)) if i not in answers]
    with ThreadPoolExecutor(4) as pool:
        answers.update(zip(rest, pool.map(lambda i: complete(c["proxy"], req[i]), rest), strict=True))
    got = [list(answers[i].token_ids or ()) for i in range(len(PROMPTS))]
    assert got == baseline
    want = pulled0 + len(PROMPTS) * N_LAYERS
    deadline = time.monotonic() + 30
    while _counter(c["decode"], "rd2h_layers_pulled") < want and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _counter(c["decode"], "rd2h_layers_pulled") == want
    assert _counter(c["prefill"], "store_loaded_blocks") > 0  # family members hit the store
    assert _counter(c["prefill"], "rd2h_gate_holds") > 0
    assert [line for b in BAD for line in log_lines(c, since, b)] == []


# ------------------------------------------------------------------ P/D sparse decode at load
#
# 32 prompts of 20-900 tokens (most >= 4x the hot buffer, all beyond index_topk but the
# shortest), sent 6 at a time through the proxy while decode runs at most 4, so requests
# finish and free their pool rows while others continue, and some wait for rows (the pool
# holds about five of the longest reservations). Greedy tokens must equal the plain
# engine's, and no load may have failed (parity after a silent recompute would prove
# nothing about the pool path).

LOAD_MAX_TOKENS = 10
LOAD_LENGTHS = [300, 420, 512, 600, 20, 333, 470, 560, 64, 389, 900, 301, 256, 777, 45, 640,
                350, 880, 128, 505, 699, 280, 33, 455, 610, 820, 270, 390, 515, 900, 72, 430]


def _load_prompts() -> list[list[int]]:
    rng = random.Random(29)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in LOAD_LENGTHS]


LOAD_PROMPTS = _load_prompts()


def _decode_counters(url: str) -> dict[str, float]:
    import httpx

    out = {n: _counter(url, f"rd2h_{n}") for n in (
        "layers_pulled", "bytes_pulled", "sparse_resolved_positions", "sparse_hit_positions", "sparse_miss_rows",
        "sparse_offload_rows", "sparse_admission_failures", "sparse_unmatched_rows",
        "sparse_host_reads_topk", "sparse_host_reads_new_rows", "sparse_host_reads_step",
        "sparse_verify_rows", "sparse_pool_query_tokens")}
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for n in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        out[n] = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith(f"vllm:spec_decode_{n}_total"))
    return out


def test_pd_sparse_decode_at_concurrency_matches_plain(load_baseline: list[list[int]],
                                                       joint_cluster: dict[str, Any]) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from tests.e2e.pd_cluster import body, complete, log_lines, log_sizes

    c = joint_cluster
    since = log_sizes(c)
    before = _decode_counters(c["decode"])
    req = [body(c["model"], p, False, LOAD_MAX_TOKENS, return_token_ids=True) for p in LOAD_PROMPTS]
    with ThreadPoolExecutor(6) as pool:
        pd = list(pool.map(lambda r: complete(c["proxy"], r), req))
    assert [list(a.token_ids or ()) for a in pd] == load_baseline
    assert len({tuple(t) for t in load_baseline}) == len(LOAD_PROMPTS)
    assert [line for b in BAD for line in log_lines(c, since, b)] == []
    # the decode engine really decoded from the host pool: its KV allocation was cut
    assert log_lines(c, {k: 0 for k in since}, "not on the device; device KV")
    assert log_lines(c, {k: 0 for k in since}, "into a host pool of")
    after = _decode_counters(c["decode"])
    m = {k: after[k] - before[k] for k in after}
    assert m["bytes_pulled"] > 0, m
    # every decode token of every layer resolved its top-k through the hot buffers
    decode_positions = N_LAYERS * sum(min(TOPK, n) * (LOAD_MAX_TOKENS - 1) for n in LOAD_LENGTHS)
    assert m["sparse_resolved_positions"] >= decode_positions, m
    assert m["sparse_hit_positions"] > 0 and m["sparse_miss_rows"] > 0, m
    assert m["sparse_admission_failures"] == 0 and m["sparse_unmatched_rows"] == 0, m
    # the device resolver: nothing read back per layer, one report read per step
    assert m["sparse_host_reads_topk"] == 0 and m["sparse_host_reads_new_rows"] == 0, m
    assert m["sparse_host_reads_step"] > 0, m
    # speculation: every verification row (one per request-step with a draft) went through
    # the hot buffers, none attended over the pool
    print(f"\nP/D sparse decode at concurrency, speculating: {m}")
    assert m["num_drafts"] > 0 and m["sparse_verify_rows"] == m["num_drafts"], m
    assert m["sparse_pool_query_tokens"] == 0, m
    # decode computed only the last prompt token, the new ones and the drafts it verified
    # (a rejected draft's row is written again by the next step): the pool got the rest
    # over RD2H
    # (rows = steps + drafts, tokens = steps + accepted - drafts accepted past max_tokens,
    # at most one step's drafts per request)
    rows = m["sparse_offload_rows"] / N_LAYERS
    new = len(LOAD_LENGTHS) * LOAD_MAX_TOKENS
    past_end = len(LOAD_LENGTHS) * SPEC["num_speculative_tokens"]
    assert new <= rows <= new + m["num_draft_tokens"] - m["num_accepted_tokens"] + past_end, m
    # the pool holds far less than every request at once
    assert POOL_ROWS // BLOCK_SIZE * BLOCK_SIZE < sum(LOAD_LENGTHS) + LOAD_MAX_TOKENS * len(LOAD_LENGTHS)


# ------------------------------------------------------------------ multi-turn, decode-side prefix cache


def _ttft(url: str) -> tuple[float, float]:
    """The decode engine's time-to-first-token histogram: (sum of seconds, count)."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30).text

    def total(name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))

    return total("vllm:time_to_first_token_seconds_sum"), total("vllm:time_to_first_token_seconds_count")


def test_multi_turn_pulls_only_the_blocks_decode_lacks(plain_tokens: dict[str, Any],
                                                       joint_cluster: dict[str, Any]) -> None:
    """The second turn with and without the first turn's blocks in the decode's cache: the
    same answers (the plain engine's), and the bytes pulled over RD2H differ by the cached
    blocks (one block of every layer's main and indexer rows each) exactly."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from tests.e2e.pd_cluster import body, complete, log_lines, log_sizes

    c = joint_cluster
    since = log_sizes(c)

    def reset() -> None:
        r = httpx.post(f"{c['decode']}/reset_prefix_cache", params={"reset_external": "true"},
                       timeout=30)
        assert r.status_code == 200, r.text

    def run(prompts: list[list[int]], want: list[list[int]]) -> dict[str, float]:
        before = _decode_counters(c["decode"])
        loaded0 = _counter(c["decode"], "rd2h_sparse_prefix_loaded_blocks")
        ttft0 = _ttft(c["decode"])
        req = [body(c["model"], p, False, MAX_TOKENS, return_token_ids=True) for p in prompts]
        with ThreadPoolExecutor(4) as pool:
            got = [list(a.token_ids or ()) for a in pool.map(lambda r: complete(c["proxy"], r), req)]
        assert got == want
        pulled = before["layers_pulled"] + len(prompts) * N_LAYERS  # one read per layer
        deadline = time.monotonic() + 30
        while _counter(c["decode"], "rd2h_layers_pulled") < pulled and time.monotonic() < deadline:
            time.sleep(0.2)
        after = _decode_counters(c["decode"])
        ttft = _ttft(c["decode"])
        return {"bytes": after["bytes_pulled"] - before["bytes_pulled"],
                "loaded": _counter(c["decode"], "rd2h_sparse_prefix_loaded_blocks") - loaded0,
                "ttft_s": (ttft[0] - ttft0[0]) / max(1.0, ttft[1] - ttft0[1])}

    turn2 = plain_tokens["turn2_prompts"]
    reset()
    run(TURN1, plain_tokens["turn1"])
    reset()  # the second turn finds nothing cached
    without = run(turn2, plain_tokens["turn2"])
    reset()
    run(TURN1, plain_tokens["turn1"])  # its finished blocks stay in the cache
    with_cache = run(turn2, plain_tokens["turn2"])
    print(f"\nmulti-turn, second turn: without the decode prefix cache {without}, with {with_cache}")
    assert without["loaded"] == 0, without
    # every first turn's full blocks (prompt and answer but the last token) served the second
    want_blocks = sum(min((len(p) + MAX_TOKENS - 1) // BLOCK_SIZE, (len(q) - 1) // BLOCK_SIZE)
                      for p, q in zip(TURN1, turn2, strict=True))
    assert with_cache["loaded"] == want_blocks, (with_cache, want_blocks)
    assert without["bytes"] - with_cache["bytes"] == want_blocks * WIRE_BLOCK_BYTES, (without, with_cache)
    assert [line for b in BAD for line in log_lines(c, since, b)] == []
