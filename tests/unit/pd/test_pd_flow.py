"""Producer + consumer in one process over real ZMQ on 127.0.0.1 and the loopback engine."""

from __future__ import annotations

import time

import msgpack
import pytest
import torch
import zmq

from ascend_offload.pd import protocol as P
from ascend_offload.pd.consumer import Consumer
from ascend_offload.pd.producer import DecodeTarget, Producer, SlotRelease
from ascend_offload.pd.topology import Topology
from ascend_offload.transfer.base import LoopbackEngine
from tests.support.clock import ManualClock

WAIT = 10.0


class Pair:
    def __init__(self, port: int, make_kv, *, layers: int = 3, p_blocks: int = 16, d_blocks: int = 12,
                 ack_timeout_s: float = 5.0, request_timeout_s: float = 10.0, d_main=(4, 8),
                 d_indexer=(4, 2), start_consumer: bool = True, clock=None) -> None:
        self.releases: list[SlotRelease] = []
        self.src, src_desc = make_kv(layers, p_blocks, seed=1)
        self.dst, dst_desc = make_kv(layers, d_blocks, main_shape=d_main, indexer_shape=d_indexer)
        self.pe, self.de = LoopbackEngine(), LoopbackEngine()
        topo = Topology(1, 1)
        self.producer = Producer(engine_id="P", p_rank=0, topology=topo, transfer=self.pe, layers=src_desc,
                                 ack_timeout_s=ack_timeout_s, listener=self.releases.append,
                                 **({"clock": clock} if clock is not None else {}))
        self.consumer = None
        if start_consumer:
            self.consumer = Consumer(engine_id="D", d_rank=0, topology=topo, transfer=self.de,
                                     layers=dst_desc, port=port, request_timeout_s=request_timeout_s)
        self.target = DecodeTarget("127.0.0.1", port, 1)

    def close(self) -> None:
        self.producer.close()
        if self.consumer:
            self.consumer.close()
        self.pe.close()
        self.de.close()

    def wait_send(self, n: int):
        end = time.monotonic() + WAIT
        out = []
        while len(out) < n and time.monotonic() < end:
            out += self.producer.finished()
            time.sleep(0.01)
        return out


@pytest.fixture
def pair_factory(port, kv):
    made = []

    def make(**kw):
        made.append(Pair(port, kv, **kw))
        return made[-1]

    yield make
    for p in made:
        p.close()


def test_layers_arrive_byte_identical(pair_factory):
    pr = pair_factory()
    src_blocks, dst_blocks = [3, 4, 5, 9, 0], [7, 2, 3, 4, 11]
    pr.consumer.expect("r1", dst_blocks)
    pr.producer.add_request("r1", src_blocks, pr.target)
    for layer in range(3):
        pr.producer.publish_layer(layer)
    out = pr.consumer.wait_finished(1, WAIT)
    assert out == [type(out[0])("r1", True)]
    for (skv, sidx), (dkv, didx) in zip(pr.src, pr.dst, strict=True):
        assert torch.equal(dkv[:, dst_blocks], skv[:, src_blocks])
        assert torch.equal(didx[dst_blocks], sidx[src_blocks])
        untouched = [b for b in range(12) if b not in dst_blocks]
        assert not dkv[:, untouched].any() and not didx[untouched].any()
    sent = pr.wait_send(1)
    assert [(s.request_id, s.ok) for s in sent] == [("r1", True)]
    assert sorted((r.slot, r.generation, r.ok) for r in pr.releases) == [(0, 1, True), (1, 1, True), (2, 1, True)]
    # Contiguous blocks 2,3,4 <- 4,5,9? only 3->7.. no; runs: (2<-4,3<-5) merged; descriptors < blocks.
    assert pr.consumer.stats.descriptors < 3 * 3 * 5
    assert pr.consumer.active() == []


