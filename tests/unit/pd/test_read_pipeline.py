"""The decode's read pipeline: a peer's reader keeps the next read in flight
(``PeerReader``), a job's read with its retries and budget (``ReadRunner``), read
descriptors built as runs (``build_ops``), and the engines' ``start_read``
(deferred by default, asynchronous on Mooncake, landed on the device by
``StagedEngine`` only when waited for)."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
import torch

from ascend_offload import device
from ascend_offload.pd import protocol as P
from ascend_offload.pd.consumer_records import ParkedItem, ReadJob, RequestState
from ascend_offload.pd.reads import PeerReader, ReadRunner, build_ops
from ascend_offload.transfer.base import (
    DeferredRead,
    LoopbackEngine,
    PendingRead,
    ReadOp,
    TransferError,
    coalesce,
)
from ascend_offload.transfer.staged import StagedEngine
from tests.support.fake_device import GuardedEngine, installed

WAIT = 10.0


# ----------------------------------------------------------------- PeerReader


class _Log:
    """Start/finish callbacks that record their order; ``hold`` makes a job's start wait,
    ``hold_finish`` its finish (a read that takes until the event is set)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self.hold: dict[int, threading.Event] = {}
        self.hold_finish: dict[int, threading.Event] = {}
        self.done = threading.Condition()
        self.started_not_finished = 0
        self.most_in_flight = 0

    def start(self, job: int) -> str:
        if job in self.hold:
            assert self.hold[job].wait(WAIT)
        if job < 0:
            raise RuntimeError("start bug")
        with self.done:
            self.events.append(("start", job))
            self.started_not_finished += 1
            self.most_in_flight = max(self.most_in_flight, self.started_not_finished)
            self.done.notify_all()
        return f"handle-{job}"

    def finish(self, job: int, handle: str | None) -> None:
        if job in self.hold_finish:
            assert self.hold_finish[job].wait(WAIT)
        with self.done:
            self.events.append(("finish", job))
            if handle is not None:
                assert handle == f"handle-{job}"
                self.started_not_finished -= 1
            self.done.notify_all()

    def wait_finished(self, n: int) -> None:
        with self.done:
            assert self.done.wait_for(lambda: sum(e[0] == "finish" for e in self.events) >= n, WAIT)

    def wait_event(self, event: tuple[str, int]) -> None:
        with self.done:
            assert self.done.wait_for(lambda: event in self.events, WAIT), (event, self.events)


def test_reader_starts_the_next_queued_job_before_waiting_for_the_current_one() -> None:
    log = _Log()
    log.hold[0] = threading.Event()
    log.hold_finish.update({job: threading.Event() for job in range(4)})
    reader = PeerReader("peer", log.start, log.finish)
    try:
        for job in range(4):
            reader.submit(job)
        log.hold[0].set()  # all four are queued when the first read begins
        for job in range(4):  # each read ends only once the one two behind it started
            log.wait_event(("start", min(job + 1, 3)))
            log.hold_finish[job].set()
        log.wait_finished(4)
        assert log.events == [("start", 0), ("start", 1), ("finish", 0), ("start", 2), ("finish", 1),
                              ("start", 3), ("finish", 2), ("finish", 3)]
        assert log.most_in_flight == 2
    finally:
        reader.stop()


def test_reader_starts_a_job_queued_while_it_waits_for_the_previous_read() -> None:
    """A layer ready just after the previous layer's read began is read alongside it, not
    after it: waiting for one read never delays the start of the next."""
    log = _Log()
    log.hold_finish[0] = threading.Event()
    reader = PeerReader("peer", log.start, log.finish)
    try:
        reader.submit(0)
        log.wait_event(("start", 0))
        reader.submit(1)  # job 0's read is being waited for
        log.wait_event(("start", 1))
        assert ("finish", 0) not in log.events
        log.hold_finish[0].set()
        log.wait_finished(2)
        assert log.events == [("start", 0), ("start", 1), ("finish", 0), ("finish", 1)]
    finally:
        reader.stop()


