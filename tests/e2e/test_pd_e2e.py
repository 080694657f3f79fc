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

Faults use the prefill's test-only injection (``ASCEND_OFFLOAD_PD_FAULTS``):
requests of 6 blocks get an invalid layer-1 readiness (decode answers
``read_failed`` at once), requests of 7 blocks lose layer 2's readiness (decode's
request deadline). Both must end as load errors that vLLM recomputes, with
tokens still identical. Last, the prefill server is killed: the client gets an
OpenAI-style error and decode ends with no request and no KV block held.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mooncake.engine")
httpx = pytest.importorskip("httpx")

from ascend_offload.testing.servers import Server, free_port, wait_health  # noqa: E402
from ascend_offload.testing.tiny_model import random_prompts  # noqa: E402
from tests.e2e.harness import BLOCK_SIZE, tiny_model  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
LENGTHS = [50, 1500, 333, 97, 760, 1024, 64, 420, 1200, 150, 999, 77, 512, 1350, 240, 880, 55, 640, 1111, 300]
PROMPTS = random_prompts(20, LENGTHS, seed=11)
FAULTS = "invalid:1@6,drop:2@7"  # by block count; no prompt above has 6 or 7 blocks
FAULT_PROMPTS = random_prompts(3, [180, 220, 130], seed=5)  # 6, 7 and 5 blocks
MAX_TOKENS = 16
STARTUP_S = 600.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    model = tiny_model(4)
    log_dir = tmp_path_factory.mktemp("pd-e2e")
    p_port, d_port, proxy_port = free_port(), free_port(), free_port()
    p_kv, d_kv = free_port(), free_port()
    env = dict(os.environ, VLLM_HOST_IP="127.0.0.1", VLLM_CPU_KVCACHE_SPACE="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    common = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "float32",
              "--block-size", str(BLOCK_SIZE), "--enforce-eager", "--max-model-len", "4096",
              "--seed", "0", "--host", "127.0.0.1"]
    extra = {"ack_timeout_s": 20, "request_timeout_s": 10, "registration_timeout_s": 20}

    def kv(role: str, port: int) -> str:
        return json.dumps({"kv_connector": "SfaRemoteD2HConnector", "kv_role": role, "kv_port": port,
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_module_path": "ascend_offload.connectors.remote_d2h",
                           "kv_connector_extra_config": extra})

    servers: list[Server] = []
    try:
        # Prefill (also the colocated baseline) without prefix caching; decode with it,
        # so repeated prompts pull only the blocks decode does not hold yet.
        servers.append(Server("prefill", [*common, "--no-enable-prefix-caching", "--port", str(p_port),
                                          "--kv-transfer-config",
                                          kv("kv_producer", p_kv)],
                              dict(env, VLLM_CPU_OMP_THREADS_BIND="0", ASCEND_OFFLOAD_PD_FAULTS=FAULTS), log_dir))
        servers.append(Server("decode", [*common, "--port", str(d_port), "--kv-transfer-config",
                                         kv("kv_consumer", d_kv)], dict(env, VLLM_CPU_OMP_THREADS_BIND="1"), log_dir))
        servers.append(Server("proxy", [sys.executable, "-m", "proxy.cli", "--host", "127.0.0.1", "--port",
                                        str(proxy_port), "--prefiller-hosts", "127.0.0.1", "--prefiller-ports",
                                        str(p_port), "--decoder-hosts", "127.0.0.1", "--decoder-ports",
                                        str(d_port)], env, log_dir))
        deadline = time.monotonic() + STARTUP_S
        for port in (p_port, d_port, proxy_port):
            wait_health(f"http://127.0.0.1:{port}/health", servers, deadline)
        yield {"model": model, "prefill": f"http://127.0.0.1:{p_port}", "proxy": f"http://127.0.0.1:{proxy_port}",
               "decode": f"http://127.0.0.1:{d_port}", "servers": {s.name: s for s in servers}}
    finally:
        for s in reversed(servers):
            s.stop()