def test_a_requests_first_layer_hands_the_gil_to_the_io_loop(pair_factory, monkeypatch):
    """Only a publish that carries some request's first layer makes the publisher step
    aside (its decode is idle until that layer arrives); later layers do not pay it."""
    pr = pair_factory()
    wakes: list[bool] = []
    orig = pr.producer._loop.wake
    monkeypatch.setattr(pr.producer._loop, "wake", lambda *, hand_off=False: (wakes.append(hand_off), orig())[1])
    pr.consumer.expect("r1", [1, 2])
    pr.producer.add_request("r1", [3, 4], pr.target)
    pr.producer.publish_layer(0)
    pr.producer.publish_layer(1)
    pr.consumer.expect("r2", [5, 6])
    pr.producer.add_request("r2", [7, 8], pr.target)
    pr.producer.publish_layer(2)  # r1's last layer and r2's first
    pr.producer.publish_layer(0, request_ids=["r2"])
    pr.producer.publish_layer(1, request_ids=["r2"])
    assert wakes == [True, False, True, False, False]
    assert sorted(o.request_id for o in pr.consumer.wait_finished(1, WAIT) + pr.consumer.wait_finished(1, WAIT)) \
        == ["r1", "r2"]


def test_items_before_expect_are_parked(pair_factory):
    pr = pair_factory()
    pr.producer.add_request("r1", [1, 2], pr.target)
    pr.producer.publish_layer(0)
    end = time.monotonic() + WAIT
    while pr.consumer.stats.parked < 1 and time.monotonic() < end:
        time.sleep(0.01)
    assert pr.consumer.stats.parked == 1  # received and held, not refused
    assert pr.consumer.parked() == 1  # the idle gauge sees it held
    assert pr.consumer.finished() == [] and pr.producer.pending_slots() == {0: 1}
    pr.consumer.expect("r1", [5, 6])
    pr.producer.publish_layer(1)
    pr.producer.publish_layer(2)
    out = pr.consumer.wait_finished(1, WAIT)
    assert out and out[0].ok
    assert torch.equal(pr.dst[0][0][:, [5, 6]], pr.src[0][0][:, [1, 2]])
    assert pr.consumer.parked() == 0 and pr.consumer.inflight() == 0 and pr.consumer.active() == []


def test_size_mismatch_fails_exactly_that_request(pair_factory):
    pr = pair_factory(d_main=(4, 4))
    pr.consumer.expect("r1", [1, 2, 3])
    pr.producer.add_request("r1", [1, 2, 3], pr.target)
    for layer in range(3):
        pr.producer.publish_layer(layer)
    out = pr.consumer.wait_finished(1, WAIT)
    assert len(out) == 1 and not out[0].ok
    assert out[0].failed_blocks == (1, 2, 3)
    assert "block_bytes" in out[0].reasons[0]
    assert not pr.dst[0][0].any()  # nothing written
    sent = pr.wait_send(1)
    assert sent and not sent[0].ok and sent[0].failed_layers == (0, 1, 2)
    assert all(not r.ok and r.failures[0][1] == P.FAIL_INVALID for r in pr.releases)


def test_dead_decode_releases_slot_at_deadline(pair_factory):
    pr = pair_factory(ack_timeout_s=0.3, start_consumer=False)
    pr.producer.add_request("r1", [1], pr.target)
    pr.producer.publish_layer(0)
    end = time.monotonic() + WAIT
    while not pr.releases and time.monotonic() < end:
        time.sleep(0.01)
    # nobody listens: only the ack deadline can have released the slot
    assert pr.releases and pr.releases[0].failures == (("r1", "timeout"),)
    assert pr.producer.pending_slots() == {}
    assert pr.producer.stats.timed_out == 1


