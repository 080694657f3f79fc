"""Layer sharing on the prefill *and* P/D pulls: ``AscendMultiConnector`` on vLLM CPU.

The prefill runs ``AscendStoreConnector`` with ``use_layerwise`` (8 layers, I = [0],
B = 1: the 7 other layers time-share ONE physical buffer, so layer i's buffer is
rewritten by layer i + 1 within the same forward) together with the
``SfaRemoteD2HConnector`` producer; decode pulls every layer over Mooncake TCP.
Decode reads of a layer must therefore hold its buffer (reuse gate) until
decode answered. Without that, decode reads a later layer's KV and the tokens
change; with it, tokens equal the plain answer (decode server, no transfer)
for prompts of 40-1300 tokens, streaming and not, and decode logs no load failure.

Fault: the prefill's test-only injection drops layer 2's readiness for 7-block
prompts. Decode never reads layer 2, so its gate token is held until the
producer's ack deadline (20 s), longer than the store's own gate wait (5 s):
the prefill must outwait it (not fail its forward), decode recomputes, tokens
stay identical and the prefill keeps serving.
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
LENGTHS = [40, 1300, 333, 97, 760, 512, 64, 900]
PROMPTS = random_prompts(len(LENGTHS), LENGTHS, seed=23)
MAX_TOKENS = 12
FAULTS = "drop:2@7"  # by block count; no prompt above has 7 blocks
FAULT_PROMPT = random_prompts(1, [210], seed=3)[0]  # 7 blocks of 32
STARTUP_S = 600.0
BAD = ("Recovered from KV load failure", "blocks failed to load", "decode did not read", "cannot send",
       "cannot receive", "Traceback", "has no reuse-gate token")


def prefill_config(kv_port: int, rd2h_extra: dict[str, Any]) -> dict[str, Any]:
    store = {"use_layerwise": True, "layerwise_num_shared_buffers": 1, "layerwise_independent_layers": [0],
             "layerwise_prefetch_layers": 1, "local": {"capacity_bytes": 256 << 20}, "save_timeout_s": 5.0,
             "load_timeout_s": 60.0}
    return {
        "kv_connector": "AscendMultiConnector", "kv_role": "kv_producer", "kv_port": kv_port,
        "kv_connector_module_path": "ascend_offload.connectors.multi",
        "kv_connector_extra_config": {"connectors": [
            {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
             "kv_connector_module_path": "ascend_offload.connectors.store", "kv_connector_extra_config": store},
            {"kv_connector": "SfaRemoteD2HConnector", "kv_role": "kv_producer", "kv_port": kv_port,
             "kv_load_failure_policy": "recompute",
             "kv_connector_module_path": "ascend_offload.connectors.remote_d2h",
             "kv_connector_extra_config": rd2h_extra},
        ]},
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    model = tiny_model(8)
    log_dir = tmp_path_factory.mktemp("pd-layerwise-e2e")
    p_port, d_port, proxy_port = free_port(), free_port(), free_port()
    p_kv, d_kv = free_port(), free_port()
    env = dict(os.environ, VLLM_HOST_IP="127.0.0.1", VLLM_CPU_KVCACHE_SPACE="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    common = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "float32",
              "--block-size", str(BLOCK_SIZE), "--enforce-eager", "--max-model-len", "4096",
              "--seed", "0", "--host", "127.0.0.1"]
    extra = {"ack_timeout_s": 20, "request_timeout_s": 20, "registration_timeout_s": 20}
    decode_kv = {"kv_connector": "SfaRemoteD2HConnector", "kv_role": "kv_consumer", "kv_port": d_kv,
                 "kv_load_failure_policy": "recompute",
                 "kv_connector_module_path": "ascend_offload.connectors.remote_d2h",
                 "kv_connector_extra_config": extra}
    servers: list[Server] = []
    try:
        servers.append(Server("prefill", [*common, "--no-enable-prefix-caching", "--port", str(p_port),
                                          "--disable-hybrid-kv-cache-manager", "--kv-transfer-config",
                                          json.dumps(prefill_config(p_kv, extra))],
                              dict(env, VLLM_CPU_OMP_THREADS_BIND="0", ASCEND_OFFLOAD_PD_FAULTS=FAULTS), log_dir))
        servers.append(Server("decode", [*common, "--port", str(d_port), "--kv-transfer-config",
                                         json.dumps(decode_kv)], dict(env, VLLM_CPU_OMP_THREADS_BIND="1"), log_dir))
        servers.append(Server("proxy", [sys.executable, "-m", "proxy.cli", "--host", "127.0.0.1", "--port",
                                        str(proxy_port), "--prefiller-hosts", "127.0.0.1", "--prefiller-ports",
                                        str(p_port), "--decoder-hosts", "127.0.0.1", "--decoder-ports",
                                        str(d_port)], env, log_dir))
        deadline = time.monotonic() + STARTUP_S
        for port in (p_port, d_port, proxy_port):
            wait_health(f"http://127.0.0.1:{port}/health", servers, deadline)
        yield {"model": model, "proxy": f"http://127.0.0.1:{proxy_port}", "decode": f"http://127.0.0.1:{d_port}",
               "servers": {s.name: s for s in servers}}
    finally:
        for s in reversed(servers):
            s.stop()


def _body(model: str, prompt: list[int], stream: bool) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "stream": stream}


def _complete(url: str, body: dict[str, Any]) -> str:
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _stream(url: str, body: dict[str, Any]) -> str:
    text = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=180) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text.extend(ch.get("text", "") for ch in json.loads(line[6:]).get("choices", []))
    return "".join(text)


def test_layer_sharing_prefill_with_pd_pull_matches_plain(cluster: dict[str, Any]) -> None:
    model = cluster["model"]
    prefill = cluster["servers"]["prefill"]
    assert "decode reads of each layer hold its physical buffer (8 layers on 2 buffers)" in prefill.text()
    since = {name: len(s.text()) for name, s in cluster["servers"].items()}
    # Plain answers from the decode server itself (no transfer involved).
    baseline = [_complete(cluster["decode"], _body(model, p, False)) for p in PROMPTS]
    pd = [_complete(cluster["proxy"], _body(model, p, False)) for p in PROMPTS]
    assert pd == baseline
    streamed = [_stream(cluster["proxy"], _body(model, p, True)) for p in PROMPTS[:3]]
    assert streamed == baseline[:3]
    bad = [line for name, s in cluster["servers"].items() for line in s.text()[since[name]:].splitlines()
           if any(b in line for b in BAD)]
    assert bad == []


def test_unanswered_layer_holds_its_buffer_until_the_ack_deadline(cluster: dict[str, Any]) -> None:
    model = cluster["model"]
    since = {name: len(s.text()) for name, s in cluster["servers"].items()}
    t0 = time.monotonic()
    pd = _complete(cluster["proxy"], _body(model, FAULT_PROMPT, False))
    elapsed = time.monotonic() - t0
    # Baseline afterwards: asked first, decode would hold the prompt's blocks in its
    # prefix cache and pull only the last one (the fault matches 7-block pulls).
    assert pd == _complete(cluster["decode"], _body(model, FAULT_PROMPT, False))

    def lines(name: str, needle: str) -> list[str]:
        return [ln for ln in cluster["servers"][name].text()[since[name]:].splitlines() if needle in ln]

    assert lines("decode", "blocks failed to load")  # decode gave up on the request: recomputed
    assert lines("prefill", "Traceback") == [] and lines("prefill", "GateTimeout") == []
    assert elapsed >= 15, elapsed  # decode's request deadline: the pull really failed
    # The prefill still serves, and the layers of the next request are not held back.
    assert _complete(cluster["proxy"], _body(model, PROMPTS[3], False)) == \
        _complete(cluster["decode"], _body(model, PROMPTS[3], False))
