"""Ordered copy queues: jobs run one at a time in submission order, named by tickets.

Why ordered: the layerwise pipeline puts a slot's store save and the next layer's
load into the same slot on one queue, so the load cannot start before the save's
copy ended (the reuse gate's *queued* consumers, see layerwise/gate.py), without
the submitting thread waiting for it. Why tickets: the model thread submits,
carries on computing, and later waits for exactly the job it needs, with a
deadline.

Two implementations of one interface (:class:`CopyQueue`), each taking its own kind
of job:

* :class:`NativeRowQueue` - host row copies on a C++ worker thread
  (``csrc_npu/copyqueue.cpp``): no Python and no GIL on the worker; the model
  thread's submit is one ctypes call, its wait releases the GIL. For host KV and
  row-addressable stores (the CPU backend; ``bench layerwise``).
* :class:`ThreadJobQueue` - Python callables on one Python thread: any store,
  accelerator staging copies. The fallback wherever the native queue cannot
  address the bytes.

Callers pick the queue once and then only submit, wait and reap through the
protocol; what a job *is* (a packed :class:`RowJob`, a callable) stays with the
code that built it.

Tickets are 1, 2, 3, ...; jobs finish in ticket order, so ``done()`` (the highest
finished ticket) says which jobs are over.
"""

from __future__ import annotations

import array
import collections
import ctypes
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar, Protocol, TypeVar

import torch

from ascend_offload import device, native
from ascend_offload.errors import AscendOffloadError

# The int32 index buffers NativeRowQueue.submit_rows takes (re-exported for callers).
int32_array = native.int32_array


class CopyQueueClosed(AscendOffloadError, RuntimeError):
    """A job was submitted to a closed queue."""


JobT_contra = TypeVar("JobT_contra", contravariant=True)


class CopyQueue(Protocol[JobT_contra]):
    """An ordered queue of copy jobs named by tickets (see module doc).

    ``native``: the worker runs without Python (no GIL taken per job); counted in stats.
    """

    native: ClassVar[bool]

    def submit(self, job: JobT_contra) -> int:
        """Queue ``job``; its ticket."""
        ...

    def done(self) -> int:
        """The highest finished ticket (every lower one is finished too)."""
        ...

    def wait(self, ticket: int, timeout_s: float) -> bool:
        """True once ``ticket`` finished; False at the deadline."""
        ...

    def take_result(self, ticket: int) -> Any:
        """The finished job's result; raises what made it fail."""
        ...

    def close(self) -> None:
        """Finish what is queued, then stop (idempotent)."""
        ...


class RowJob(ctypes.Array[ctypes.c_int64]):
    """One packed row copy for :meth:`NativeRowQueue.submit` (the C ABI's job struct:
    src, src rows, src index, dst, dst rows, dst index, count, row bytes, delay us).

    Why a named type: a job is packed ahead (at a step's start) and only its delay is
    set when it is submitted; the setter keeps the struct's layout in one place.
    """

    # the same type as ``ctypes.c_int64 * 9``, spelled so a type checker sees the base
    _type_ = ctypes.c_int64
    _length_ = 9
    __slots__ = ()

    @property
    def delay_s(self) -> float:
        """Seconds the worker sleeps before the copy (a test hook of slow saves)."""
        return self[8] / 1e6

    @delay_s.setter
    def delay_s(self, seconds: float) -> None:
        self[8] = int(seconds * 1e6)


