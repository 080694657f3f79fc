"""Ordered copy queues: FIFO order across jobs, bounded waits, explicit job failures."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ascend_offload import native
from ascend_offload.transfer.copy_queue import (
    CopyQueueClosed,
    NativeRowQueue,
    ThreadJobQueue,
    int32_array,
)


def _native(monkeypatch: pytest.MonkeyPatch, fast: bool) -> NativeRowQueue:
    if not native.available():
        pytest.fail("the native library must build here (g++ comes with make bootstrap)")
    if not fast:
        monkeypatch.setattr(native, "fastcall", lambda: None)
    return NativeRowQueue(spin_us=50)


@pytest.mark.parametrize("fast", [True, False])
def test_native_jobs_run_in_order(monkeypatch: pytest.MonkeyPatch, fast: bool) -> None:
    q = _native(monkeypatch, fast)
    a = torch.arange(8 * 64, dtype=torch.float32).view(8, 64)
    b = torch.zeros_like(a)
    c = torch.zeros_like(a)
    rows = int32_array(range(8))
    rev = int32_array(reversed(range(8)))
    t1 = q.submit_rows(a, rows, b, rev, delay_s=0.05)  # slow first job
    t2 = q.submit_rows(b, rows, c, rows)  # reads what job 1 writes
    assert (t1, t2) == (1, 2)
    assert q.wait(t2, 10.0)
    assert q.done() == 2
    q.take_result(t1)
    q.take_result(t2)
    assert torch.equal(c, a.flip(0)), "job 2 ran before job 1 finished"
    q.close()


def test_native_wait_is_bounded_and_bad_rows_fail_their_job(monkeypatch: pytest.MonkeyPatch) -> None:
    q = _native(monkeypatch, True)
    src = torch.ones(4, 16)
    dst = torch.zeros(4, 16)
    t = q.submit_rows(src, int32_array([0]), dst, int32_array([1]), delay_s=2.0)
    assert q.wait(t, 0.02) is False
    assert q.done() < t  # the wait ended at its own deadline, not with the job
    bad = q.submit_rows(src, int32_array([0, 9]), dst, int32_array([2, 3]))
    ok = q.submit_rows(src, int32_array([3]), dst, int32_array([3]))
    assert q.wait(ok, 10.0)
    q.take_result(t)
    with pytest.raises(IndexError, match="pair 1"):
        q.take_result(bad)
    q.take_result(ok)
    assert dst[1].eq(1).all() and dst[2].eq(0).all() and dst[3].eq(1).all()
    with pytest.raises(ValueError, match="equal row bytes"):
        q.submit_rows(src, int32_array([0]), torch.zeros(4, 8), int32_array([0]))
    q.close()


def test_a_packed_jobs_delay_is_set_before_submit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job packed ahead gets its delay at submit through the named field; the worker
    honours it (the wait times out first) and still copies."""
    q = _native(monkeypatch, True)
    src = torch.full((2, 16), 3.0)
    dst = torch.zeros(2, 16)
    rows, rev = int32_array([0, 1]), int32_array([1, 0])  # alive until submitted
    job = q.prepare_rows(src, rows, dst, rev)
    assert job.delay_s == 0.0
    job.delay_s = 1.0
    assert job.delay_s == pytest.approx(1.0)
    t = q.submit(job)
    assert q.wait(t, 0.02) is False and q.done() < t
    assert q.wait(t, 10.0)
    q.take_result(t)
    assert dst.eq(3.0).all()
    q.close()


def test_native_close_finishes_queued_work(monkeypatch: pytest.MonkeyPatch) -> None:
    q = _native(monkeypatch, True)
    src = torch.full((2, 32), 7.0)
    dst = torch.zeros(2, 32)
    t = q.submit_rows(src, int32_array([0, 1]), dst, int32_array([1, 0]), delay_s=0.05)
    q.close()
    assert q.done() == t and q.wait(t, 0.0)
    assert dst.eq(7.0).all()
    with pytest.raises(CopyQueueClosed):
        q.submit_rows(src, int32_array([0]), dst, int32_array([0]))
    q.close()  # idempotent


def test_thread_queue_order_errors_and_deadline() -> None:
    q = ThreadJobQueue("t")
    seen: list[int] = []

    def job(i: int, delay: float = 0.0) -> int:
        time.sleep(delay)
        seen.append(i)
        return i * 10

    def boom() -> None:
        raise RuntimeError("disk on fire")

    t1 = q.submit(lambda: job(1, 0.05))
    t2 = q.submit(boom)
    t3 = q.submit(lambda: job(3))
    assert q.wait(t3, 10.0) and q.done() == 3
    assert seen == [1, 3]
    assert q.take_result(t1) == 10
    with pytest.raises(RuntimeError, match="disk on fire"):
        q.take_result(t2)
    release = threading.Event()
    t4 = q.submit(lambda: (release.wait(30), job(4))[1])
    assert q.wait(t4, 0.02) is False  # the job cannot finish before the release: the wait's deadline
    assert q.done() == 3
    release.set()
    q.close()  # runs what is queued first
    assert seen == [1, 3, 4]
    with pytest.raises(CopyQueueClosed):
        q.submit(lambda: None)