def test_late_ack_is_stale_not_accepted(pair_factory, port):
    # The producer's ack deadlines move only when the test says: r1's passes, r2's never does.
    clock = ManualClock()
    pr = pair_factory(ack_timeout_s=0.2, start_consumer=False, clock=clock)
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{port}")
    try:
        pr.producer.add_request("r1", [1], pr.target)
        pr.producer.publish_layer(0)
        assert router.poll(5000)
        ident, meta = router.recv_multipart()
        assert isinstance(P.decode(meta), P.MfMeta)
        ident, data = router.recv_multipart()
        item = P.decode(data).items[0]
        assert not pr.releases  # the deadline has not passed on the producer's clock
        clock.advance(1.0)
        end = time.monotonic() + WAIT
        while not pr.releases and time.monotonic() < end:
            time.sleep(0.01)
        assert pr.releases[0].failures == (("r1", "timeout"),)
        pr.producer.add_request("r2", [2], pr.target)
        gen2 = pr.producer.publish_layer(0)  # slot 0 reused: generation 2
        assert gen2 == item.generation + 1
        late = P.ReadDone(version=1, engine_id="D", d_rank=0, p_rank=0, request_id="r1", layer=0,
                          slot=0, generation=item.generation)
        router.send_multipart([ident, P.encode(late)])
        router.send_multipart([ident, b"\xc1garbage"])
        end = time.monotonic() + WAIT
        while pr.producer.stats.rejected < 1 and time.monotonic() < end:
            time.sleep(0.01)
        assert pr.producer.stats.stale == 1
        assert pr.producer.stats.rejected == 1
        assert pr.producer.pending_slots() == {0: gen2}  # r2's read still owns the slot
    finally:
        router.close(linger=0)


def test_garbled_and_invalid_items_rejected_consumer_lives(pair_factory, port):
    # r1 must end at this deadline, r2 complete well before it (even on a loaded host).
    pr = pair_factory(request_timeout_s=4.0)
    pr.consumer.expect("r1", [1, 2])
    ctx = zmq.Context.instance()
    d = ctx.socket(zmq.DEALER)
    d.connect(f"tcp://127.0.0.1:{port}")
    try:
        d.send(b"garbage")
        d.send(msgpack.packb(["read_ready_batch", 1, "x"]))
        # a well-formed item without mf_meta first -> read_failed no_meta
        item = P.ReadReady(request_id="r1", layer=0, slot=0, generation=1, src_blocks=[1, 2], main=True,
                           index_lo=0, index_hi=2)
        d.send(P.encode(P.ReadReadyBatch(version=1, engine_id="X", p_rank=0, read_budget_ms=1000, items=[item])))
        assert d.poll(5000)
        ans = P.decode(d.recv())
        assert isinstance(ans, P.ReadFailed) and ans.code == P.FAIL_NO_META
        assert pr.consumer.stats.rejected == 2
        # The consumer is alive: the real producer's request still completes.
        pr.consumer.expect("r2", [3])
        pr.producer.add_request("r2", [4], pr.target)
        for layer in range(3):
            pr.producer.publish_layer(layer)
        outs = {o.request_id: o for o in pr.consumer.wait_finished(2, WAIT)}
        outs.update({o.request_id: o for o in pr.consumer.wait_finished(2 - len(outs), WAIT)})
        assert outs["r2"].ok
        # r1 got a failed layer 0 and nothing else: times out, all its blocks are load errors.
        assert not outs["r1"].ok and outs["r1"].failed_blocks == (1, 2)
        assert pr.consumer.active() == [] and pr.producer.pending_slots() == {}
    finally:
        d.close(linger=0)