class NativeRowQueue:
    """``dst[dst_idx[i]] = src[src_idx[i]]`` row jobs on one native worker thread.

    The calls go through the CPython fast-call trampoline when it builds (~0.1 us
    against ~3 us for ctypes' argument conversion), else ctypes. ``done()`` and the
    failure count are read from the queue's status words, without a call.

    ``spin_us``: the worker polls that long for new work before it sleeps (a submit
    wakes only a sleeping worker: ~40 us for the submitter on the test VM);
    ``wait_spin_us``: a waiter polls that long for its ticket (GIL released) before it
    sleeps. Both measured in bench layerwise (docs/bench-layerwise.md).
    """

    native: ClassVar[bool] = True

    def __init__(self, spin_us: int = 200, wait_spin_us: int = 1000) -> None:
        lib = native.load()
        if lib is None:
            raise RuntimeError("native copy queue unavailable (no native library)")
        self._lib = lib
        fast = native.fastcall()
        if fast is not None:
            fns = {n: native.address_of(lib, f"ao_cq_{n}") for n in
                   ("create", "destroy", "status", "submit", "wait", "take")}
            self._call: Callable[[str, int, int, int, bool], int] = (
                lambda n, a, b, c, rel: fast(fns[n], a, b, c, rel))
        else:
            self._call = lambda n, a, b, c, rel: getattr(lib, f"ao_cq_{n}")(a, b, c) or 0
        self._h = int(self._call("create", max(0, spin_us), max(0, wait_spin_us), 0, False))
        status = int(self._call("status", self._h, 0, 0, False))
        self._status = (ctypes.c_int64 * 2).from_address(status)
        self._failed_seen = 0
        self._submitted = 0
        self._closed = False

    @staticmethod
    def available() -> bool:
        return native.available()

    def prepare_rows(self, src: torch.Tensor, src_idx: array.array, dst: torch.Tensor,
                     dst_idx: array.array, delay_s: float = 0.0) -> RowJob:
        """Check and pack one row copy between 2-D contiguous host tensors with equal row
        bytes, for :meth:`submit` (pack ahead, submit in the hot path). The caller
        keeps ``src``/``dst`` and the index arrays alive until the job is submitted, and the
        tensors until it is done (the worker copies the indices at submit)."""
        row_bytes = src.stride(0) * src.element_size()
        if (dst.stride(0) * dst.element_size() != row_bytes or len(src_idx) != len(dst_idx)
                or not device.is_host(src) or not device.is_host(dst)):
            raise ValueError("submit_rows: host tensors with equal row bytes and index counts")
        return RowJob(
            src.data_ptr(), src.shape[0], src_idx.buffer_info()[0], dst.data_ptr(),
            dst.shape[0], dst_idx.buffer_info()[0], len(src_idx), row_bytes, int(delay_s * 1e6))

    def submit(self, job: RowJob) -> int:
        """Queue a job packed by :meth:`prepare_rows`; its ticket."""
        if self._closed:
            raise CopyQueueClosed("native copy queue is closed")
        t = int(self._call("submit", self._h, ctypes.addressof(job), 0, False))
        if t < 0:
            raise MemoryError("native copy queue: no memory for a job's index lists")
        self._submitted = t
        return t

    def submit_rows(self, src: torch.Tensor, src_idx: array.array, dst: torch.Tensor,
                    dst_idx: array.array, delay_s: float = 0.0) -> int:
        """Queue one row copy (see :meth:`prepare_rows`); its ticket."""
        return self.submit(self.prepare_rows(src, src_idx, dst, dst_idx, delay_s))

    def done(self) -> int:
        return self._submitted if self._closed else int(self._status[0])

    def wait(self, ticket: int, timeout_s: float) -> bool:
        """True once ``ticket`` finished; False at the deadline (GIL released while waiting)."""
        if self._closed or self._status[0] >= ticket:
            return True
        return bool(self._call("wait", self._h, ticket, max(0, int(timeout_s * 1e6)), True))

    def take_result(self, ticket: int) -> None:
        """Raise ``IndexError`` if the finished job ``ticket`` copied nothing (a bad row)."""
        if self._closed or self._status[1] == self._failed_seen:
            return
        rc = int(self._call("take", self._h, ticket, 0, False))
        if rc:
            self._failed_seen += 1
            raise IndexError(f"copy job {ticket}: row index pair {-rc - 1} out of range")

    def close(self) -> None:
        """Finish what is queued, then stop the worker (idempotent)."""
        if not self._closed:
            self._closed = True
            self._call("destroy", self._h, 0, 0, True)


class ThreadJobQueue:
    """Python callables run in submission order on one thread; results kept per ticket."""

    native: ClassVar[bool] = False

    def __init__(self, name: str = "ao-copy") -> None:
        self._cv = threading.Condition()
        self._jobs: collections.deque[tuple[int, Callable[[], Any]]] = collections.deque()
        self._results: dict[int, tuple[bool, Any]] = {}
        self._submitted = 0
        self._done = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> int:
        with self._cv:
            if self._closed:
                raise CopyQueueClosed("copy queue is closed")
            self._submitted += 1
            self._jobs.append((self._submitted, fn))
            self._cv.notify_all()
            return self._submitted

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._closed:
                    self._cv.wait()
                if not self._jobs:
                    return
                ticket, fn = self._jobs.popleft()
            try:
                res: tuple[bool, Any] = (True, fn())
            except BaseException as exc:  # kept for take_result; the thread lives on
                res = (False, exc)
            with self._cv:
                self._results[ticket] = res
                self._done = ticket
                self._cv.notify_all()

    def done(self) -> int:
        return self._done

    def wait(self, ticket: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._done < ticket:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
            return True

    def take_result(self, ticket: int) -> Any:
        """The finished job's return value; re-raises its exception."""
        with self._cv:
            ok, value = self._results.pop(ticket, (True, None))
        if not ok:
            raise value
        return value

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()