def test_reader_with_nothing_queued_ends_each_job_before_the_next() -> None:
    log = _Log()
    reader = PeerReader("peer", log.start, log.finish, depth=2)
    try:
        reader.submit(0)
        log.wait_finished(1)
        assert reader.idle_since is not None
        reader.submit(1)
        log.wait_finished(2)
        assert log.events == [("start", 0), ("finish", 0), ("start", 1), ("finish", 1)]
    finally:
        reader.stop()


def test_reader_of_depth_one_reads_serially() -> None:
    log = _Log()
    log.hold[0] = threading.Event()
    reader = PeerReader("peer", log.start, log.finish, depth=1)
    try:
        for job in range(3):
            reader.submit(job)
        log.hold[0].set()
        log.wait_finished(3)
        assert log.events == [("start", 0), ("finish", 0), ("start", 1), ("finish", 1), ("start", 2),
                              ("finish", 2)]
    finally:
        reader.stop()
    with pytest.raises(ValueError, match="depth=0"):
        PeerReader("peer", log.start, log.finish, depth=0)


def test_a_job_whose_start_raises_is_still_finished_and_the_reader_lives_on() -> None:
    log = _Log()
    reader = PeerReader("peer", log.start, log.finish)
    try:
        reader.submit(-1)  # start raises: finish still runs, without a handle
        reader.submit(5)
        log.wait_finished(2)
        # job 5 may start before job -1 is finished (it was queued): finishes keep their order
        assert [e for e in log.events if e[0] == "finish"] == [("finish", -1), ("finish", 5)]
        assert ("start", -1) not in log.events and ("start", 5) in log.events
        assert reader.alive()
    finally:
        reader.stop()


def test_stop_finishes_every_job_submitted_before_it_and_runs_none_after() -> None:
    log = _Log()
    log.hold[0] = threading.Event()
    reader = PeerReader("peer", log.start, log.finish)
    reader.submit(0)
    reader.submit(1)
    reader.stop(wait=False)
    reader.submit(2)  # after stop: never started
    log.hold[0].set()
    reader._thread.join(WAIT)
    assert not reader.alive()
    assert log.events == [("start", 0), ("start", 1), ("finish", 0), ("finish", 1)]


def test_reader_is_idle_only_when_every_job_ended() -> None:
    log = _Log()
    log.hold[0] = threading.Event()
    reader = PeerReader("peer", log.start, log.finish)
    try:
        assert reader.idle_since is not None
        reader.submit(0)
        reader.submit(1)
        assert reader.idle_since is None
        log.hold[0].set()
        log.wait_finished(2)
        end = time.monotonic() + WAIT
        while reader.idle_since is None and time.monotonic() < end:
            time.sleep(0.001)
        assert reader.idle_since is not None
    finally:
        reader.stop()


# ----------------------------------------------------------------- ReadRunner


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Failing(PendingRead):
    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def wait(self) -> int:
        raise self.exc


class _Engine(LoopbackEngine):
    """A loopback engine whose started reads fail as told; synchronous reads are counted
    and may fail too (``sync_errors`` in order), and may move the clock."""

    def __init__(self, clock: _Clock) -> None:
        super().__init__()
        self.clock = clock
        self.start_error: Exception | None = None
        self.raise_on_start: Exception | None = None
        self.sync_errors: list[Exception] = []
        self.sync_reads = 0
        self.read_takes_s = 0.0

    def start_read(self, peer, ops) -> PendingRead:
        if self.raise_on_start is not None:
            raise self.raise_on_start
        if self.start_error is not None:
            return _Failing(self.start_error)
        return DeferredRead(self, peer, list(ops))

    def _read(self, peer, ops) -> None:
        self.sync_reads += 1
        self.clock.now += self.read_takes_s
        if self.sync_errors:
            raise self.sync_errors.pop(0)
        super()._read(peer, ops)


