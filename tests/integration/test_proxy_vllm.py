"""The proxy in front of a real vLLM CPU OpenAI server (no P/D connector).

A decode without a connector ignores ``do_remote_prefill`` and answers by
itself, so this checks what only a real server can: the relayed stream and
the merged fan-out are exactly what vLLM answers directly (including seeded
sampling with ``n > 1``, because the proxy derives per-sample seeds as vLLM
does), vLLM's own errors pass through unchanged, and closing the proxy's
backend connection makes vLLM abort the request.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from ascend_offload.bench.proxy import spawn_server

pytestmark = [pytest.mark.integration, pytest.mark.e2e]

MODEL_CACHE = Path(os.environ.get("ASCEND_OFFLOAD_TEST_MODELS", "/tmp/ascend-offload-test-models"))
STARTUP_S = 600.0  # vLLM start on 2 shared cores; a hang guard, not a threshold


def dead_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: Any) -> tuple[int, str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from ascend_offload.harness.tiny_model import make_tiny_llama

    model = str(make_tiny_llama(MODEL_CACHE / "tiny-llama-4l", num_layers=4))
    tmp = tmp_path_factory.mktemp("vllm")
    template = tmp / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    port = dead_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0")
    log = open(tmp / "vllm.log", "w")
    vllm = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
         "--dtype", "float32", "--block-size", "32", "--enforce-eager", "--max-model-len", "2048",
         "--seed", "0", "--port", str(port), "--chat-template", str(template)],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )
    proxy = None
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            try:
                _get(f"http://127.0.0.1:{port}/health")
                break
            except OSError:
                if vllm.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    pytest.fail("vLLM server did not start:\n" + (tmp / "vllm.log").read_text()[-3000:])
                time.sleep(1)
        # The prefill address is never used: without a connector the decode never registers.
        proxy, pport = spawn_server(
            ["-m", "proxy.cli", "--port", "0", "--prefiller-ports", str(dead_port()),
             "--decoder-ports", str(port), "--log-level", "WARNING"],
            "ready on port",
        )
        yield {"model": model, "direct": f"http://127.0.0.1:{port}", "proxy": f"http://127.0.0.1:{pport}"}
    finally:
        for p in (proxy, vllm):
            if p is not None:
                p.terminate()
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
        log.close()


def _both(servers: dict[str, Any], path: str, body: dict[str, Any]) -> tuple[tuple[int, str], tuple[int, str]]:
    body = dict(body, model=servers["model"])
    return _post(servers["direct"] + path, body), _post(servers["proxy"] + path, body)


def _choices(raw: str) -> tuple[list[tuple[int, str]], Any]:
    j = json.loads(raw)
    out = [(c["index"], c.get("text", c.get("message", {}).get("content"))) for c in j["choices"]]
    return out, {k: j["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def _stream(raw: str, chat: bool = False) -> dict[Any, Any]:
    texts: dict[Any, Any] = {}
    assert raw.rstrip().endswith("data: [DONE]")
    for ev in raw.split("\n\n"):
        if not ev.startswith("data: ") or ev[6:] == "[DONE]":
            continue
        j = json.loads(ev[6:])
        for c in j["choices"]:
            piece = (c["delta"].get("content") or "") if chat else c["text"]
            texts[c["index"]] = texts.get(c["index"], "") + piece
        if j.get("usage"):
            texts["usage"] = {k: j["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    return texts


def test_non_stream_identical_to_direct(servers: dict[str, Any]) -> None:
    for body in (
        {"prompt": [5, 6, 7, 8, 9], "max_tokens": 8, "temperature": 0},
        {"prompt": "w1 w2 w3", "max_tokens": 8, "temperature": 0},
        # fan-out: prompt list x n with seeded sampling equals vLLM's own n > 1
        {"prompt": [[5, 6, 7], [9, 10, 11, 12]], "n": 2, "max_tokens": 6,
         "temperature": 1.0, "seed": 42},
        {"prompt": ["w7 w8", "w1", "w2 w3 w4"], "n": 3, "max_tokens": 5, "temperature": 0.8, "seed": 9},
    ):
        (sa, ra), (sb, rb) = _both(servers, "/v1/completions", body)
        assert sa == sb == 200, (ra, rb)
        assert _choices(ra) == _choices(rb), body


def test_stream_identical_to_direct(servers: dict[str, Any]) -> None:
    for body in (
        {"prompt": "w1 w2 w3", "max_tokens": 8, "temperature": 0, "stream": True},
        {"prompt": ["w1 w2", "w3"], "n": 2, "max_tokens": 8, "temperature": 1.0, "seed": 3,
         "stream": True, "stream_options": {"include_usage": True}},
    ):
        (sa, ra), (sb, rb) = _both(servers, "/v1/completions", body)
        assert sa == sb == 200
        assert _stream(ra) == _stream(rb), body


def test_chat_identical_to_direct(servers: dict[str, Any]) -> None:
    msgs = [{"role": "user", "content": "w1 w2 w3"}]
    (sa, ra), (sb, rb) = _both(servers, "/v1/chat/completions",
                               {"messages": msgs, "max_tokens": 6, "temperature": 0})
    assert sa == sb == 200
    assert _choices(ra) == _choices(rb)
    (sa, ra), (sb, rb) = _both(servers, "/v1/chat/completions",
                               {"messages": msgs, "max_tokens": 6, "temperature": 1.0, "seed": 5,
                                "n": 2, "stream": True})
    assert sa == sb == 200
    assert _stream(ra, chat=True) == _stream(rb, chat=True)


def test_vllm_errors_pass_through(servers: dict[str, Any]) -> None:
    (sa, ra), (sb, rb) = _both(servers, "/v1/completions", {"prompt": "w1", "max_tokens": 100000})
    assert sa == sb == 400
    assert json.loads(ra)["error"]["message"] == json.loads(rb)["error"]["message"]
    # a mixed prompt list is rejected by both (the proxy checks before fanning out)
    (sa, ra), (sb, rb) = _both(servers, "/v1/completions", {"prompt": ["w1", [5]], "max_tokens": 2})
    assert sa == sb == 400


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_client_disconnect_aborts_vllm_request(servers: dict[str, Any]) -> None:
    import http.client

    before = _metric(_get(servers["direct"] + "/metrics"), "vllm:generation_tokens_total")
    host, port = servers["proxy"].removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"model": servers["model"], "prompt": [5, 6, 7], "max_tokens": 1500, "ignore_eos": True,
            "temperature": 0, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.read1(1024).startswith(b"data: ")  # generation has started
    conn.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        metrics = _get(servers["direct"] + "/metrics")
        if _metric(metrics, "vllm:num_requests_running") == 0:
            break
        time.sleep(0.1)
    time.sleep(0.5)
    metrics = _get(servers["direct"] + "/metrics")
    assert _metric(metrics, "vllm:num_requests_running") == 0
    generated = _metric(metrics, "vllm:generation_tokens_total") - before
    assert generated < 1500  # stopped early: vLLM aborted it when the proxy closed the connection
    assert json.loads(_get(servers["proxy"] + "/health"))["pending"] == 0