def test_unequal_tp_in_process(port_pair, kv):
    port = port_pair
    make_kv = kv
    """p_tp=4, d_tp=2 with loopback engines: each decode rank gets exactly its group's data."""
    topo = Topology(4, 2)
    src, src_desc = make_kv(2, 8, seed=3)  # replicated KV: every prefill rank holds the same bytes
    engines, producers, consumers, dsts = [], [], [], []
    try:
        for d in range(2):
            dst, dst_desc = make_kv(2, 8)
            e = LoopbackEngine()
            engines.append(e)
            dsts.append(dst)
            consumers.append(Consumer(engine_id="D", d_rank=d, topology=topo, transfer=e, layers=dst_desc,
                                      port=port + d))
        for p in range(4):
            e = LoopbackEngine()
            engines.append(e)
            producers.append(Producer(engine_id="P", p_rank=p, topology=topo, transfer=e, layers=src_desc,
                                      register_memory=True))
        for d in range(2):
            consumers[d].expect("r", [0, 1, 2])
        for p in producers:
            p.add_request("r", [5, 6, 7], DecodeTarget("127.0.0.1", port, 2))
            p.publish_layer(0)
            p.publish_layer(1)
        for d in range(2):
            out = consumers[d].wait_finished(1, WAIT)
            assert [(o.request_id, o.ok) for o in out] == [("r", True)]
            for layer in range(2):
                assert torch.equal(dsts[d][layer][0][:, :3], src[layer][0][:, 5:8])
                assert torch.equal(dsts[d][layer][1][:3], src[layer][1][5:8])
            # two members: member 0 reads main+indexer[0:2], member 1 indexer[2:3]
            assert consumers[d].stats.items == 4
    finally:
        for x in producers + consumers:
            x.close()
        for e in engines:
            e.close()


def test_reuse_gate_waits_for_decode_read(port_pair, kv):
    """The layerwise gate holds a physical slot until decode's read of it is answered."""
    from ascend_offload.layerwise.gate import ReuseGate
    from ascend_offload.pd.producer import gate_listener

    port = port_pair
    gate = ReuseGate(1, default_timeout_s=10.0)
    src, src_desc = kv(2, 4, seed=5)
    dst, dst_desc = kv(2, 4)
    pe, de = LoopbackEngine(), LoopbackEngine()
    topo = Topology(1, 1)
    clock = ManualClock()  # the ack deadline passes only when the test advances it
    prod = Producer(engine_id="P", p_rank=0, topology=topo, transfer=pe, layers=src_desc,
                    ack_timeout_s=2.0, listener=gate_listener(gate), clock=clock)
    cons = None
    try:
        prod.add_request("r", [1], DecodeTarget("127.0.0.1", port, 1))
        lease = gate.acquire_write(0, "layer0")
        gate.release_write(lease)
        tok = gate.add_consumer(0, lease.generation, "rd2h")
        prod.publish_layer(0, slot=0, tag=tok)
        assert not gate.is_free(0)  # no decode yet: the read is outstanding
        cons = Consumer(engine_id="D", d_rank=0, topology=topo, transfer=de, layers=dst_desc, port=port)
        cons.expect("r", [2], num_layers=1)
        lease2 = gate.acquire_write(0, "layer1", timeout_s=WAIT)  # opens after READ_DONE
        assert torch.equal(dst[0][0][:, 2], src[0][0][:, 1])
        gate.release_write(lease2)
        st = gate.stats()
        assert st.consumers_released == 1 and st.consumers_failed == 0
        # Nobody reads layer 1's generation: the ack deadline reopens the slot, marked failed.
        prod.add_request("r2", [0], DecodeTarget("127.0.0.1", port + 1, 1), num_layers=2)
        tok2 = gate.add_consumer(0, lease2.generation, "rd2h")
        prod.publish_layer(1, slot=0, tag=tok2)
        assert not gate.is_free(0)
        clock.advance(3.0)
        lease3 = gate.acquire_write(0, "layer0", timeout_s=WAIT)
        assert gate.stats().consumers_failed == 1
        gate.release_write(lease3)
    finally:
        prod.close()
        if cons:
            cons.close()
        pe.close()
        de.close()


