"""A hostile or broken peer cannot hurt a prefill or decode engine: boundary checks of
decode's registration, per-endpoint send isolation, reads that always end, bounded
decode state and the authenticated control plane (real ZMQ on 127.0.0.1, loopback reads)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import zmq

from ascend_offload.pd import protocol as P
from ascend_offload.pd.auth import AuthError, derive_keys, load_keys
from ascend_offload.pd.consumer import Consumer
from ascend_offload.pd.prefill_requests import ERROR_KEY, PrefillRequests
from ascend_offload.pd.producer import DecodeTarget, Producer, SlotRelease
from ascend_offload.pd.topology import Topology
from ascend_offload.transfer.base import LoopbackEngine, ReadOp
from ascend_offload.transfer.mooncake import TIMEOUT_ENV, apply_read_deadline
from tests.support.clock import ManualClock

WAIT = 10.0
TOPO = Topology(1, 1)


def wait_until(pred: Callable[[], Any], what: str, timeout_s: float = WAIT) -> Any:
    """Poll ``pred`` until truthy; the raise names what never happened."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(0.01)
    raise AssertionError(f"never happened within {timeout_s}s: {what}")


class Side:
    """One producer and/or consumer over loopback engines, closed by the fixture."""

    def __init__(self, make_kv) -> None:
        self.make_kv = make_kv
        self.closers: list[Callable[[], None]] = []
        self.releases: list[SlotRelease] = []
        self.tensors: list[Any] = []  # registered memory must outlive every read

    def producer(self, engine_id: str = "P", **kw: Any) -> tuple[Producer, list]:
        src, descs = self.make_kv(2, 8, seed=1)
        self.tensors.append(src)
        eng = LoopbackEngine()
        kw.setdefault("ack_timeout_s", 30.0)
        prod = Producer(engine_id=engine_id, p_rank=0, topology=TOPO, transfer=eng, layers=descs,
                        listener=self.releases.append, **kw)
        self.closers += [prod.close, eng.close]
        return prod, src

    def consumer(self, port: int, engine: LoopbackEngine | None = None, **kw: Any) -> tuple[Consumer, list]:
        dst, descs = self.make_kv(2, 8)
        self.tensors.append(dst)
        eng = engine or LoopbackEngine()
        cons = Consumer(engine_id="D", d_rank=0, topology=TOPO, transfer=eng, layers=descs, port=port, **kw)
        self.closers += [cons.close, eng.close]
        return cons, dst

    def close(self) -> None:
        for c in reversed(self.closers):
            c()


@pytest.fixture
def side(kv):
    s = Side(kv)
    yield s
    s.close()


def finished(prod: Producer, n: int) -> dict[str, Any]:
    got: dict[str, Any] = {}

    def poll() -> bool:
        got.update({o.request_id: o for o in prod.finished()})
        return len(got) >= n

    wait_until(poll, f"{n} sends finished")
    return got


# ----------------------------------------------------------------- defect: registration


def _params(**kw: Any) -> dict[str, Any]:
    base = {"do_remote_decode": True, "remote_host": "10.0.0.2", "remote_port": 7000,
            "remote_request_id": "dec-1", "remote_block_ids": [1, 2]}
    return {**base, **kw}


@pytest.mark.parametrize(("change", "why"), [
    ({"remote_host": "bad host"}, "neither an IP address nor a host name"),
    ({"remote_host": "tcp://x"}, "neither an IP address nor a host name"),
    ({"remote_request_id": "x" * (P.MAX_NAME + 1)}, "remote_request_id of 513 characters"),
    ({"remote_request_id": ""}, "remote_request_id of 0 characters"),
    ({"remote_port": 0}, "remote_port=0"),
])
def test_registration_the_wire_cannot_carry_fails_that_request_alone(change: dict[str, Any], why: str) -> None:
    """Values the schema accepts but the socket layer or decode would choke on are refused at
    the boundary; the request gets its error back and a good one in the same step is sent."""
    reqs = PrefillRequests()
    bad = SimpleNamespace(request_id="bad", num_prompt_tokens=16, num_computed_tokens=0)
    good = SimpleNamespace(request_id="good", num_prompt_tokens=16, num_computed_tokens=0)
    assert reqs.after_alloc(bad, _params(**change)) is False
    assert reqs.after_alloc(good, _params(remote_request_id="dec-2")) is True
    jobs = reqs.take_sends({"bad": 16, "good": 16}, {"bad": [0, 1], "good": [2, 3]}.get)
    assert [j.request_id for j in jobs] == ["good"]
    assert reqs.request_finished("bad") is False  # nothing held: its KV is freed normally
    err = reqs.take_error("bad")
    assert err is not None and why in err[ERROR_KEY]
    assert reqs.take_error("good") is None


