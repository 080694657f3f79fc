"""How decode reads one ready layer: the checks before it (:func:`item_error`), the read
descriptors of a contributor's share (:func:`build_ops`) and one serial reader thread
per prefill peer (:class:`PeerReader`). Used by :class:`~ascend_offload.pd.consumer.Consumer`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ascend_offload.pd import protocol as P
from ascend_offload.pd.layout import RowArea, block_capacity, incompatibility, out_of_range
from ascend_offload.pd.topology import Topology
from ascend_offload.transfer.base import ReadOp

log = logging.getLogger(__name__)


def item_error(topology: Topology, d_rank: int, layers: Sequence[P.LayerDesc], meta: P.MfMeta | None,
               p_rank: int, it: P.ReadReady, *, num_layers: int, num_blocks: int,
               pool_block_size: int | None = None) -> tuple[str, str] | None:
    """Why decode rank ``d_rank`` must not read item ``it`` from prefill rank ``p_rank``
    (failure code, reason), or None. ``layers`` is decode's layout; ``num_layers`` and
    ``num_blocks`` are the request's. Everything the item claims is checked against both
    sides' layouts before a byte is read."""
    if meta is None:
        return P.FAIL_NO_META, f"no mf_meta from prefill rank {p_rank}"
    if p_rank not in topology.contributors(d_rank):
        return P.FAIL_INVALID, (f"prefill rank {p_rank} does not feed decode rank {d_rank} "
                                f"(prefill tp={topology.p_tp}, decode tp={topology.d_tp})")
    if meta.p_tp != topology.p_tp:
        return P.FAIL_INVALID, f"prefill tp={meta.p_tp} but decode expects prefill tp={topology.p_tp}"
    if it.layer >= num_layers or it.layer >= len(meta.layers):
        return P.FAIL_INVALID, (f"layer {it.layer} outside request's {num_layers} layers / "
                                f"prefill's {len(meta.layers)}")
    n = num_blocks
    if len(it.src_blocks) != n:
        return P.FAIL_INVALID, f"{len(it.src_blocks)} source blocks for {n} destination blocks"
    if it.main != topology.sends_main(p_rank):
        return P.FAIL_INVALID, f"main={it.main} from member {topology.member_of(p_rank)}"
    if (it.index_lo, it.index_hi) != topology.index_range(p_rank, n):
        return P.FAIL_INVALID, (f"indexer range [{it.index_lo}, {it.index_hi}) != expected "
                                f"{topology.index_range(p_rank, n)}")
    src, dst = meta.layers[it.layer], layers[it.layer]
    why = incompatibility(src, dst, pool_block_size=pool_block_size)
    if why:
        return P.FAIL_INVALID, f"layer {it.layer}: {why}"
    cap = block_capacity([src])
    bad = out_of_range(it.src_blocks, cap)
    if bad:
        return P.FAIL_INVALID, f"source blocks {bad[:8]} >= prefill num_blocks {cap}"
    return None


def affected_blocks(topology: Topology, desc: P.LayerDesc, p_rank: int, dst_blocks: Sequence[int],
                    index_blocks: Sequence[int] | None) -> tuple[set[int], set[int]]:
    """Blocks one contributor's item of one layer would have filled: (destination blocks,
    indexer blocks when the indexer has its own destination). A failed item makes exactly
    these load errors."""
    main: set[int] = set()
    if topology.sends_main(p_rank) and desc.main:
        main.update(dst_blocks)
    if desc.indexer is None:
        return main, set()
    if index_blocks is None:
        lo, hi = topology.index_range(p_rank, len(dst_blocks))
        main.update(dst_blocks[lo:hi])
        return main, set()
    lo, hi = topology.index_range(p_rank, len(index_blocks))
    return main, set(index_blocks[lo:hi])


def build_ops(src: P.LayerDesc, dst: P.LayerDesc, src_blocks: Sequence[int], dst_blocks: Sequence[int], *,
              main: bool, index_range: tuple[int, int],
              index_blocks: Sequence[int] | None = None,
              row_runs: Sequence[tuple[int, int, int, int]] | None = None,
              row_area: RowArea | None = None) -> list[ReadOp]:
    """Read descriptors for one contributor's share of one layer (before coalescing).

    ``index_blocks`` is the indexer's destination when it is not ``dst_blocks``
    (main KV into a host pool, indexer into device blocks). ``row_runs`` (from
    :func:`~ascend_offload.pd.layout.row_runs`) with ``row_area``: the main KV goes to
    per-token rows instead of blocks (one main tensor; a run copies ``n`` tokens of one
    source block, starting at token ``j``, to rows ``r..r+n-1``), and only the positions
    the row table names are read (no row past the prompt is written)."""
    ops: list[ReadOp] = []
    if main and row_runs is not None:
        assert row_area is not None and len(src.main) == 1, "row destination: one main tensor"
        s_t, rb = src.main[0], row_area.row_bytes
        ops += [ReadOp(row_area.base_addr + r * rb, s_t.block_addr(src_blocks[k]) + j * rb, n * rb)
                for k, j, r, n in row_runs]
    elif main:
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
