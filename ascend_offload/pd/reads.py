"""How decode reads one ready layer: the read descriptors of a contributor's share
(:func:`build_ops`) and one serial reader thread per prefill peer
(:class:`PeerReader`). Used by :class:`~ascend_offload.pd.consumer.Consumer`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ascend_offload.pd import protocol as P
from ascend_offload.transfer.base import ReadOp

log = logging.getLogger(__name__)


def build_ops(src: P.LayerDesc, dst: P.LayerDesc, src_blocks: Sequence[int], dst_blocks: Sequence[int], *,
              main: bool, index_range: tuple[int, int],
              index_blocks: Sequence[int] | None = None) -> list[ReadOp]:
    """Read descriptors for one contributor's share of one layer (before coalescing).

    ``index_blocks`` is the indexer's destination when it is not ``dst_blocks``
    (main KV into a host pool, indexer into device blocks)."""
    ops: list[ReadOp] = []
    if main:
        for s_t, d_t in zip(src.main, dst.main, strict=True):
            ops += [ReadOp(d_t.block_addr(d), s_t.block_addr(s), d_t.block_bytes)
                    for s, d in zip(src_blocks, dst_blocks, strict=True)]
    if src.indexer is not None and dst.indexer is not None:
        s_t, d_t = src.indexer, dst.indexer
        idx_dst = dst_blocks if index_blocks is None else index_blocks
        ops += [ReadOp(d_t.block_addr(idx_dst[i]), s_t.block_addr(src_blocks[i]), d_t.block_bytes)
                for i in range(*index_range)]
    return ops


class PeerReader:
    """Serial reads from one prefill endpoint on their own thread.

    A stalled prefill (alive, not answering) blocks a read until the transfer
    engine's deadline; with one thread per peer it stalls only its own
    requests, while the I/O thread keeps answering, expiring deadlines and
    reading from others. ``run`` must post a result for every job whatever
    happens (the consumer's reader does, in a ``finally``). The owner retires
    an idle reader (:attr:`idle_since`), so advertised endpoints cannot pile
    up threads.
    """

    def __init__(self, endpoint: str, run: Callable[[Any], None], *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.endpoint = endpoint
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._run = run
        self._clock = clock
        self._lock = threading.Lock()
        self._pending = 0
        self._idle_since: float | None = clock()
        self._thread = threading.Thread(target=self._loop, name=f"pd-read-{endpoint}", daemon=True)
        self._thread.start()

    @property
    def idle_since(self) -> float | None:
        """When the last job ended (None while a job is queued or running)."""
        with self._lock:
            return self._idle_since

    def submit(self, job: Any) -> None:
        with self._lock:
            self._pending += 1
            self._idle_since = None
        self._q.put(job)

    def _loop(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            try:
                self._run(job)
            except Exception:  # a bug in one read must not kill the peer's reader
                log.exception("reader for %s failed on a job", self.endpoint)
            finally:
                with self._lock:
                    self._pending -= 1
                    if not self._pending:
                        self._idle_since = self._clock()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, *, wait: bool = True) -> None:
        self._q.put(None)
        if wait:
            self._thread.join(timeout=2)