@pytest.mark.parametrize("host", ["10.1.2.3", "::1", "decode-0.svc.cluster.local", "localhost"])
def test_valid_hosts_pass_the_boundary(host: str) -> None:
    req = SimpleNamespace(request_id="r", num_prompt_tokens=16, num_computed_tokens=0)
    assert PrefillRequests().after_alloc(req, _params(remote_host=host)) is True


def test_scheduler_returns_the_error_and_keeps_serving() -> None:
    """Through the connector's scheduler hooks: no raise in build_connector_meta, the bad
    request's error comes back with it, the good request is sent."""
    pytest.importorskip("vllm")
    from ascend_offload.config import RemoteD2HConfig
    from ascend_offload.connectors.remote_d2h.scheduler import RemoteD2HScheduler
    from ascend_offload.connectors.remote_d2h.settings import Settings

    settings = Settings(cfg=RemoteD2HConfig(), is_producer=True, is_consumer=False, engine_id="P",
                        kv_port=1, block_size=16, tp_size=1, dp_rank=0, host="127.0.0.1", topology=None)
    sched = RemoteD2HScheduler(settings)
    sched.kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: ([0, 1],))

    def req(rid: str, **kw: Any) -> Any:
        return SimpleNamespace(request_id=rid, num_prompt_tokens=16, num_computed_tokens=0,
                               kv_transfer_params=_params(remote_request_id=f"d-{rid}", **kw))

    bad, good = req("bad", remote_host="not a host", remote_port=1), req("good", transfer_protocol="mooncake/tcp")
    for r in (bad, good):
        sched.update_state_after_alloc(r, None, 0)
    meta = sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"bad": 16, "good": 16}))
    assert [j.request_id for j in meta.send] == ["good"]
    held, params = sched.request_finished(bad, [0, 1])
    assert held is False and "not a host" in params[ERROR_KEY]
    assert sched.request_finished(good, [0, 1]) == (True, None)


# ----------------------------------------------------------------- defect: producer isolation


def test_unreachable_endpoint_fails_only_its_own_items(side, port) -> None:
    """A connect error to one decode endpoint fails that endpoint's items at once; messages
    queued after it in the same pass still go out, and its socket is not kept."""
    cons, _ = side.consumer(port)
    prod, _ = side.producer()
    prod.add_request("lost", [1], DecodeTarget("bad host", 7000, 1), num_layers=1)
    prod.add_request("fine", [2], DecodeTarget("127.0.0.1", port, 1), num_layers=1)
    cons.expect("fine", [5], num_layers=1)
    prod.publish_layer(0, request_ids=["lost", "fine"], unique_slot=True)
    assert [(o.request_id, o.ok) for o in cons.wait_finished(1, WAIT)] == [("fine", True)]
    sent = finished(prod, 2)
    assert sent["fine"].ok and not sent["lost"].ok and sent["lost"].failed_layers == (0,)
    assert prod.stats.send_errors == 1 and prod.stats.timed_out == 0
    assert ("lost", "send_error") in [f for r in side.releases for f in r.failures]
    assert prod.sockets() == [("127.0.0.1", port)]
    assert prod.pending_slots() == {}


def test_idle_decode_sockets_are_closed(side, port) -> None:
    cons, _ = side.consumer(port)
    clock = ManualClock()  # a socket goes idle only when the test moves the clock
    prod, _ = side.producer(idle_socket_s=0.05, clock=clock)
    cons.expect("r", [5], num_layers=1)
    prod.add_request("r", [2], DecodeTarget("127.0.0.1", port, 1), num_layers=1)
    prod.publish_layer(0)
    assert finished(prod, 1)["r"].ok
    assert prod.stats.sockets_closed == 0
    clock.advance(1.0)
    wait_until(lambda: prod.sockets() == [], "the idle socket closed")
    assert prod.stats.sockets_closed == 1
    # The next request reconnects (and resends mf_meta).
    cons.expect("s", [6], num_layers=1)
    prod.add_request("s", [3], DecodeTarget("127.0.0.1", port, 1), num_layers=1)
    prod.publish_layer(0)
    assert finished(prod, 1)["s"].ok
    assert prod.stats.sockets_closed == 1  # the reconnected socket stays until it idles again


