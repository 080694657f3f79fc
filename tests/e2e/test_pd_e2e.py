"""P/D end to end on vLLM CPU: proxy + prefill (producer) + decode (consumer) servers.

Every request goes client -> our proxy -> decode (do_remote_prefill) -> metaserver
registration -> prefill (max_tokens=1) -> decode pulls each layer over Mooncake
TCP -> decode generates. Tokens must equal the colocated answer of one engine
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

A second proxy in front of the same engines dispatches prefill-first (prefill and
decode at once, the prefill fetching the decode's registration): the same parity
and fault checks, and a prefill request whose registration never comes (its blocks
held until ``registration_wait_s``, then freed and counted) or whose ticket is
malformed or refused.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("mooncake.engine")
httpx = pytest.importorskip("httpx")

from ascend_offload.harness.servers import free_port  # noqa: E402
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
# The same sizes for the prefill-first proxy (new prompts: decode's prefix cache holds the first ones).
PF_FAULT_PROMPTS = random_prompts(3, [180, 220, 130], seed=6)
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    extra = {"ack_timeout_s": 20, "request_timeout_s": 10, "registration_timeout_s": 20}
    # Prefill (also the colocated baseline) without prefix caching; decode with it,
    # so repeated prompts pull only the blocks decode does not hold yet.
    with pd_cluster(tiny_model(4), tmp_path_factory.mktemp("pd-e2e"),
                    lambda port: rd2h_config("kv_producer", port, {**extra, "debug": {"pd_faults": FAULTS},
                                                                   "registration_wait_s": 5}),
                    lambda port: rd2h_config("kv_consumer", port, extra),
                    worker_in_core=False,  # RD2H metadata crosses vLLM's worker boundary
                    second_proxy_args=("--dispatch", "prefill_first")) as c:
        yield c


def _body(model: str, prompt: list[int], streaming: bool) -> dict[str, Any]:
    return body(model, prompt, streaming, MAX_TOKENS, return_token_ids=True)


BAD = ("Recovered from KV load failure", "blocks failed to load", "decode did not read", "cannot send",
       "cannot receive", "Traceback")


def test_pd_tokens_match_colocated(cluster: dict[str, Any]) -> None:
    model = cluster["model"]
    since = log_sizes(cluster)
    baseline = [complete(cluster["prefill"], _body(model, p, False)) for p in PROMPTS]
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


def _rd2h(url: str, name: str) -> float:
    return metric(httpx.get(f"{url}/metrics", timeout=10).text, f"vllm:ascend_offload_rd2h_{name}")


def _until_metric(url: str, name: str, want: float) -> float:
    """The metric once it reached ``want`` (reported with the engine's steps), or at a hang guard."""
    deadline = time.monotonic() + 60
    while (got := _rd2h(url, name)) < want and time.monotonic() < deadline:
        time.sleep(0.2)
    return got


def test_prefill_first_tokens_match_colocated(cluster: dict[str, Any]) -> None:
    model, pf = cluster["model"], cluster["proxy2"]
    prompts = PROMPTS[:8]
    baseline = [complete(cluster["prefill"], _body(model, p, False)) for p in prompts]
    fault_base = [complete(cluster["prefill"], _body(model, p, False)) for p in PF_FAULT_PROMPTS]
    since = log_sizes(cluster)
    pd = [complete(pf, _body(model, p, False)) for p in prompts]
    streamed = [stream(pf, _body(model, p, True)) for p in prompts]
    assert [a.token_ids for a in pd] == [a.token_ids for a in baseline]
    assert pd == baseline and streamed == baseline
    assert [line for b in BAD for line in log_lines(cluster, since, b)] == []
    # Readiness lost on the way (the prefill's faults): decode recomputes, tokens identical.
    since = log_sizes(cluster)
    assert [complete(pf, _body(model, p, False)) for p in PF_FAULT_PROMPTS] == fault_base
    assert len(log_lines(cluster, since, "blocks failed to load")) == 2
    assert log_lines(cluster, since, "Traceback") == []
    fetched = _until_metric(cluster["prefill"], "registrations_fetched_total", 2 * len(prompts) + 3)
    assert fetched >= 2 * len(prompts) + 3


def test_prefill_first_registration_never_comes_or_is_refused(cluster: dict[str, Any]) -> None:
    """Straight to the prefill, as a prefill-first proxy would send it: a metaserver that never
    answers (the blocks are held until registration_wait_s, then freed and counted), one that
    refuses the fetch (freed at once), and a malformed ticket (a plain prefill, the error in
    its answer). The engine keeps serving and ends holding nothing."""
    url, model = cluster["prefill"], cluster["model"]
    expired, refused = _rd2h(url, "registrations_expired_total"), _rd2h(url, "registrations_refused_total")

    def ticket(metaserver: str) -> dict[str, Any]:
        b = _body(model, PROMPTS[3], False)
        b["max_tokens"] = 1
        b["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False,
                                   "metaserver": metaserver, "proxy_request_id": "px-none",
                                   "registration_token": "t" * 32}
        return b

    for meta in (f"http://127.0.0.1:{free_port()}/v1/metaserver", f"{cluster['proxy2']}/v1/metaserver"):
        r = httpx.post(f"{url}/v1/completions", json=ticket(meta), timeout=120)
        assert r.status_code == 200, r.text
    r = httpx.post(f"{url}/v1/completions", json=ticket("ftp://127.0.0.1/x"), timeout=120)
    assert r.status_code == 200 and "invalid fetch ticket" in r.json()["kv_transfer_params"]["remote_d2h_error"]
    assert _until_metric(url, "registrations_expired_total", expired + 1) == expired + 1
    assert _until_metric(url, "registrations_refused_total", refused + 1) == refused + 1
    complete(url, _body(model, PROMPTS[0], False))  # a step after the free refreshes the gauges
    assert _rd2h(url, "awaiting_registrations") == 0
    assert idle_state(url, 60) == (0.0, 0.0, 0.0)


def test_prefill_killed_client_error_and_decode_holds_nothing(cluster: dict[str, Any]) -> None:
    cluster["servers"]["prefill"].stop()
    r = httpx.post(f"{cluster['proxy']}/v1/completions", json=_body(cluster["model"], PROMPTS[2], False),
                   timeout=120)
    assert r.status_code in (502, 503, 504), r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["code"] == r.status_code
    state = idle_state(cluster['decode'], 60)
    assert state == (0.0, 0.0, 0.0), f"decode still holds (running, waiting, kv usage) = {state}"
