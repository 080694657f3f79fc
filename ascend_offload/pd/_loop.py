"""A background I/O thread that alone owns a set of ZMQ sockets.

ZMQ sockets are not thread-safe, while producer/consumer calls come from
engine threads. So callers only mutate state under a lock and ``wake()`` the
loop; the loop thread does every send and receive. The wake-up is a socket
pair registered in the ZMQ poller, so a publish costs microseconds, not a poll
interval.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

import zmq

log = logging.getLogger(__name__)


class IoLoop:
    """Runs ``on_tick(readable_sockets)`` whenever a socket is readable, on wake, or at ``next_wait()``."""

    def __init__(self, name: str, on_tick: Callable[[list[zmq.Socket]], None],
                 next_wait: Callable[[], float]) -> None:
        self._on_tick = on_tick
        self._next_wait = next_wait
        self._poller = zmq.Poller()
        self._socks: set[zmq.Socket] = set()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._poller.register(self._wake_r.fileno(), zmq.POLLIN)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def add(self, sock: zmq.Socket) -> None:
        """Poll ``sock`` (loop thread only, or before start)."""
        self._poller.register(sock, zmq.POLLIN)
        self._socks.add(sock)

    def remove(self, sock: zmq.Socket) -> None:
        if sock in self._socks:
            self._poller.unregister(sock)
            self._socks.discard(sock)

    def wake(self, *, hand_off: bool = False) -> None:
        """Make the loop tick. ``hand_off``: then step aside for a moment so it ticks now:
        Python passes the GIL on only when its holder blocks, so a caller that goes on
        running Python (a model thread publishing, then computing the next layer) would
        otherwise hold the loop back until its next blocking call, or for the
        interpreter's switch interval (5 ms)."""
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):
            pass  # already a wake-up pending, or closing
        if hand_off:
            time.sleep(HANDOFF_S)

    def _run(self) -> None:
        while not self._stop.is_set():
            timeout_ms = max(0, min(int(self._next_wait() * 1000), 200))
            try:
                events = dict(self._poller.poll(timeout_ms))
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    return
                log.error("poll failed: %s", exc)
                continue
            if self._wake_r.fileno() in events:
                try:
                    while self._wake_r.recv(4096):
                        pass
                except (BlockingIOError, OSError):
                    pass
            if self._stop.is_set():
                return
            ready = [s for s in self._socks if s in events]
            try:
                self._on_tick(ready)
            except Exception as exc:  # the loop must survive a bug in one tick
                log.exception("P/D I/O loop tick failed")
                self.error = exc

    def stop(self) -> None:
        self._stop.set()
        self.wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        self._wake_r.close()
        self._wake_w.close()


HANDOFF_S = 50e-6  # long enough for a waiting thread to take the GIL (it wakes in ~10-50 us)