# ----------------------------------------------------------------- defect: reads always end


class _Exploding(LoopbackEngine):
    """A transfer engine whose read raises something that is not a TransferError."""

    def _read(self, peer: str, ops: list[ReadOp]) -> None:
        raise RuntimeError("engine bug")


def test_read_raising_anything_still_ends_the_request(side, port) -> None:
    cons, _ = side.consumer(port, engine=_Exploding(), request_timeout_s=600.0)
    prod, _ = side.producer()
    cons.expect("r", [5, 6])
    prod.add_request("r", [1, 2], DecodeTarget("127.0.0.1", port, 1))
    prod.publish_layer(0)
    prod.publish_layer(1)
    out = cons.wait_finished(1, WAIT)
    assert [(o.request_id, o.ok) for o in out] == [("r", False)]
    assert out[0].failed_blocks == (5, 6) and "RuntimeError: engine bug" in out[0].reasons[0]
    assert cons.active() == [] and cons.inflight() == 0
    sent = finished(prod, 1)["r"]
    assert not sent.ok and sent.failed_layers == (0, 1)
    assert {code for r in side.releases for _, code in r.failures} == {P.FAIL_READ}
    assert prod.pending_slots() == {}


def test_mooncake_deadline_is_ours_unless_tighter() -> None:
    env = {"MC_TRANSFER_TIMEOUT": "600", "MC_TCP_PROGRESS_TIMEOUT_SEC": "5", "MC_TCP_STATUS_TIMEOUT_SEC": "x"}
    assert apply_read_deadline(29.2, env) == {"MC_TRANSFER_TIMEOUT": "30", "MC_TCP_PROGRESS_TIMEOUT_SEC": "5",
                                              "MC_TCP_STATUS_TIMEOUT_SEC": "30"}
    assert set(env) == set(TIMEOUT_ENV)
    with pytest.raises(ValueError, match="finite"):
        apply_read_deadline(float("inf"), {})


# ----------------------------------------------------------------- defect: bounded decode state


def test_sender_metadata_is_bounded(side, port) -> None:
    cons, _ = side.consumer(port, max_peers=4)
    prod, _ = side.producer()
    meta = P.decode(prod._meta)
    fake = zmq.Context.instance().socket(zmq.DEALER)
    fake.setsockopt(zmq.LINGER, 0)
    side.closers.append(lambda: fake.close(linger=0))
    fake.connect(f"tcp://127.0.0.1:{port}")
    for i in range(40):
        fake.send(P.encode(P.MfMeta(version=1, engine_id=f"E{i}", p_rank=0, p_tp=1, endpoint=meta.endpoint,
                                    layers=meta.layers)))
    wait_until(lambda: cons.stats.metas_evicted == 36, "36 of 40 senders forgotten")
    assert cons.peers()[0] == 4
    # A live prefill still works: forgotten, it is told no_meta and resends on its next layer.
    cons.expect("r", [5], num_layers=1)
    prod.add_request("r", [2], DecodeTarget("127.0.0.1", port, 1), num_layers=1)
    prod.publish_layer(0)
    assert finished(prod, 1)["r"].ok
    assert cons.peers()[0] == 4


def test_idle_reader_threads_are_retired(side, port) -> None:
    clock = ManualClock()  # a reader goes idle only when the test moves the clock
    cons, _ = side.consumer(port, reader_idle_s=0.05, clock=clock)
    prod, _ = side.producer()
    cons.expect("r", [5], num_layers=1)
    prod.add_request("r", [2], DecodeTarget("127.0.0.1", port, 1), num_layers=1)
    prod.publish_layer(0)
    assert finished(prod, 1)["r"].ok
    assert cons.peers()[1] == 1 and cons.stats.readers_retired == 0
    clock.advance(1.0)
    wait_until(lambda: cons.peers()[1] == 0, "the idle reader retired")
    assert cons.stats.readers_retired == 1
    assert not [t for t in threading.enumerate() if t.name.startswith("pd-read-") and t.is_alive()
                and prod.transfer.endpoint in t.name and (t.join(timeout=2) or t.is_alive())]


def test_oversized_message_is_never_decoded(side, port) -> None:
    cons, _ = side.consumer(port, max_msg_bytes=64 << 10)
    fake = zmq.Context.instance().socket(zmq.DEALER)
    fake.setsockopt(zmq.LINGER, 0)
    side.closers.append(lambda: fake.close(linger=0))
    fake.connect(f"tcp://127.0.0.1:{port}")
    fake.send(b"\xff" * (1 << 20))  # garbage: decoded, it would count as rejected
    prod, _ = side.producer()
    cons.expect("r", [5], num_layers=1)
    prod.add_request("r", [2], DecodeTarget("127.0.0.1", port, 1), num_layers=1)
    prod.publish_layer(0)
    assert finished(prod, 1)["r"].ok
    assert cons.stats.rejected == 0