def test_consumer_fail_ends_request_and_unknown_gets_outcome(pair_factory):
    pr = pair_factory()
    pr.consumer.expect("r1", [1, 2, 3])
    pr.producer.add_request("r1", [4, 5, 6], pr.target)
    pr.producer.publish_layer(0)
    end = time.monotonic() + WAIT
    while pr.consumer.stats.reads < 1 and time.monotonic() < end:
        time.sleep(0.01)
    assert pr.consumer.stats.reads == 1  # layer 0 landed before the abort
    pr.consumer.fail("r1", "aborted on decode")
    pr.consumer.fail("never", "registration failed")
    outs = {o.request_id: o for o in pr.consumer.wait_finished(2, WAIT)}
    assert not outs["r1"].ok and outs["r1"].failed_blocks == (1, 2, 3)
    assert any("aborted on decode" in r for r in outs["r1"].reasons)
    assert outs["never"] == type(outs["never"])("never", False, (), ("registration failed",))
    assert pr.consumer.active() == []
    # later layers of r1 are answered unknown_request, so prefill is not left waiting
    pr.producer.publish_layer(1)
    pr.producer.publish_layer(2)
    sent = pr.wait_send(1)
    assert sent and sent[0].request_id == "r1" and sent[0].failed_layers == (1, 2)


def test_abort_waits_for_published_layers(pair_factory):
    clock = ManualClock()
    pr = pair_factory(ack_timeout_s=0.5, start_consumer=False, clock=clock)
    pr.producer.add_request("r1", [1], pr.target)
    pr.producer.publish_layer(0)
    pr.producer.abort_request("r1")
    time.sleep(0.3)  # the I/O thread runs its deadline pass; the clock has not moved
    assert pr.producer.finished() == []  # layer 0 may still be read: not finished yet
    assert not pr.releases
    clock.advance(1.0)  # now layer 0's ack deadline passes
    sent = pr.wait_send(1)
    assert [(s.request_id, s.failed_layers) for s in sent] == [("r1", (0, 1, 2))]
    assert pr.releases and pr.releases[0].failures == (("r1", "timeout"),)


def test_parse_faults():
    from ascend_offload.config import parse_faults

    assert parse_faults("none, invalid:1,drop:12@7") == [None, ("invalid", 1, None), ("drop", 12, 7)]
    with pytest.raises(ValueError, match="'boom:1'"):
        parse_faults("none,boom:1")
    with pytest.raises(ValueError, match="'drop:1@x'"):
        parse_faults("drop:1@x")


def test_injected_invalid_item_fails_fast_and_drop_times_out(port, kv):
    src, src_desc = kv(3, 8, seed=9)
    dst, dst_desc = kv(3, 8)
    pe, de = LoopbackEngine(), LoopbackEngine()
    topo = Topology(1, 1)
    prod = Producer(engine_id="P", p_rank=0, topology=topo, transfer=pe, layers=src_desc, ack_timeout_s=5,
                    faults="none,invalid:1,drop:2")
    # r2's layer 2 never arrives. The consumer's deadline moves only with the test's clock:
    # r0 and r1 end on their own, then the clock passes r2's deadline.
    clock = ManualClock()
    cons = Consumer(engine_id="D", d_rank=0, topology=topo, transfer=de, layers=dst_desc, port=port,
                    request_timeout_s=3.0, clock=clock)
    try:
        for i in range(3):
            cons.expect(f"r{i}", [i])
            prod.add_request(f"r{i}", [i + 3], DecodeTarget("127.0.0.1", port, 1))
        for layer in range(3):
            prod.publish_layer(layer)
        outs = {o.request_id: o for o in cons.wait_finished(2, WAIT)}
        assert sorted(outs) == ["r0", "r1"]  # r2 waits for its dropped layer
        clock.advance(3.5)
        outs.update({o.request_id: o for o in cons.wait_finished(1, WAIT)})
        assert outs["r0"].ok and torch.equal(dst[2][0][:, 0], src[2][0][:, 3])
        assert not outs["r1"].ok and outs["r1"].failed_blocks == (1,) and "main=False" in outs["r1"].reasons[0]
        assert not outs["r2"].ok and outs["r2"].failed_blocks == (2,) and "timeout" in outs["r2"].reasons[0]
    finally:
        prod.close()
        cons.close()
        pe.close()
        de.close()


