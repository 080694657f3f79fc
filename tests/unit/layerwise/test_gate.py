"""Reuse gate: a writer never enters a slot while a consumer of its contents is unfinished."""

from __future__ import annotations

import random
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_offload.layerwise.gate import (
    ConsumerToken,
    GateError,
    GateTimeout,
    ReuseGate,
    StaleGeneration,
    WriteLease,
)


def test_writer_waits_for_consumer_then_enters() -> None:
    gate = ReuseGate(2, default_timeout_s=5.0)
    lease = gate.acquire_write(0, "layers.1")
    tok = gate.add_consumer(0, lease.generation, "save")
    gate.release_write(lease)
    assert not gate.is_free(0) and gate.is_free(1)
    assert gate.try_acquire_write(0, "layers.3") is None
    released = threading.Event()

    def finish() -> None:
        time.sleep(0.05)
        released.set()
        gate.release_consumer(tok)

    t = threading.Thread(target=finish)
    t.start()
    lease2 = gate.acquire_write(0, "layers.3")
    assert released.is_set()
    t.join()
    assert lease2.generation == lease.generation + 1
    assert gate.owner(0) == "layers.3"
    st_ = gate.stats()
    assert st_.waits == 1 and st_.writes == 2 and st_.wait_s > 0
    assert gate.slot_waits(0) == 1 and gate.slot_waits(1) == 0


def test_writer_waits_for_writer() -> None:
    gate = ReuseGate(1, default_timeout_s=5.0)
    lease = gate.acquire_write(0, "a")
    with pytest.raises(GateTimeout) as err:
        gate.acquire_write(0, "b", timeout_s=0.02)
    assert "writer 'a'" in str(err.value)
    gate.release_write(lease)
    assert gate.acquire_write(0, "b").layer == "b"


def test_deadline_is_explicit_error_naming_slot_layer_and_consumers() -> None:
    gate = ReuseGate(3, default_timeout_s=0.05)
    lease = gate.acquire_write(2, "layers.2")
    gate.add_consumer(2, lease.generation, "store-save")
    gate.add_consumer(2, lease.generation, "remote-read decode-0")
    gate.release_write(lease)
    with pytest.raises(GateTimeout) as err:
        gate.acquire_write(2, "layers.5")
    e = err.value
    assert e.slot == 2 and e.layer == "layers.5" and e.waited_s >= 0.05
    assert len(e.pending) == 2
    msg = str(e)
    assert "slot 2" in msg and "layers.5" in msg and "store-save" in msg and "remote-read" in msg
    assert gate.stats().timeouts == 1


def test_expire_fences_late_consumers() -> None:
    gate = ReuseGate(1, default_timeout_s=0.02)
    lease = gate.acquire_write(0, "a")
    tok = gate.add_consumer(0, lease.generation, "remote-read")
    gate.release_write(lease)
    with pytest.raises(GateTimeout):
        gate.acquire_write(0, "b")
    assert gate.expire_consumers(0) == [tok]
    assert not gate.is_current(tok)
    lease_b = gate.acquire_write(0, "b")
    assert gate.release_consumer(tok) is False  # the late ack changes nothing
    st_ = gate.stats()
    assert st_.late_releases == 1 and st_.consumers_expired == 1
    assert not gate.is_free(0)  # still owned by writer b
    gate.release_write(lease_b)


def test_consumers_held_counts_live_consumers_across_slots() -> None:
    """The idle gauge: consumers holding any slot; released and expired ones do not count."""
    gate = ReuseGate(2, default_timeout_s=0.02)
    assert gate.consumers_held() == 0
    leases = [gate.acquire_write(s, f"l{s}") for s in (0, 1)]
    a = gate.add_consumer(0, leases[0].generation, "save")
    gate.add_consumer(0, leases[0].generation, "read")
    gate.add_consumer(1, leases[1].generation, "read")
    for lease in leases:
        gate.release_write(lease)
    assert gate.consumers_held() == 3
    gate.release_consumer(a)
    assert gate.consumers_held() == 2
    gate.expire_consumers(0)
    gate.expire_consumers(1)
    assert gate.consumers_held() == 0


def test_stale_generation_refused() -> None:
    gate = ReuseGate(1, default_timeout_s=1.0)
    old = gate.acquire_write(0, "a")
    gate.release_write(old)
    new = gate.acquire_write(0, "b")
    with pytest.raises(StaleGeneration, match="generation"):
        gate.add_consumer(0, old.generation, "late-save")
    tok = gate.add_consumer(0, new.generation, "save")
    assert gate.is_current(tok)
    gate.release_write(new)
    assert gate.release_consumer(tok, error=RuntimeError("read failed")) is True
    assert gate.stats().consumers_failed == 1


