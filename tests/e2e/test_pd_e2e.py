"""P/D end to end on vLLM CPU: proxy + prefill (producer) + decode (consumer) servers.

Every request goes client -> our proxy -> decode (do_remote_prefill) and, at the
same time, prefill (max_tokens=1; the proxy's opt-in early dispatch, ``--prefill-dispatch
early``) -> decode registers with the metaserver -> prefill's connector claims that
registration -> decode pulls each layer over Mooncake TCP -> decode generates. (The
other P/D e2e files use the decode-first chain, the proxy's default.) Tokens must equal the colocated answer of one engine
(the prefill server itself answering plain requests, where the connector is
inactive), for 20 prompts of 50-1500 tokens, streaming and not (the streamed
pass repeats the prompts: decode then holds their full blocks in its prefix cache
and pulls only the remainder, from ``remote_block_offset``). The decode log
must show no KV load failure: parity after a silent fallback to recompute would
prove nothing about the transfer.

Faults use the prefill's fault hook (``debug: {pd_faults: ...}`` in its extra config):
requests of 6 blocks get an invalid layer-1 readiness (decode answers
``read_failed`` at once), requests of 7 blocks lose layer 2's readiness (decode's
request deadline). Both must end as load errors that vLLM recomputes, with
tokens still identical. Last, the prefill server is killed: the client gets an
OpenAI-style error and decode ends with no request and no KV block held.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

pytest.importorskip("mooncake.engine")
httpx = pytest.importorskip("httpx")

from ascend_offload.harness.tiny_model import random_prompts  # noqa: E402
from tests.e2e.harness import BLOCK_SIZE, tiny_model  # noqa: E402
from tests.e2e.pd_cluster import (  # noqa: E402
    body,
    complete,
    idle_state,
    log_lines,
    log_sizes,
    metric,
    pd_cluster,
    rd2h_config,
    stream,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

LENGTHS = [50, 1500, 333, 97, 760, 1024, 64, 420, 1200, 150, 999, 77, 512, 1350, 240, 880, 55, 640, 1111, 300]
PROMPTS = random_prompts(20, LENGTHS, seed=11)
FAULTS = "invalid:1@6,drop:2@7"  # by block count; no prompt above has 6 or 7 blocks
FAULT_PROMPTS = random_prompts(3, [180, 220, 130], seed=5)  # 6, 7 and 5 blocks
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    extra = {"ack_timeout_s": 20, "request_timeout_s": 10, "registration_timeout_s": 20}
    # Prefill (also the colocated baseline) without prefix caching; decode with it,
    # so repeated prompts pull only the blocks decode does not hold yet.
    with pd_cluster(tiny_model(4), tmp_path_factory.mktemp("pd-e2e"),
                    lambda port: rd2h_config("kv_producer", port, {**extra, "debug": {"pd_faults": FAULTS}}),
                    lambda port: rd2h_config("kv_consumer", port, extra),
                    proxy_args=("--prefill-dispatch", "early"),
                    worker_in_core=False) as c:  # RD2H metadata crosses vLLM's worker boundary
        yield c


def _body(model: str, prompt: list[int], streaming: bool) -> dict[str, Any]:
    return body(model, prompt, streaming, MAX_TOKENS, return_token_ids=True)


BAD = ("Recovered from KV load failure", "blocks failed to load", "decode did not read", "cannot send",
       "cannot receive", "Traceback")


def test_pd_tokens_match_colocated(cluster: dict[str, Any]) -> None:
    model = cluster["model"]
    since = log_sizes(cluster)
    with ThreadPoolExecutor(4) as pool:  # the colocated answers; greedy, so batching does not change them
        baseline = list(pool.map(lambda p: complete(cluster["prefill"], _body(model, p, False)), PROMPTS))
    pd = [complete(cluster["proxy"], _body(model, p, False)) for p in PROMPTS]
    # Token ids, not only text (two token sequences can detokenize alike).
    assert all(a.token_ids is not None and len(a.token_ids) == MAX_TOKENS for a in baseline)
    assert [a.token_ids for a in pd] == [a.token_ids for a in baseline]
    assert pd == baseline
    hits = metric(httpx.get(f"{cluster['decode']}/metrics", timeout=10).text, "vllm:prefix_cache_hits_total")
    # Same prompts again: decode has their full blocks cached and pulls only the rest
    # (remote_block_offset > 0 on the wire).
    streamed = [stream(cluster["proxy"], _body(model, p, True)) for p in PROMPTS]
    assert [a.token_ids for a in streamed] == [a.token_ids for a in baseline]
    assert streamed == baseline
    hits2 = metric(httpx.get(f"{cluster['decode']}/metrics", timeout=10).text, "vllm:prefix_cache_hits_total")
    assert hits2 - hits >= sum(len(p) // BLOCK_SIZE for p in PROMPTS) * BLOCK_SIZE - len(PROMPTS) * BLOCK_SIZE
    assert [line for b in BAD for line in log_lines(cluster, since, b)] == []


def _claims_ok(cluster: dict[str, Any]) -> float:
    """The proxy's successful claims so far (0 before the first: the labelled series is absent)."""
    ok = 'ascend_offload_proxy_metaserver_claims_total{result="ok"} '
    text = httpx.get(f"{cluster['proxy']}/metrics", timeout=10).text
    return sum(float(line[len(ok):]) for line in text.splitlines() if line.startswith(ok))


def test_concurrent_requests_claim_their_registrations(cluster: dict[str, Any]) -> None:
    """Four requests at once: each prefill waits for (claims) its own decode's registration."""
    model = cluster["model"]
    prompts = PROMPTS[2:10]
    since = log_sizes(cluster)
    claimed = _claims_ok(cluster)
    baseline = [complete(cluster["prefill"], _body(model, p, False)) for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        pd = list(pool.map(lambda p: stream(cluster["proxy"], _body(model, p, True)), prompts))
    assert [a.token_ids for a in pd] == [a.token_ids for a in baseline]
    assert _claims_ok(cluster) - claimed == len(prompts)
    assert [line for b in BAD for line in log_lines(cluster, since, b)] == []


def test_invalid_and_dropped_messages_recompute_identically(cluster: dict[str, Any]) -> None:
    model = cluster["model"]
    baseline = [complete(cluster["prefill"], _body(model, p, False)) for p in FAULT_PROMPTS]
    since = log_sizes(cluster)
    pd = [complete(cluster["proxy"], _body(model, p, False)) for p in FAULT_PROMPTS]
    assert pd == baseline
    failed = log_lines(cluster, since, "blocks failed to load")
    assert len(failed) == 2, failed  # the 6- and the 7-block prompt; the 5-block one transferred
    assert any("read_failed" in line or "invalid" in line for line in failed), failed
    assert any("timeout" in line for line in failed), failed
    assert log_lines(cluster, since, "Recovered from KV load failure")
    assert log_lines(cluster, since, "Traceback") == []


def test_prefill_killed_client_error_and_decode_holds_nothing(cluster: dict[str, Any]) -> None:
    cluster["servers"]["prefill"].stop()
    r = httpx.post(f"{cluster['proxy']}/v1/completions", json=_body(cluster["model"], PROMPTS[2], False),
                   timeout=120)
    assert r.status_code in (502, 503, 504), r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["code"] == r.status_code
    state = idle_state(cluster['decode'], 60)
    assert state == (0.0, 0.0, 0.0), f"decode still holds (running, waiting, kv usage) = {state}"
