"""Fast checks of ``bench e2e-pd`` without vLLM: the MooncakeConnector toy proxy's flow and the client timing.

The full bench starts five vLLM servers (minutes); here the Mooncake proxy runs
as its real subprocess in front of stdlib fake backends, so the request shapes
MooncakeConnector relies on (shared ``transfer_id``, prefill ``do_remote_decode``
with ``max_tokens 1``, decode ``do_remote_prefill`` with the prefill's engine id
and bootstrap address) and the streamed token/TTFT parsing are checked in seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("aiohttp")

from ascend_offload.bench import e2e_pd  # noqa: E402
from ascend_offload.harness.servers import free_port  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
ROOT = Path(__file__).resolve().parents[2]


class _Fake(BaseHTTPRequestHandler):
    """Prefill answers JSON; decode streams three token chunks. Bodies are recorded per server."""

    seen: list[dict[str, Any]]
    kind: str

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append(body)  # type: ignore[attr-defined]
        if self.server.kind == "prefill":  # type: ignore[attr-defined]
            data = json.dumps({"choices": [{"text": "t5", "token_ids": [5]}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for tok in (7, 8, 9):
            chunk = {"choices": [{"index": 0, "text": f" t{tok}", "token_ids": [tok]}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.01)
        self.wfile.write(b"data: [DONE]\n\n")


def _serve(kind: str) -> ThreadingHTTPServer:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    srv.kind = kind  # type: ignore[attr-defined]
    srv.seen = []  # type: ignore[attr-defined]
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def test_mooncake_proxy_flow_and_client_timing() -> None:
    pre, dec = _serve("prefill"), _serve("decode")
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ascend_offload.bench.e2e_pd",
            "--mooncake-proxy",
            "--port",
            str(port),
            "--prefill",
            f"http://127.0.0.1:{pre.server_port}",
            "--decode",
            f"http://127.0.0.1:{dec.server_port}",
            "--engine-id",
            "eng-p",
            "--bootstrap",
            "http://127.0.0.1:1234",
        ],
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "toy proxy did not start"
            assert proc.poll() is None, "toy proxy exited"
            time.sleep(0.2)
        with httpx.Client() as client:
            res = e2e_pd._stream_one(
                client, f"http://127.0.0.1:{port}", e2e_pd._body("m", [3, 4, 5], 3)
            )
        assert res.error is None, res.error
        assert res.tokens == [7, 8, 9]
        assert res.ttft_ms > 0 and res.tpot_ms > 0
        # Per-chunk arrival times (for per-request timelines): one per token chunk, in order.
        assert (
            len(res.chunk_ms) == 3 and res.chunk_ms == sorted(res.chunk_ms) and res.start_unix > 0
        )
        deadline = time.monotonic() + 10
        while not pre.seen and time.monotonic() < deadline:  # type: ignore[attr-defined]
            time.sleep(0.05)
        (p_body,), (d_body,) = pre.seen, dec.seen  # type: ignore[attr-defined]
        assert p_body["max_tokens"] == 1 and p_body["stream"] is False
        assert p_body["kv_transfer_params"]["do_remote_decode"] is True
        dk = d_body["kv_transfer_params"]
        assert dk["do_remote_prefill"] is True and dk["remote_engine_id"] == "eng-p"
        assert dk["remote_bootstrap_addr"] == "http://127.0.0.1:1234"
        assert dk["transfer_id"] == p_body["kv_transfer_params"]["transfer_id"]
        assert d_body["max_tokens"] == 3 and d_body["prompt"] == [3, 4, 5]
    finally:
        proc.terminate()
        proc.wait(10)
        pre.shutdown()
        dec.shutdown()


def test_percentile_and_report() -> None:
    assert e2e_pd._pct([3.0, 1.0, 2.0, float("nan")], 0.5) == 2.0
    s = {
        "ttft_ms": {"median": 1.0, "p90": 2.0},
        "tpot_ms": {"median": 0.5, "p90": 0.6},
        "parity": "1/1",
        "errors": 0,
        "bad_log_count": 0,
        "loadavg_start": 1.0,
        "loadavg_end": 1.5,
        "cpu_ms_per_request": {"prefill": 4.0, "decode": 6.5, "total": 10.5},
    }
    text = e2e_pd.report(
        {
            "setups": {"ours": s},
            "ratios": {"ours/mooncake TTFT median": 0.9},
            "target_ttft_ours_le_mooncake": True,
            "target_ttft_ratio": 0.8,
            "target_ttft_ratio_met": False,
        }
    )
    assert "ours" in text and "met" in text and "<= 0.8): NOT met" in text
    assert "ours: CPU ms per request 10.5 (prefill 4.0, decode 6.5)" in text


def test_group_cpu_counts_every_process_of_the_group() -> None:
    """A child in a process group of its own burns CPU: its group's count grows by about
    that much, and a group with no process counts 0."""
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ninput()"
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, process_group=0)
    try:
        pgid = child.pid
        deadline = time.monotonic() + 60
        while (used := e2e_pd.group_cpu_s([pgid])[pgid]) < 0.3:
            assert time.monotonic() < deadline, used
            time.sleep(0.05)
        assert used < 5.0  # the burn and the interpreter's start, not another group's time
        assert e2e_pd.group_cpu_s([2**22 + 7]) == {2**22 + 7: 0.0}
    finally:
        child.communicate(b"\n", timeout=60)


def test_block_order_alternates_rounds() -> None:
    # Every round visits each setup once; the first setup of a round rotates.
    assert e2e_pd.block_order(["ours", "mooncake"], 3) == [
        (0, "ours"),
        (0, "mooncake"),
        (1, "mooncake"),
        (1, "ours"),
        (2, "ours"),
        (2, "mooncake"),
    ]
    assert e2e_pd.block_order(["colocated"], 2) == [(0, "colocated"), (1, "colocated")]