def test_protocol_errors() -> None:
    gate = ReuseGate(1, default_timeout_s=1.0)
    with pytest.raises(GateError, match="out of range"):
        gate.acquire_write(1, "x")
    lease = gate.acquire_write(0, "x")
    gate.release_write(lease)
    with pytest.raises(GateError, match="release_write"):
        gate.release_write(lease)
    with pytest.raises(ValueError):
        ReuseGate(0, default_timeout_s=1.0)
    with pytest.raises(ValueError):
        ReuseGate(1, default_timeout_s=0)


def test_wait_consumers_drains_and_times_out() -> None:
    gate = ReuseGate(2, default_timeout_s=1.0)
    lease = gate.acquire_write(1, "a")
    tok = gate.add_consumer(1, lease.generation, "save")
    gate.release_write(lease)
    with pytest.raises(GateTimeout):
        gate.wait_consumers(timeout_s=0.02)
    threading.Timer(0.02, gate.release_consumer, args=(tok,)).start()
    gate.wait_consumers(timeout_s=5.0)
    assert gate.is_free(1)


# ---------------------------------------------------------------- properties

OPS = st.lists(
    st.tuples(st.sampled_from(["acquire", "acquire_bq", "release_w", "consume", "consume_q",
                               "done", "expire", "stale"]),
              st.integers(0, 2), st.integers(0, 10)),
    max_size=80,
)


@given(OPS)
def test_sequential_model(ops: list[tuple[str, int, int]]) -> None:
    """Against a reference model: try_acquire succeeds exactly when the slot is idle; a
    writer behind the queue (``behind_queued``) exactly when only queued consumers remain."""
    gate = ReuseGate(3, default_timeout_s=1.0)
    writer: dict[int, WriteLease | None] = {0: None, 1: None, 2: None}
    consumers: dict[int, list[ConsumerToken]] = {0: [], 1: [], 2: []}
    gen = {0: 0, 1: 0, 2: 0}
    for op, slot, pick in ops:
        busy = writer[slot] is not None or bool(consumers[slot])
        busy_bq = writer[slot] is not None or any(not t.queued for t in consumers[slot])
        if op in ("acquire", "acquire_bq"):
            bq = op == "acquire_bq"
            queued0 = gate.stats().queued_waits
            lease = gate.try_acquire_write(slot, f"L{pick}", behind_queued=bq)
            assert (lease is None) == (busy_bq if bq else busy)
            behind = lease is not None and bq and bool(consumers[slot])
            assert gate.stats().queued_waits == queued0 + behind
            if lease is not None:
                gen[slot] += 1
                assert lease.generation == gen[slot]
                writer[slot] = lease
        elif op == "release_w" and writer[slot] is not None:
            gate.release_write(writer[slot])
            writer[slot] = None
        elif op in ("consume", "consume_q") and gen[slot] > 0:
            consumers[slot].append(
                gate.add_consumer(slot, gen[slot], f"c{pick}", queued=op == "consume_q"))
        elif op == "done" and consumers[slot]:
            tok = consumers[slot].pop(pick % len(consumers[slot]))
            assert gate.release_consumer(tok) is True
        elif op == "expire":
            assert {t.id for t in gate.expire_consumers(slot)} == {t.id for t in consumers[slot]}
            consumers[slot].clear()
        elif op == "stale" and gen[slot] > 1:
            with pytest.raises(StaleGeneration):
                gate.add_consumer(slot, gen[slot] - 1, "late")
        assert gate.is_free(slot) == (writer[slot] is None and not consumers[slot])
        assert gate.generation(slot) == gen[slot]


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    num_slots=st.integers(1, 3),
    rounds=st.integers(1, 6),
    writers=st.integers(1, 4),
)
def test_random_interleavings_never_admit_writer_early(
    seed: int, num_slots: int, rounds: int, writers: int
) -> None:
    """Concurrent writers and consumers with random delays: at every grant the slot has no
    active reader, and every wait that happened was counted."""
    rng = random.Random(seed)
    gate = ReuseGate(num_slots, default_timeout_s=10.0)
    lock = threading.Lock()
    active = [0] * num_slots  # readers of a slot's contents that have not finished
    writing = [0] * num_slots
    violations: list[str] = []
    plans = [
        [(rng.randrange(num_slots), rng.randrange(0, 3), [rng.random() * 0.003 for _ in range(3)])
         for _ in range(rounds)]
        for _ in range(writers)
    ]
    threads: list[threading.Thread] = []

    def consumer(slot: int, tok: ConsumerToken, delay: float) -> None:
        time.sleep(delay)
        with lock:
            active[slot] -= 1
        gate.release_consumer(tok)

    def writer(wid: int) -> None:
        for r, (slot, ncons, delays) in enumerate(plans[wid]):
            lease = gate.acquire_write(slot, f"w{wid}.{r}")
            with lock:
                if active[slot] or writing[slot]:
                    violations.append(f"slot {slot}: writer in with {active[slot]} readers")
                writing[slot] += 1
            time.sleep(delays[0] / 3)
            with lock:
                writing[slot] -= 1
            for c in range(ncons):
                tok = gate.add_consumer(slot, lease.generation, f"c{wid}.{r}.{c}")
                with lock:
                    active[slot] += 1
                t = threading.Thread(target=consumer, args=(slot, tok, delays[c]))
                t.start()
                threads.append(t)
            gate.release_write(lease)

    ws = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
    for t in ws:
        t.start()
    for t in ws:
        t.join()
    for t in list(threads):
        t.join()
    assert violations == []
    stats = gate.stats()
    assert stats.writes == writers * rounds
    assert stats.consumers_added == stats.consumers_released
    assert stats.timeouts == 0
    assert all(gate.is_free(s) for s in range(num_slots))