def test_identity_cannot_be_taken_over_without_authentication(side, port) -> None:
    """A peer claiming a connected prefill's identity does not get its replies."""
    cons, _ = side.consumer(port)
    prod, _ = side.producer(engine_id="P")
    cons.expect("warm", [4], num_layers=1)
    prod.add_request("warm", [1], DecodeTarget("127.0.0.1", port, 1), num_layers=1)
    prod.publish_layer(0)
    assert finished(prod, 1)["warm"].ok  # the prefill's connection is up
    thief = zmq.Context.instance().socket(zmq.DEALER)
    thief.setsockopt(zmq.LINGER, 0)
    thief.setsockopt(zmq.IDENTITY, b"P/0")
    side.closers.append(lambda: thief.close(linger=0))
    mon = thief.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    side.closers.append(lambda: mon.close(linger=0))
    thief.connect(f"tcp://127.0.0.1:{port}")
    assert mon.poll(int(WAIT * 1000)), "the thief never connected"
    cons.expect("r", [5], num_layers=1)
    prod.add_request("r", [2], DecodeTarget("127.0.0.1", port, 1), num_layers=1)
    prod.publish_layer(0)
    assert finished(prod, 1)["r"].ok
    assert not thief.poll(0)


def test_shared_secret_admits_only_its_holders(side, port, tmp_path) -> None:
    secret = tmp_path / "pd.secret"
    secret.write_bytes(b"correct horse battery staple\n")
    keys = load_keys(str(secret))
    cons, _ = side.consumer(port, keys=keys)
    outsider, _ = side.producer(engine_id="X", ack_timeout_s=0.5)  # no secret
    wrong, _ = side.producer(engine_id="W", ack_timeout_s=0.5, keys=derive_keys(b"another secret, 16+ bytes"))
    member, _ = side.producer(engine_id="M", keys=keys)
    for prod, rid in ((outsider, "x"), (wrong, "w"), (member, "m")):
        cons.expect(rid, [5 if rid == "m" else 6], num_layers=1)
        prod.add_request(rid, [2], DecodeTarget("127.0.0.1", port, 1), num_layers=1)
        prod.publish_layer(0)
    assert finished(member, 1)["m"].ok
    for prod, rid in ((outsider, "x"), (wrong, "w")):
        assert not finished(prod, 1)[rid].ok  # never heard: its ack deadline ended it
    assert cons.stats.items == 1 and cons.stats.rejected == 0
    assert {(f[0], f[1]) for r in side.releases for f in r.failures} == {("x", "timeout"), ("w", "timeout")}


@pytest.mark.parametrize(("content", "why"), [(None, "No such file"), (b"short", "at least 16")])
def test_secret_file_errors_are_named(tmp_path, content: bytes | None, why: str) -> None:
    path = tmp_path / "s"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(AuthError, match=why):
        load_keys(str(path))
    assert load_keys("") is None


def test_connector_refuses_an_unreadable_secret_naming_the_key(tmp_path) -> None:
    pytest.importorskip("vllm")
    from ascend_offload.config import ConfigError, RemoteD2HConfig
    from ascend_offload.connectors.remote_d2h.settings import build_settings

    def vcfg() -> Any:
        tc = SimpleNamespace(is_kv_producer=True, is_kv_consumer=False, engine_id="P", kv_port=1)
        return SimpleNamespace(kv_transfer_config=tc, cache_config=SimpleNamespace(block_size=16),
                               parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_rank=0),
                               model_config=SimpleNamespace(use_mla=False))

    missing = str(tmp_path / "absent")
    with pytest.raises(ConfigError, match=r"key 'control_secret_file'.*absent"):
        build_settings(vcfg(), RemoteD2HConfig(host="127.0.0.1", control_secret_file=missing))
    good = tmp_path / "secret"
    good.write_bytes(b"0123456789abcdef")
    s = build_settings(vcfg(), RemoteD2HConfig(host="127.0.0.1", control_secret_file=str(good)))
    assert s.keys == derive_keys(b"0123456789abcdef")
    assert build_settings(vcfg(), RemoteD2HConfig(host="127.0.0.1")).keys is None