@pytest.fixture
def pair():
    clock = _Clock()
    src, dst = np.arange(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
    peer, eng = LoopbackEngine(), _Engine(clock)
    peer.register(src.ctypes.data, 64)
    eng.register(dst.ctypes.data, 64)
    ops = [ReadOp(dst.ctypes.data, src.ctypes.data, 32), ReadOp(dst.ctypes.data + 32, src.ctypes.data + 32, 32)]
    item = P.ReadReady(request_id="r", layer=3, slot=3, generation=1, src_blocks=[0], main=True, index_lo=0,
                       index_hi=1)
    job = ReadJob(ParkedItem(b"id", "P", 0, 5.0, clock.now, item), RequestState("r", [0], 4, 1e9),
                  peer.endpoint, ops, budget_end=clock.now + 5.0)
    yield clock, eng, job, src, dst
    peer.close()
    eng.close()


def test_runner_reads_the_job_and_reports_its_descriptors_and_bytes(pair) -> None:
    clock, eng, job, src, dst = pair
    runner = ReadRunner(eng, retries=1, clock=clock)
    res = runner.finish(job, runner.start(job))
    assert (res.code, res.err, res.descriptors, res.nbytes, res.retries) == ("", "", 1, 64, 0)
    assert np.array_equal(src, dst)


def test_runner_retries_a_failed_started_read_with_a_whole_read(pair) -> None:
    clock, eng, job, src, dst = pair
    eng.start_error = TransferError("link reset")
    runner = ReadRunner(eng, retries=1, clock=clock)
    res = runner.finish(job, runner.start(job))
    assert (res.code, res.retries, eng.sync_reads) == ("", 1, 1)
    assert np.array_equal(src, dst)


def test_runner_retries_a_read_that_could_not_start(pair) -> None:
    clock, eng, job, src, dst = pair
    eng.raise_on_start = TransferError("not submitted")
    runner = ReadRunner(eng, retries=1, clock=clock)
    started = runner.start(job)
    assert isinstance(started, TransferError)
    res = runner.finish(job, started)
    assert (res.code, res.retries) == ("", 1) and np.array_equal(src, dst)


def test_runner_gives_up_when_retries_are_spent(pair) -> None:
    clock, eng, job, _src, dst = pair
    eng.start_error = TransferError("first")
    eng.sync_errors = [TransferError("second")]
    runner = ReadRunner(eng, retries=1, clock=clock)
    res = runner.finish(job, runner.start(job))
    assert (res.code, res.err, res.retries, res.descriptors) == (P.FAIL_READ, "second", 1, 0)
    assert not dst.any()


def test_runner_does_not_retry_past_the_budget(pair) -> None:
    clock, eng, job, _src, _dst = pair
    eng.start_error = TransferError("stalled")
    runner = ReadRunner(eng, retries=3, clock=clock)
    started = runner.start(job)
    clock.now = job.budget_end + 1
    res = runner.finish(job, started)
    assert (res.code, res.err, res.retries, eng.sync_reads) == (P.FAIL_READ, "stalled", 0, 0)


def test_runner_does_not_retry_a_bug_but_still_answers(pair) -> None:
    clock, eng, job, _src, _dst = pair
    eng.start_error = RuntimeError("engine bug")
    runner = ReadRunner(eng, retries=3, clock=clock)
    res = runner.finish(job, runner.start(job))
    assert (res.code, res.err, eng.sync_reads) == (P.FAIL_READ, "RuntimeError: engine bug", 0)
    res = runner.finish(job, None)  # the reader could not even call start
    assert res.code == P.FAIL_READ and "never started" in res.err


def test_runner_reports_a_read_that_ended_after_its_budget_as_late(pair) -> None:
    clock, eng, job, src, dst = pair
    eng.read_takes_s = 6.0  # the budget is 5 s
    runner = ReadRunner(eng, retries=1, clock=clock)
    res = runner.finish(job, runner.start(job))
    assert res.code == P.FAIL_LATE and "after its budget" in res.err and res.descriptors == 1
    assert np.array_equal(src, dst)  # the bytes landed, but prefill may have reused the slot


# ----------------------------------------------------------------- build_ops


def _layer(base: int, rng: random.Random, *, indexer: bool) -> P.LayerDesc:
    main_bytes, idx_bytes, n = 96, 32, 64
    interleaved = rng.random() < 0.5  # K/V blocks alternate in one buffer: no run spans two blocks
    stride = 2 * main_bytes if interleaved else main_bytes
    k = P.TensorDesc(base, main_bytes, stride, n)
    v = P.TensorDesc(base + (main_bytes if interleaved else n * main_bytes), main_bytes, stride, n)
    idx = P.TensorDesc(base + 4 * n * main_bytes, idx_bytes, idx_bytes, n) if indexer else None
    return P.LayerDesc(main=[k, v], indexer=idx)


def _per_block(src: P.LayerDesc, dst: P.LayerDesc, sb: list[int], db: list[int], ib: list[int] | None,
               lo: int, hi: int) -> list[ReadOp]:
    ops = [ReadOp(d_t.block_addr(d), s_t.block_addr(s), d_t.block_bytes)
           for s_t, d_t in zip(src.main, dst.main, strict=True) for s, d in zip(sb, db, strict=True)]
    if src.indexer is not None and dst.indexer is not None:
        idx = db if ib is None else ib
        ops += [ReadOp(dst.indexer.block_addr(idx[i]), src.indexer.block_addr(sb[i]), dst.indexer.block_bytes)
                for i in range(lo, hi)]
    return ops


def test_build_ops_reads_the_same_bytes_as_one_descriptor_per_block() -> None:
    rng = random.Random(7)
    for _ in range(300):
        has_idx = rng.random() < 0.8
        src, dst = _layer(1 << 30, rng, indexer=has_idx), _layer(1 << 34, rng, indexer=has_idx)
        n = rng.randint(0, 40)
        sb = rng.sample(range(64), n) if rng.random() < 0.4 else list(range(n))
        db = rng.sample(range(64), n) if rng.random() < 0.4 else list(range(64 - n, 64))
        ib = rng.sample(range(64), n) if rng.random() < 0.3 else None
        lo = rng.randint(0, n)
        hi = rng.randint(lo, n)
        ops = build_ops(src, dst, sb, db, main=True, index_range=(lo, hi), index_blocks=ib)
        assert coalesce(ops) == coalesce(_per_block(src, dst, sb, db, ib, lo, hi))


def test_build_ops_merges_consecutive_blocks_before_the_engine_does() -> None:
    rng = random.Random(1)
    src, dst = _layer(1 << 30, rng, indexer=True), _layer(1 << 34, rng, indexer=True)
    src = P.LayerDesc(main=[P.TensorDesc(1 << 30, 96, 96, 64)], indexer=src.indexer)
    dst = P.LayerDesc(main=[P.TensorDesc(1 << 34, 96, 96, 64)], indexer=dst.indexer)
    ops = build_ops(src, dst, [4, 5, 6, 9, 10], [0, 1, 2, 3, 7], main=True, index_range=(0, 5))
    # main: blocks 4-6 -> 0-2 are one run; 9 -> 3 continues it on the destination only; 10 -> 7 alone
    assert [o.length for o in ops] == [3 * 96, 96, 96, 3 * 32, 32, 32]


# ----------------------------------------------------------------- engines' start_read


def test_default_start_read_defers_the_read_to_wait() -> None:
    src, dst = np.arange(16, dtype=np.uint8), np.zeros(16, dtype=np.uint8)
    a, b = LoopbackEngine(), LoopbackEngine()
    a.register(src.ctypes.data, 16)
    b.register(dst.ctypes.data, 16)
    pending = b.start_read(a.endpoint, [ReadOp(dst.ctypes.data, src.ctypes.data, 16)])
    assert not dst.any()  # nothing moved yet: an engine without asynchronous reads
    assert pending.wait() == 1 and np.array_equal(src, dst)
    a.close()
    b.close()


def test_staged_start_read_lands_on_the_device_only_when_waited_for() -> None:
    src = torch.arange(4 * 8, dtype=torch.float32).view(4, 8)
    dst = torch.zeros(4, 8)
    with installed() as fake:
        dev = fake.place(dst)
        mirror = device.HostMirror()
        twin = mirror.twin(dev)
        peer = LoopbackEngine()
        peer.register(src.data_ptr(), src.numel() * 4)
        staged = StagedEngine(GuardedEngine(fake), mirror, [(dev, twin)])
        staged.register(twin.data_ptr(), twin.numel() * 4)
        pending = staged.start_read(peer.endpoint, [ReadOp(twin[2].data_ptr(), src[1].data_ptr(), 32)])
        assert not dst.any() and staged.landed_blocks == 0
        assert pending.wait() == 1
        assert torch.equal(dst[2], src[1]) and staged.landed_blocks == 1
        failed = staged.start_read("loopback:no-such-peer", [ReadOp(twin[3].data_ptr(), 1, 32)])
        with pytest.raises(TransferError):
            failed.wait()
        assert not dst[3].any() and staged.landed_blocks == 1  # a failed read lands nothing
        staged.close()
        peer.close()


def test_mooncake_keeps_two_reads_in_flight_and_fails_only_the_bad_one() -> None:
    pytest.importorskip("mooncake.engine")
    from ascend_offload.transfer.mooncake import MooncakeEngine

    a, b = MooncakeEngine(timeout_s=5), MooncakeEngine(timeout_s=5)
    try:
        src = np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8)
        dst = np.zeros(1 << 20, dtype=np.uint8)
        a.register(src.ctypes.data, src.nbytes)
        b.register(dst.ctypes.data, dst.nbytes)
        half = 1 << 19
        runs = [[ReadOp(dst.ctypes.data + h + i * 8192, src.ctypes.data + h + i * 8192, 4096) for i in range(8)]
                for h in (0, half)]
        first = b.start_read(a.endpoint, runs[0])
        second = b.start_read(a.endpoint, runs[1])
        bad = b.start_read(a.endpoint, [ReadOp(dst.ctypes.data + 4096, 12345678, 64)])  # not registered there
        assert (first.wait(), second.wait()) == (8, 8)
        assert second.wait() == 8  # waiting again answers the same
        for h in (0, half):
            for i in range(8):
                lo = h + i * 8192
                assert np.array_equal(dst[lo:lo + 4096], src[lo:lo + 4096])
        with pytest.raises(TransferError, match="1 of 1 runs failed"):
            bad.wait()
        with pytest.raises(TransferError):
            bad.wait()
        with pytest.raises(TransferError, match="could not be submitted"):
            b.start_read("127.0.0.1:1", runs[0][:1]).wait()
        assert b.read(a.endpoint, runs[0]) == 8  # the engine reads on after failures
    finally:
        a.close()
        b.close()


