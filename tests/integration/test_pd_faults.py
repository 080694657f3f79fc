"""Garbled, invalid and dropped protocol messages between real rank processes over Mooncake TCP."""

from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest
import zmq

pytest.importorskip("mooncake.engine")

from ascend_offload.harness.servers import free_port
from ascend_offload.pd import protocol as P
from tests.support.pd_ranks import KVShape, RankConfig, expected_blocks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SHAPE = KVShape(num_layers=4, num_blocks=16, main_block_bytes=1024, indexer_block_bytes=128)


@pytest.fixture
def zsock():
    made = []

    def make(kind: int) -> zmq.Socket:
        s = zmq.Context.instance().socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close(linger=0)


def test_garbled_and_invalid_messages_to_decode(ranks, zsock):
    port = free_port()
    d = ranks(RankConfig("decode", 0, 1, 1, SHAPE, kv_port=port, request_timeout_s=8.0))
    d.call("expect", "bad", [3, 4])
    fake = zsock(zmq.DEALER)
    fake.connect(f"tcp://127.0.0.1:{port}")
    fake.send(b"\xff\x00garbage")
    fake.send(msgpack.packb(["read_ready_batch", P.PROTOCOL_VERSION, "x", 0]))  # truncated
    fake.send(msgpack.packb(["read_done", 99, "x", 0, 0, "r", 0, 0, 0]))  # other version
    # A decodable meta whose layout does not match decode's (main block 512 B, not 1024 B).
    layers = [P.LayerDesc(main=[P.TensorDesc(1 << 20, 512, 512, 16)] * 2, indexer=P.TensorDesc(1 << 22, 128, 128, 16))
              for _ in range(SHAPE.num_layers)]
    fake.send(P.encode(P.MfMeta(version=1, engine_id="fake", p_rank=0, p_tp=1, endpoint="127.0.0.1:1",
                                layers=layers)))
    item = P.ReadReady(request_id="bad", layer=0, slot=0, generation=7, src_blocks=[0, 1], main=True,
                       index_lo=0, index_hi=2)
    fake.send(P.encode(P.ReadReadyBatch(version=1, engine_id="fake", p_rank=0, read_budget_ms=5000,
                                        items=[item])))
    assert fake.poll(10000), "decode did not answer the invalid item"
    ans = P.decode(fake.recv())
    assert isinstance(ans, P.ReadFailed) and ans.code == P.FAIL_INVALID and ans.generation == 7
    assert "block_bytes 512 (prefill) != 1024 (decode)" in ans.reason
    assert d.call("stats")["rejected"] == 3
    # Decode lives on: a real prefill's request completes byte-identically.
    p = ranks(RankConfig("prefill", 0, 1, 1, SHAPE))
    d.call("expect", "good", [0, 1])
    p.call("add", "good", [5, 9], "127.0.0.1", port, 1)
    p.call("run", list(range(SHAPE.num_layers)))
    outs = {o[0]: o for o in d.call("wait", 2, 30.0, timeout_s=40)}
    assert outs["good"][1] and outs["good"][2] == ()
    for (gkv, gidx), (wkv, widx) in zip(d.call("blocks", [0, 1]), expected_blocks(SHAPE, 1234, [5, 9]), strict=True):
        assert np.array_equal(gkv, wkv) and np.array_equal(gidx, widx)
    # "bad": layer 0 failed as invalid; the others never came, so its configured deadline ended it,
    # every block a load error, and nothing of it is left.
    assert not outs["bad"][1] and outs["bad"][2] == (3, 4)
    assert any("layer 0" in r and "block_bytes 512" in r for r in outs["bad"][3])
    assert sum("not read before the deadline" in r for r in outs["bad"][3]) == SHAPE.num_layers - 1
    assert d.call("active") == []


def test_dropped_layer_fails_exactly_that_request(ranks):
    port = free_port()
    # Both ranks' deadlines move only when the test advances them: "fine" ends on its
    # own, then the 1.5 s request deadline passes for "lost".
    d = ranks(RankConfig("decode", 0, 1, 1, SHAPE, kv_port=port, request_timeout_s=1.5, manual_clock=True))
    p = ranks(RankConfig("prefill", 0, 1, 1, SHAPE, request_timeout_s=1.5, manual_clock=True))
    d.call("expect", "lost", [0, 1, 2])
    d.call("expect", "fine", [5, 6])
    p.call("add", "lost", [0, 1, 2], "127.0.0.1", port, 1)
    p.call("add", "fine", [7, 8], "127.0.0.1", port, 1)
    for layer in range(SHAPE.num_layers):
        # layer 2's readiness for "lost" is dropped
        p.call("publish", layer, None if layer != 2 else ["fine"])
    outs = {o[0]: o for o in d.call("wait", 1, 20.0, timeout_s=30)}
    assert list(outs) == ["fine"]  # "lost" still waits for its layer 2
    d.call("advance", 2.0)
    p.call("advance", 2.0)
    outs.update({o[0]: o for o in d.call("wait", 1, 20.0, timeout_s=30)})
    assert outs["fine"][1] and outs["fine"][2] == ()
    assert not outs["lost"][1] and outs["lost"][2] == (0, 1, 2)
    assert any("layer 2" in r and "timeout" in r for r in outs["lost"][3])
    assert d.call("active") == []
    sent = {s[0]: s for s in p.call("finished", 2, 20.0, timeout_s=30)}
    assert sent["fine"] == ("fine", True, ())
    assert sent["lost"] == ("lost", False, (2,))
    assert p.call("pending_slots") == {}  # the dropped layer's slot went back at the ack deadline