def _body(model: str, prompt: list[int], stream: bool) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "stream": stream, "return_token_ids": True}


def _complete(url: str, body: dict[str, Any]) -> str:
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _stream(url: str, body: dict[str, Any]) -> str:
    text = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=180) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for ch in json.loads(line[6:]).get("choices", []):
                text.append(ch.get("text", ""))
    return "".join(text)


BAD = ("Recovered from KV load failure", "blocks failed to load", "decode did not read", "cannot send",
       "cannot receive", "Traceback")


def _log_sizes(cluster: dict[str, Any]) -> dict[str, int]:
    return {name: len(s.text()) for name, s in cluster["servers"].items()}


def _log_lines(cluster: dict[str, Any], since: dict[str, int], needle: str) -> list[str]:
    return [line for name, s in cluster["servers"].items() for line in s.text()[since[name]:].splitlines()
            if needle in line]


def test_pd_tokens_match_colocated(cluster: dict[str, Any]) -> None:
    model = cluster["model"]
    since = _log_sizes(cluster)
    baseline = [_complete(cluster["prefill"], _body(model, p, False)) for p in PROMPTS]
    pd = [_complete(cluster["proxy"], _body(model, p, False)) for p in PROMPTS]
    assert pd == baseline
    hits = _metric(httpx.get(f"{cluster['decode']}/metrics", timeout=10).text, "vllm:prefix_cache_hits_total")
    # Same prompts again: decode has their full blocks cached and pulls only the rest
    # (remote_block_offset > 0 on the wire).
    streamed = [_stream(cluster["proxy"], _body(model, p, True)) for p in PROMPTS]
    assert streamed == baseline
    hits2 = _metric(httpx.get(f"{cluster['decode']}/metrics", timeout=10).text, "vllm:prefix_cache_hits_total")
    assert hits2 - hits >= sum(len(p) // BLOCK_SIZE for p in PROMPTS) * BLOCK_SIZE - len(PROMPTS) * BLOCK_SIZE
    assert [line for b in BAD for line in _log_lines(cluster, since, b)] == []


def test_invalid_and_dropped_messages_recompute_identically(cluster: dict[str, Any]) -> None:
    model = cluster["model"]
    baseline = [_complete(cluster["prefill"], _body(model, p, False)) for p in FAULT_PROMPTS]
    since = _log_sizes(cluster)
    pd = [_complete(cluster["proxy"], _body(model, p, False)) for p in FAULT_PROMPTS]
    assert pd == baseline
    failed = _log_lines(cluster, since, "blocks failed to load")
    assert len(failed) == 2, failed  # the 6- and the 7-block prompt; the 5-block one transferred
    assert any("read_failed" in line or "invalid" in line for line in failed), failed
    assert any("timeout" in line for line in failed), failed
    assert _log_lines(cluster, since, "Recovered from KV load failure")
    assert _log_lines(cluster, since, "Traceback") == []


def _metric(text: str, name: str) -> float:
    vals = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(name + "{") or line.startswith(name + " ")]
    assert vals, f"metric {name} missing"
    return sum(vals)


def test_prefill_killed_client_error_and_decode_holds_nothing(cluster: dict[str, Any]) -> None:
    cluster["servers"]["prefill"].stop()
    r = httpx.post(f"{cluster['proxy']}/v1/completions", json=_body(cluster["model"], PROMPTS[2], False),
                   timeout=120)
    assert r.status_code in (502, 503, 504), r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["code"] == r.status_code
    deadline = time.monotonic() + 60
    while True:
        text = httpx.get(f"{cluster['decode']}/metrics", timeout=10).text
        state = (_metric(text, "vllm:num_requests_running"), _metric(text, "vllm:num_requests_waiting"),
                 _metric(text, "vllm:kv_cache_usage_perc"))
        if state == (0.0, 0.0, 0.0) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert state == (0.0, 0.0, 0.0), f"decode still holds (running, waiting, kv usage) = {state}"