def test_parking_is_bounded(port, kv):
    _, dst_desc = kv(2, 4)
    de = LoopbackEngine()
    cons = Consumer(engine_id="D", d_rank=0, topology=Topology(1, 1), transfer=de, layers=dst_desc, port=port,
                    max_parked=1)
    d = zmq.Context.instance().socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(f"tcp://127.0.0.1:{port}")
    try:
        items = [P.ReadReady(request_id=f"u{i}", layer=0, slot=0, generation=1, src_blocks=[0], main=True,
                             index_lo=0, index_hi=1) for i in range(2)]
        d.send(P.encode(P.ReadReadyBatch(version=1, engine_id="X", p_rank=0, read_budget_ms=60_000,
                                         items=items)))
        assert d.poll(5000)
        ans = P.decode(d.recv())
        assert isinstance(ans, P.ReadFailed) and ans.code == P.FAIL_UNKNOWN_REQUEST and ans.request_id == "u1"
        assert cons.stats.parked == 1
    finally:
        d.close(linger=0)
        cons.close()
        de.close()


class _GatedEngine(LoopbackEngine):
    """Loopback engine whose reads wait for a gate: a stalled peer on demand."""

    def __init__(self) -> None:
        super().__init__()
        import threading

        self.gate = threading.Event()
        self.entered = threading.Event()

    def _read(self, peer, ops):
        self.entered.set()
        self.gate.wait(30)
        super()._read(peer, ops)


def test_request_not_reported_while_a_read_into_it_is_in_flight(port, kv):
    """Deadline passes during a stuck read: the failure is reported only after the read
    returned, so vLLM never recomputes into blocks a late write could still hit."""
    _src, src_desc = kv(2, 4, seed=2)
    _dst, dst_desc = kv(2, 4)
    pe, de = LoopbackEngine(), _GatedEngine()
    topo = Topology(1, 1)
    prod = Producer(engine_id="P", p_rank=0, topology=topo, transfer=pe, layers=src_desc, ack_timeout_s=20)
    cons = Consumer(engine_id="D", d_rank=0, topology=topo, transfer=de, layers=dst_desc, port=port,
                    request_timeout_s=0.3)
    try:
        cons.expect("r", [1])
        prod.add_request("r", [2], DecodeTarget("127.0.0.1", port, 1))
        prod.publish_layer(0)
        assert de.entered.wait(WAIT)
        end = time.monotonic() + WAIT
        while time.monotonic() < end and cons._requests["r"].deadline != float("inf"):
            time.sleep(0.01)  # until the consumer handled the 0.3 s request deadline
        assert cons._requests["r"].deadline == float("inf") and cons.inflight() == 1
        assert cons.finished() == [] and cons.active() == ["r"]
        de.gate.set()
        outs = cons.wait_finished(1, WAIT)
        assert len(outs) == 1 and not outs[0].ok and outs[0].failed_blocks == (1,)
        assert cons.active() == []
    finally:
        de.gate.set()
        prod.close()
        cons.close()
        pe.close()
        de.close()


def test_unique_slots_do_not_fence_each_other_or_accumulate(pair_factory):
    pr = pair_factory()
    for i in range(2):  # two "steps" publish the same layer while the first may be unanswered
        pr.consumer.expect(f"r{i}", [i])
        pr.producer.add_request(f"r{i}", [i + 4], pr.target)
        for layer in range(3):
            gen = pr.producer.publish_layer(layer, unique_slot=True, request_ids=[f"r{i}"])
            assert gen == 1
    outs = pr.consumer.wait_finished(2, WAIT)
    if len(outs) < 2:
        outs += pr.consumer.wait_finished(2 - len(outs), WAIT)
    assert sorted((o.request_id, o.ok) for o in outs) == [("r0", True), ("r1", True)]
    assert sorted(s.request_id for s in pr.wait_send(2)) == ["r0", "r1"]
    assert len({r.slot for r in pr.releases}) == 6 and all(r.ok for r in pr.releases)
    assert pr.producer.pending_slots() == {} and not pr.producer._gen
