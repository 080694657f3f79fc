"""The proxy CLI and fake backends as separate processes on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ascend_offload.bench.proxy import spawn_server

pytestmark = pytest.mark.integration

FB = "ascend_offload.harness.fake_backends"


def _http(url: str, body: Any = None, timeout: float = 30.0) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _state(port: int) -> dict[str, Any]:
    return json.loads(_http(f"http://127.0.0.1:{port}/_fake/state")[1])


def _wait(pred: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return bool(pred())


class Procs:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, args: list[str]) -> tuple[subprocess.Popen[str], int]:
        proc, port = spawn_server(args, "ready on port")
        self.procs.append(proc)
        return proc, port

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)


@pytest.fixture
def procs() -> Iterator[Procs]:
    ps = Procs()
    try:
        yield ps
    finally:
        ps.stop()


def _proxy(procs: Procs, pre_port: int, dec_port: int, *extra: str) -> tuple[subprocess.Popen[str], int]:
    return procs.start(
        ["-m", "proxy.cli", "--port", "0", "--prefiller-ports", str(pre_port),
         "--decoder-ports", str(dec_port), "--log-level", "WARNING", *extra]
    )


def test_cli_proxy_serves_and_survives_a_killed_prefill(procs: Procs) -> None:
    pre, pre_port = procs.start(["-m", FB, "--role", "prefill"])
    _, dec_port = procs.start(["-m", FB, "--role", "decode", "--wait-kv"])
    prx, port = _proxy(procs, pre_port, dec_port, "--timeout-s", "20")
    base = f"http://127.0.0.1:{port}"

    status, raw = _http(base + "/v1/completions", {"prompt": "a b", "max_tokens": 16})
    assert status == 200, raw
    assert len(json.loads(raw)["choices"][0]["text"].split()) == 16
    status, raw = _http(base + "/v1/completions", {"prompt": ["a", "b"], "stream": True})
    assert status == 200
    assert raw.endswith(b"data: [DONE]\n\n") and raw.count(b"[DONE]") == 1
    assert len(_state(pre_port)["received"]) == 3

    pre.kill()
    pre.wait(timeout=10)
    status, raw = _http(base + "/v1/completions", {"prompt": "c", "stream": True})
    assert status == 503
    err = json.loads(raw)["error"]
    assert err["code"] == 503 and "prefill" in err["message"]
    assert _wait(lambda: _state(dec_port)["stats"]["aborted"] == 1)
    health = json.loads(_http(base + "/health")[1])
    assert health["pending"] == 0

    prx.send_signal(signal.SIGTERM)
    assert prx.wait(timeout=15) == 0


def test_decode_killed_mid_request_gives_502(procs: Procs) -> None:
    _, pre_port = procs.start(["-m", FB, "--role", "prefill"])
    dec, dec_port = procs.start(["-m", FB, "--role", "decode", "--fault", "hang"])
    _, port = _proxy(procs, pre_port, dec_port)
    base = f"http://127.0.0.1:{port}"

    result: dict[str, Any] = {}

    def call() -> None:
        result["status"], result["raw"] = _http(base + "/v1/completions", {"prompt": "x", "stream": True})

    import threading

    t = threading.Thread(target=call)
    t.start()
    assert _wait(lambda: _state(dec_port)["stats"]["requests"] == 1)
    dec.kill()
    t.join(timeout=30)
    assert not t.is_alive()
    assert result["status"] == 502, result
    assert json.loads(result["raw"])["error"]["code"] == 502
    assert json.loads(_http(base + "/health")[1])["pending"] == 0
    # nothing was dispatched to the prefill (decode never registered)
    assert _state(pre_port)["received"] == []


def test_console_script_entry_point() -> None:
    exe = Path(sys.executable).with_name("ascend-offload-proxy")
    if not exe.exists():
        pytest.skip("package not installed in this environment (console script missing)")
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ))
    assert out.returncode == 0 and "--decoder-ports" in out.stdout


def test_cli_metaserver_on_an_internal_listener(procs: Procs) -> None:
    from ascend_offload.harness.servers import free_port

    meta_port = free_port()
    _, pre_port = procs.start(["-m", FB, "--role", "prefill"])
    _, dec_port = procs.start(["-m", FB, "--role", "decode", "--wait-kv"])
    _, port = _proxy(procs, pre_port, dec_port, "--metaserver-host", "127.0.0.1",
                     "--metaserver-port", str(meta_port))
    base = f"http://127.0.0.1:{port}"
    status, raw = _http(base + "/v1/completions", {"prompt": "a b", "max_tokens": 4})
    assert status == 200, raw
    (sent,) = _state(dec_port)["received"]
    kv = sent["kv_transfer_params"]
    assert kv["metaserver"] == f"http://127.0.0.1:{meta_port}/v1/metaserver" and kv["registration_token"]
    # The public listener does not take registrations.
    msg = {"proxy_request_id": kv["proxy_request_id"], "registration_token": kv["registration_token"],
           "kv_transfer_params": {}}
    assert _http(base + "/v1/metaserver", msg)[0] in (404, 405)


def test_cli_refuses_an_out_of_range_port() -> None:
    out = subprocess.run([sys.executable, "-m", "proxy.cli", "--port", "70000", "--prefiller-ports", "1",
                          "--decoder-ports", "2"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "got 70000" in out.stderr