def test_mooncake_poll_sleeps_are_bounded_and_learn_nothing_across_reads() -> None:
    from ascend_offload.transfer import mooncake as mc

    sleep, waited, seen = mc._POLL_FIRST_S, 0.0, []
    while waited < 0.2:
        seen.append(sleep)
        waited += sleep
        sleep = mc.poll_sleep(sleep, waited)
    early = [s for s, w in zip(seen, np.cumsum(seen), strict=True) if w < mc._POLL_SLOW_AFTER_S]
    assert max(early) <= mc._POLL_CAP_S
    assert max(seen) <= mc._POLL_SLOW_CAP_S
    # a fresh wait starts from the first sleep again, whatever the previous read took
    assert mc.poll_sleep(mc._POLL_FIRST_S, 0.0) == 2 * mc._POLL_FIRST_S


class _StuckBatches:
    """transfer_check_status of a batch that never ends (a stalled peer)."""

    def __init__(self) -> None:
        self.polls = 0

    def transfer_check_status(self, bid: int) -> int:
        self.polls += 1
        return 0


def test_mooncake_wait_gives_up_at_its_bound_without_sleeping_past_it() -> None:
    from ascend_offload.transfer.mooncake import _MooncakeRead

    eng = _StuckBatches()
    read = _MooncakeRead(eng, "peer", [ReadOp(1, 2, 64)], 0.12)
    read.ids.append(7)
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="1 of 1 runs failed"):
        read.wait()
    took = time.monotonic() - t0
    assert 0.12 <= took < 0.12 + 0.1
    assert 10 < eng.polls < 2000  # polled with bounded sleeps: not spinning, not sleeping through
