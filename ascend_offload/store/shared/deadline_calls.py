"""Library calls waited for at most a deadline, on a small pool of threads.

Why: measured with memcache_hybrid 1.3.0 on loopback, the first call after the meta
service died blocked 60 s whatever the client's own timeout said. A call that
overruns keeps its thread until the library returns (nothing can cancel it); while
every thread is held by such a call, new calls are not even submitted, so a caller
never queues behind a dead service.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Callable
from typing import Any

#: ``DeadlineCalls.call`` results that are not the library's answer.
OVERRAN = object()  # waited ``timeout_s``; the call may still run (and write its buffers)
NOT_SENT = object()  # every thread is held by an overrun call: nothing was submitted


class DeadlineCalls:
    """``call(fn, *args)``: ``fn``'s result, :data:`OVERRAN` or :data:`NOT_SENT`."""

    def __init__(self, timeout_s: float, threads: int, name: str) -> None:
        if timeout_s <= 0 or threads < 1:
            raise ValueError(f"timeout_s={timeout_s} and threads={threads} must be > 0")
        self.timeout_s = timeout_s
        self._threads = threads
        self._pool = cf.ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._overrun = 0  # calls past their deadline that still hold a thread

    @property
    def overrun(self) -> int:
        """Calls past their deadline still running in the library."""
        with self._lock:
            return self._overrun

    def call(self, fn: Callable[..., Any], *args: Any,
             on_late: Callable[[], None] | None = None) -> Any:
        """``fn(*args)``'s result, :data:`OVERRAN` or :data:`NOT_SENT`. ``on_late``: for a call
        that overran, called once when it really ended (from the call's thread, or here if
        it ended meanwhile): only then are the buffers it reads or writes free again."""
        with self._lock:
            if self._overrun >= self._threads:
                return NOT_SENT
        try:
            fut = self._pool.submit(fn, *args)
        except RuntimeError:  # shut down
            return NOT_SENT
        try:
            return fut.result(timeout=self.timeout_s)
        except cf.TimeoutError:
            with self._lock:
                self._overrun += 1
            fut.add_done_callback(lambda f: self._done(f, on_late))
            return OVERRAN

    def _done(self, _fut: cf.Future[Any], on_late: Callable[[], None] | None) -> None:
        with self._lock:
            self._overrun -= 1
        if on_late is not None:
            on_late()

    def shutdown(self) -> None:
        """Stop taking calls; never waits on an overrun one."""
        self._pool.shutdown(wait=False, cancel_futures=True)
