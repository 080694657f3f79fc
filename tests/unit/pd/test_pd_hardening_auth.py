"""The control plane's CURVE authentication checks the client's key too (a ZAP handler on
the decode's own ZMQ context), and the secret file is read as a Kubernetes Secret mount
gives it (symlinks followed), with a warning when others may read it.

Real ZMQ on 127.0.0.1; the intruder also runs as a separate process."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from ascend_offload.pd.auth import ServerAuth, derive_keys, load_keys
from ascend_offload.pd.consumer import Consumer
from ascend_offload.pd.producer import DecodeTarget, Producer
from ascend_offload.pd.topology import Topology
from ascend_offload.transfer.base import LoopbackEngine

WAIT = 10.0
TOPO = Topology(1, 1)
SECRET = b"correct horse battery staple"
HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
# A client that knows the server's public key but not the secret: its own key pair.
INTRUDER = """
import sys, zmq
from zmq.utils.monitor import recv_monitor_message
port, server_public, events, wait_ms = int(sys.argv[1]), sys.argv[2].encode(), int(sys.argv[3]), int(sys.argv[4])
s = zmq.Context.instance().socket(zmq.DEALER)
s.linger = 0
s.curve_publickey, s.curve_secretkey = zmq.curve_keypair()
s.curve_serverkey = server_public
mon = s.get_monitor_socket(events)
s.connect(f"tcp://127.0.0.1:{port}")
s.send(b"hello from an intruder")
print(zmq.Event(recv_monitor_message(mon)["event"]).name if mon.poll(wait_ms) else "NO_EVENT")
"""


def _first_handshake_event(sock: zmq.Socket, endpoint: str) -> str:
    mon = sock.get_monitor_socket(HANDSHAKE_EVENTS)
    try:
        sock.connect(endpoint)
        assert mon.poll(int(WAIT * 1000)), f"no handshake outcome within {WAIT}s"
        return zmq.Event(recv_monitor_message(mon)["event"]).name
    finally:
        sock.disable_monitor()
        mon.close(linger=0)


def _curve_client(ctx: zmq.Context, server_public: bytes, pair: tuple[bytes, bytes] | None = None) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    s.curve_publickey, s.curve_secretkey = pair or zmq.curve_keypair()
    s.curve_serverkey = server_public
    return s


class Sides:
    """A consumer and producers over loopback engines, closed in reverse order."""

    def __init__(self, make_kv: Any) -> None:
        self.make_kv = make_kv
        self.closers: list[Any] = []
        self.keep: list[Any] = []  # registered memory must outlive every read

    def consumer(self, port: int, **kw: Any) -> Consumer:
        dst, descs = self.make_kv(2, 8)
        eng = LoopbackEngine()
        cons = Consumer(engine_id="D", d_rank=0, topology=TOPO, transfer=eng, layers=descs, port=port, **kw)
        self.keep.append(dst)
        self.closers += [cons.close, eng.close]
        return cons

    def producer(self, engine_id: str, **kw: Any) -> Producer:
        src, descs = self.make_kv(2, 8, seed=1)
        eng = LoopbackEngine()
        prod = Producer(engine_id=engine_id, p_rank=0, topology=TOPO, transfer=eng, layers=descs,
                        listener=lambda release: None, **kw)
        self.keep.append(src)
        self.closers += [prod.close, eng.close]
        return prod

    def close(self) -> None:
        for c in reversed(self.closers):
            c()


@pytest.fixture
def sides(kv: Any) -> Any:
    s = Sides(kv)
    yield s
    s.close()


def _send_one(prod: Producer, cons: Consumer, port: int, rid: str, dst: int) -> bool:
    cons.expect(rid, [dst], num_layers=1)
    prod.add_request(rid, [2], DecodeTarget("127.0.0.1", port, 1), num_layers=1)
    prod.publish_layer(0)
    end = time.monotonic() + WAIT
    while time.monotonic() < end:
        for outcome in prod.finished():
            if outcome.request_id == rid:
                return bool(outcome.ok)
        time.sleep(0.01)
    raise AssertionError(f"send {rid!r} never finished within {WAIT}s")


def test_a_client_key_not_derived_from_the_secret_is_refused(sides: Sides, port: int) -> None:
    keys = derive_keys(SECRET)
    cons = sides.consumer(port, keys=keys)
    endpoint = f"tcp://127.0.0.1:{port}"
    # Another socket in this process, on the process-wide context: right server key, own key pair.
    intruder = _curve_client(zmq.Context.instance(), keys.server_public)
    try:
        assert _first_handshake_event(intruder, endpoint) == "HANDSHAKE_FAILED_AUTH"
    finally:
        intruder.close(linger=0)
    # Another process.
    out = subprocess.run([sys.executable, "-c", INTRUDER, str(port), keys.server_public.decode(),
                          str(HANDSHAKE_EVENTS), str(int(WAIT * 1000))],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "HANDSHAKE_FAILED_AUTH", out.stdout + out.stderr
    # The secret's holder still gets through, and nothing of the intruders arrived.
    member = sides.producer("M", keys=keys)
    assert _send_one(member, cons, port, "m", 5)
    assert cons.stats.items == 1 and cons.stats.rejected == 0


def test_the_derived_client_key_passes_the_handshake(sides: Sides, port: int) -> None:
    keys = derive_keys(SECRET)
    sides.consumer(port, keys=keys)
    ctx = zmq.Context()
    try:
        client = _curve_client(ctx, keys.server_public, (keys.client_public, keys.client_secret))
        try:
            assert _first_handshake_event(client, f"tcp://127.0.0.1:{port}") == "HANDSHAKE_SUCCEEDED"
        finally:
            client.close(linger=0)
    finally:
        ctx.term()


def test_the_handler_lives_on_a_context_of_its_own() -> None:
    """The process-wide context (vLLM's, other libraries') gets no ZAP handler: a CURVE
    server there still admits any client key, as before."""
    keys = derive_keys(SECRET)
    auth = ServerAuth(keys)
    shared = zmq.Context.instance()
    server = shared.socket(zmq.ROUTER)
    server.linger = 0
    try:
        assert auth.context is not shared and auth.check is not None
        server.curve_secretkey, server.curve_publickey = keys.server_secret, keys.server_public
        server.curve_server = True
        port = server.bind_to_random_port("tcp://127.0.0.1")
        client = _curve_client(shared, keys.server_public)
        try:
            assert _first_handshake_event(client, f"tcp://127.0.0.1:{port}") == "HANDSHAKE_SUCCEEDED"
        finally:
            client.close(linger=0)
    finally:
        server.close(linger=0)
        auth.close()
    plain = ServerAuth(None)
    assert plain.context is shared and plain.check is None
    plain.close()  # the shared context is not ours to end
    assert not shared.closed


# ----------------------------------------------------------------- the secret file


def _secret_mount(root: Path, mode: int) -> Path:
    """A Kubernetes Secret volume: ``secret -> ..data/secret``, ``..data -> ..<timestamp>``."""
    stamped = root / "..2026_01_01_00_00_00.000000001"
    stamped.mkdir()
    (stamped / "secret").write_bytes(SECRET + b"\n")
    os.chmod(stamped / "secret", mode)
    (root / "..data").symlink_to(stamped.name)
    link = root / "secret"
    link.symlink_to("..data/secret")
    return link


def test_a_symlinked_secret_mount_is_read_through_its_links(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    link = _secret_mount(tmp_path, 0o400)
    with caplog.at_level(logging.WARNING, logger="ascend_offload.pd.auth"):
        assert load_keys(str(link)) == derive_keys(SECRET)
    assert caplog.records == []


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_secret_others_may_read_is_used_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                         mode: int) -> None:
    link = _secret_mount(tmp_path, mode)
    with caplog.at_level(logging.WARNING, logger="ascend_offload.pd.auth"):
        assert load_keys(str(link)) == derive_keys(SECRET)
    (rec,) = caplog.records
    text = rec.getMessage()
    assert f"mode {mode:04o}" in text and str(link) in text and "..2026_01_01" in text