def test_garbled_answers_to_prefill(ranks, zsock):
    """A misbehaving decode: garbage and wrong-rank answers are rejected; prefill keeps working."""
    port = free_port()
    router = zsock(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{port}")
    p = ranks(RankConfig("prefill", 0, 1, 1, SHAPE, ack_timeout_s=10.0))
    p.call("add", "r", [1], "127.0.0.1", port, 1, num_layers=1)
    p.call("publish", 0)
    assert router.poll(10000)
    ident, meta = router.recv_multipart()
    assert isinstance(P.decode(meta), P.MfMeta)
    ident, data = router.recv_multipart()
    it = P.decode(data).items[0]
    router.send_multipart([ident, b"\x93garbage"])
    wrong = P.ReadDone(version=1, engine_id="D", d_rank=0, p_rank=3, request_id="r", layer=0, slot=it.slot,
                       generation=it.generation)
    router.send_multipart([ident, P.encode(wrong)])
    end = time.monotonic() + 10
    while p.call("stats")["rejected"] < 2 and time.monotonic() < end:
        time.sleep(0.02)
    assert p.call("stats")["rejected"] == 2  # both seen, neither taken as the answer
    assert p.call("pending_slots") == {0: it.generation}
    good = P.ReadDone(version=1, engine_id="D", d_rank=0, p_rank=0, request_id="r", layer=0, slot=it.slot,
                      generation=it.generation)
    router.send_multipart([ident, P.encode(good)])
    assert p.call("finished", 1, 10.0) == [("r", True, ())]
    st = p.call("stats")
    assert st["rejected"] == 2 and st["acked"] == 1
    assert p.call("pending_slots") == {}


def _thread_states(pid: int) -> str:
    """The scheduler state letter of every thread of ``pid`` (``T``: stopped)."""
    import pathlib

    states = []
    for stat in pathlib.Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):
            continue
    return "".join(sorted(states))


def _wait_stopped(pid: int, timeout_s: float) -> None:
    """Until every thread of ``pid`` is stopped: the test's premise, checked."""
    end = time.monotonic() + timeout_s
    while set(_thread_states(pid)) - {"T", "t"}:
        assert time.monotonic() < end, f"pid {pid} not stopped: thread states {_thread_states(pid)}"
        time.sleep(0.01)


def test_stalled_prefill_fails_its_read_and_others_proceed(ranks, zsock):
    """A prefill that stops answering (SIGSTOP) mid-service: decode's read from it fails
    within the read timeout (Mooncake bounded by our engine settings) instead of hanging,
    while a request from another prefill completes byte-identically meanwhile."""
    import os
    import signal

    port = free_port()
    d = ranks(RankConfig("decode", 0, 1, 1, SHAPE, kv_port=port, read_timeout_s=2.0, request_timeout_s=6.0))
    a = ranks(RankConfig("prefill", 0, 1, 1, SHAPE, engine_id="A"))
    b = ranks(RankConfig("prefill", 0, 1, 1, SHAPE, engine_id="B", seed=99))
    # a0: decode has connected to A once (the usual state when A later stalls).
    d.call("expect", "a0", [9])
    a.call("add", "a0", [9], "127.0.0.1", port, 1)
    a.call("run", list(range(SHAPE.num_layers)))
    assert [(o[0], o[1]) for o in d.call("wait", 1, 20.0, timeout_s=30)] == [("a0", True)]
    meta_a = a.call("meta")
    os.kill(a.proc.pid, signal.SIGSTOP)
    try:
        _wait_stopped(a.proc.pid, 5.0)
        # Speak for the frozen A from here: its KV memory stays registered.
        fake = zsock(zmq.DEALER)
        fake.setsockopt(zmq.IDENTITY, b"A/0-test")
        fake.connect(f"tcp://127.0.0.1:{port}")
        d.call("expect", "a", [0, 1])
        fake.send(meta_a)
        item = P.ReadReady(request_id="a", layer=0, slot=0, generation=1, src_blocks=[2, 3], main=True,
                           index_lo=0, index_hi=2)
        fake.send(P.encode(P.ReadReadyBatch(version=1, engine_id="A", p_rank=0, read_budget_ms=60_000,
                                            items=[item])))
        d.call("expect", "b", [5, 6])
        b.call("add", "b", [7, 8], "127.0.0.1", port, 1)
        b.call("run", list(range(SHAPE.num_layers)))
        assert fake.poll(20000), "decode never answered the read from the frozen prefill"
        ans = P.decode(fake.recv())
        if isinstance(ans, P.ReadDone):  # say what arrived: the frozen prefill's bytes or others
            got = d.call("blocks", [0, 1])
            same = all(np.array_equal(g[0], w[0]) for g, w in
                       zip(got, expected_blocks(SHAPE, a.cfg.seed, [2, 3]), strict=True))
            pytest.fail(f"ReadDone from a frozen prefill (threads {_thread_states(a.proc.pid)}); "
                        f"the read blocks {'equal' if same else 'differ from'} its blocks 2, 3")
        assert isinstance(ans, P.ReadFailed) and ans.code == P.FAIL_READ and ans.request_id == "a"
        outs = {o[0]: o for o in d.call("wait", 2, 40.0, timeout_s=50)}
        assert outs["b"][1] and outs["b"][2] == ()
        assert not outs["a"][1] and outs["a"][2] == (0, 1)  # layer 0 failed -> every block
        got = d.call("blocks", [5, 6])
        for (gkv, gidx), (wkv, widx) in zip(got, expected_blocks(SHAPE, 99, [7, 8]), strict=True):
            assert np.array_equal(gkv, wkv) and np.array_equal(gidx, widx)
        assert d.call("active") == []
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