@settings(max_examples=10, deadline=None)
@given(timeout=st.floats(0.001, 0.02), nslots=st.integers(1, 4))
def test_deadlines_fire(timeout: float, nslots: int) -> None:
    gate = ReuseGate(nslots, default_timeout_s=timeout)
    for s in range(nslots):
        lease = gate.acquire_write(s, f"a{s}")
        gate.add_consumer(s, lease.generation, "never-acks")
        gate.release_write(lease)
    for s in range(nslots):
        with pytest.raises(GateTimeout) as err:
            gate.acquire_write(s, f"b{s}")
        assert err.value.slot == s and err.value.waited_s >= timeout
    assert gate.stats().timeouts == nslots and gate.stats().waits == nslots


def test_outwait_raises_the_writer_deadline_only_upwards() -> None:
    """A consumer released by its own deadline (P/D ack timeout) must not make the
    writer time out first: the gate's wait grows to that deadline plus a margin."""
    gate = ReuseGate(1, default_timeout_s=2.0)
    gate.outwait(10.0, margin_s=1.0)
    assert gate.default_timeout_s == 11.0
    gate.outwait(3.0)
    assert gate.default_timeout_s == 11.0


def test_writer_behind_queued_consumers_and_the_pump() -> None:
    """A load queued behind the slot's store save is granted at once (and counted); the
    layer's own writer waits, and its pump is what finishes the queued save."""
    gate = ReuseGate(1, default_timeout_s=5.0)
    lease = gate.acquire_write(0, "layers.1")
    save = gate.add_consumer(0, lease.generation, "store-save layers.1", queued=True)
    remote = gate.add_consumer(0, lease.generation, "rd2h layers.1")
    gate.release_write(lease)
    assert gate.try_acquire_write(0, "layers.4", behind_queued=True) is None  # remote read
    gate.release_consumer(remote)
    assert gate.try_acquire_write(0, "layers.4") is None  # the save is still queued
    load = gate.try_acquire_write(0, "layers.4", behind_queued=True)
    assert load is not None and gate.stats().queued_waits == 1
    gate.release_write(load)
    calls: list[float] = []

    def pump(left: float) -> bool:
        calls.append(left)
        if len(calls) < 3:
            return True  # "waited for a copy" but the save is not done yet
        gate.release_consumer(save)
        return True

    own = gate.acquire_write(0, "layers.7", pump=pump)
    assert own.layer == "layers.7" and len(calls) == 3 and all(c > 0 for c in calls)
    assert gate.stats().waits == 1 and gate.stats().timeouts == 0


def test_pump_with_nothing_to_do_falls_back_to_waiting_and_deadline() -> None:
    gate = ReuseGate(1, default_timeout_s=5.0)
    lease = gate.acquire_write(0, "a")
    tok = gate.add_consumer(0, lease.generation, "rd2h a")
    gate.release_write(lease)
    threading.Timer(0.03, gate.release_consumer, args=(tok,)).start()
    t0 = time.monotonic()
    b = gate.acquire_write(0, "b", pump=lambda left: False)
    assert b.layer == "b" and time.monotonic() - t0 >= 0.02
    gate.release_write(b)
    lease = gate.try_acquire_write(0, "c")
    assert lease is not None
    gate.add_consumer(0, lease.generation, "never")
    gate.release_write(lease)
    t0 = time.monotonic()
    with pytest.raises(GateTimeout):
        gate.acquire_write(0, "d", timeout_s=0.05, pump=lambda left: False)
    assert time.monotonic() - t0 < 2.0
