from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import pytest

from ascend_offload.pd.registration import (
    DecodeRegistration,
    ParamsError,
    Registrar,
    RegistrationError,
    register,
)
from proxy.bodies import SharedBody
from proxy.registration import RegisteredParams


class Meta:
    """A tiny metaserver: answers from a script of status codes, records bodies."""

    def __init__(self, port: int = 0, script: list[int] | None = None) -> None:
        self.script = list(script or [])
        self.bodies: list[dict] = []
        owner = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.bodies.append(body)
                code = owner.script.pop(0) if owner.script else 200
                data = json.dumps({"status": "dispatched"} if code == 200 else {"error": code}).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/metaserver"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def meta():
    made = []

    def make(**kw):
        made.append(Meta(**kw))
        return made[-1]

    yield make
    for m in made:
        m.close()


def test_retries_5xx_then_succeeds(meta):
    m = meta(script=[503, 500])
    out = register(m.url, "px-1", {"remote_host": "h", "remote_port": 5}, timeout_s=5, retries=3, backoff_s=0.01)
    assert out == {"status": "dispatched"}
    assert len(m.bodies) == 3
    assert m.bodies[0] == {"proxy_request_id": "px-1", "kv_transfer_params": {"remote_host": "h", "remote_port": 5}}


def test_4xx_is_final(meta):
    m = meta(script=[404])
    with pytest.raises(RegistrationError, match="HTTP 404"):
        register(m.url, "px-2", {}, timeout_s=5, retries=5, backoff_s=0.01)
    assert len(m.bodies) == 1


def test_retries_exhausted_names_last_error(meta):
    m = meta(script=[503, 503, 503])
    with pytest.raises(RegistrationError, match=r"after 2 attempt\(s\).*HTTP 503"):
        register(m.url, "px-3", {}, timeout_s=5, retries=1, backoff_s=0.01)


def test_unreachable_then_up_succeeds(port):
    url = f"http://127.0.0.1:{port}/v1/metaserver"
    started: list[Meta] = []
    timer = threading.Timer(0.4, lambda: started.append(Meta(port=port)))
    timer.start()
    try:
        out = register(url, "px-4", {"a": 1}, timeout_s=10, retries=20, backoff_s=0.05, max_backoff_s=0.2)
        assert out["status"] == "dispatched"
        assert started and started[0].bodies[0]["proxy_request_id"] == "px-4"
    finally:
        timer.join()
        for m in started:
            m.close()


def test_deadline_bounds_unreachable(port):
    with pytest.raises(RegistrationError, match=r"Connect(Error|Timeout)") as info:
        register(f"http://127.0.0.1:{port}/v1/metaserver", "px-5", {}, timeout_s=0.5, retries=100,
                 backoff_s=0.05, max_backoff_s=0.4)
    # the deadline, not the retry budget, ended it
    attempts = int(re.search(r"after (\d+) attempt", str(info.value)).group(1))
    assert attempts < 101


def test_bad_arguments():
    with pytest.raises(RegistrationError, match="http"):
        register("tcp://x", "a", {})
    with pytest.raises(RegistrationError, match="proxy_request_id"):
        register("http://127.0.0.1:1/v1/metaserver", "", {})


def test_registrar_runs_in_background(meta):
    m = meta(script=[503])
    reg = Registrar(timeout_s=5, retries=3)
    try:
        reg.submit("req-1", m.url, "px-6", {"x": 1})
        reg.submit("req-2", m.url.replace("metaserver", "nope").replace(str(m.server.server_address[1]), "1"),
                   "px-7", {})
        end = time.monotonic() + 10
        done: dict = {}
        while len(done) < 2 and time.monotonic() < end:
            done.update(reg.poll())
            time.sleep(0.02)
        assert done["req-1"] is None
        assert isinstance(done["req-2"], RegistrationError)
    finally:
        reg.close()


def test_registration_struct_round_trips_through_the_proxy_contract():
    """Decode's struct -> registered JSON -> the proxy's prefill body -> prefill's parse."""
    reg = DecodeRegistration(remote_engine_id="D0", remote_host="10.0.0.2", remote_port=7000, remote_tp_size=2,
                             remote_dp_rank=1, remote_request_id="dec-1", remote_block_ids=[3, 4],
                             remote_block_offset=2, transfer_protocol="memfabric/device_rdma")
    wire = reg.to_wire()
    assert sorted(wire) == sorted(["remote_engine_id", "remote_host", "remote_port", "remote_tp_size",
                                   "remote_dp_rank", "remote_request_id", "remote_block_ids",
                                   "remote_block_offset", "transfer_protocol"])
    registered = msgspec.to_builtins(msgspec.json.decode(json.dumps(wire), type=RegisteredParams))
    sub = {"prompt": "x"}
    body = json.loads(b"".join(SharedBody(sub, "/v1/completions").prefill_payload(sub, registered)._value))
    assert DecodeRegistration.from_params(body["kv_transfer_params"]) == reg


def test_registration_struct_rejects_unknown_and_malformed_keys():
    ok = {"remote_host": "h", "remote_port": 1, "remote_request_id": "r", "remote_block_ids": []}
    assert DecodeRegistration.from_params({**ok, "do_remote_decode": True}).remote_tp_size == 1
    with pytest.raises(ParamsError, match="unknown field `metaserver`"):
        DecodeRegistration.from_params({**ok, "metaserver": "http://x"})
    with pytest.raises(ParamsError, match=r"\$\.remote_block_offset"):
        DecodeRegistration.from_params({**ok, "remote_block_offset": -1})


def test_a_deadline_already_past_still_makes_one_attempt(port):
    """A loaded host may use up a short deadline before the first attempt: the error is then
    that attempt's (a connect error naming the URL), never a bare 'no attempt made'."""
    with pytest.raises(RegistrationError, match=r"after 1 attempt\(s\).*Connect(Error|Timeout)"):
        register(f"http://127.0.0.1:{port}/v1/metaserver", "px-9", {}, timeout_s=0.0, retries=3)
