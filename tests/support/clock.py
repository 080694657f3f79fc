"""A clock that moves only when a test moves it.

Deadline code in the library takes a ``clock`` callable. Tests that check what
happens *before* or *after* a deadline drive it with :class:`ManualClock`, so
the outcome never depends on how fast a loaded machine runs the threads.
"""

from __future__ import annotations

import threading


class ManualClock:
    """``clock()`` returns ``t``; :meth:`advance` moves it (thread-safe)."""

    def __init__(self, start: float = 1000.0) -> None:
        self._lock = threading.Lock()
        self.t = start

    def __call__(self) -> float:
        with self._lock:
            return self.t

    def advance(self, seconds: float) -> float:
        with self._lock:
            self.t += seconds
            return self.t
