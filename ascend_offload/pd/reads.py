"""How decode reads one ready layer: the checks before it (:func:`item_error`), the read
descriptors of a contributor's share (:func:`build_ops`) and one serial reader thread
per prefill peer (:class:`PeerReader`). Used by :class:`~ascend_offload.pd.consumer.Consumer`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ascend_offload.pd import protocol as P
from ascend_offload.pd._loop import HANDOFF_S
from ascend_offload.pd.consumer_records import ReadJob, ReadResult
from ascend_offload.pd.layout import RowArea, block_capacity, incompatibility, out_of_range
from ascend_offload.pd.topology import Topology
from ascend_offload.transfer.base import (
    DeferredRead,
    PendingRead,
    ReadOp,
    TransferEngine,
    TransferError,
)

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
    """Read descriptors for one contributor's share of one layer: blocks that follow each other
    on both sides already merged into one run (the engine still coalesces across tensors).

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
            ops += _block_runs(s_t, d_t, zip(src_blocks, dst_blocks, strict=True))
    if src.indexer is not None and dst.indexer is not None:
        idx_dst = dst_blocks if index_blocks is None else index_blocks
        lo, hi = index_range
        ops += _block_runs(src.indexer, dst.indexer, zip(src_blocks[lo:hi], idx_dst[lo:hi], strict=True))
    return ops


def _block_runs(s_t: P.TensorDesc, d_t: P.TensorDesc, pairs: Iterable[tuple[int, int]]) -> list[ReadOp]:
    """One descriptor per run of (source, destination) blocks that follow each other in
    memory on both sides, not one per block.

    Why here: a descriptor object per block and their merge by ``coalesce`` cost ~0.3 ms
    of Python per layer (96 blocks) on the decode's I/O and reader threads, time the
    transfer threads need; plain integer arithmetic finds the same runs for a fraction."""
    out: list[ReadOp] = []
    n = d_t.block_bytes
    s0, ss, d0, ds = s_t.base_addr, s_t.block_stride, d_t.base_addr, d_t.block_stride
    local = remote = length = 0
    for s, d in pairs:
        la, ra = d0 + d * ds, s0 + s * ss
        if length and la == local + length and ra == remote + length:
            length += n
            continue
        if length:
            out.append(ReadOp(local, remote, length))
        local, remote, length = la, ra, n
    if length:
        out.append(ReadOp(local, remote, length))
    return out


class ReadRunner:
    """What a reader thread does with one :class:`~ascend_offload.pd.consumer_records.ReadJob`:
    begin its batched read (:meth:`start`), later wait for it, retrying a failed read while
    ``retries`` and the job's budget last, and judge it (:meth:`finish`). Nothing here
    raises: every job ends as a :class:`~ascend_offload.pd.consumer_records.ReadResult`,
    so its item is always answered."""

    def __init__(self, transfer: TransferEngine, *, retries: int, clock: Callable[[], float]) -> None:
        self.transfer = transfer
        self.retries = retries
        self.clock = clock

    def start(self, job: ReadJob) -> PendingRead | Exception:
        """Begin the read (the previous job's may still be in flight); what could not even
        start comes back as the exception."""
        try:
            return self.transfer.start_read(job.endpoint, job.ops)
        except Exception as exc:
            return exc

    def finish(self, job: ReadJob, started: PendingRead | Exception | None) -> ReadResult:
        """Wait for the read; ``late`` when it ended after the job's budget."""
        err, ndesc, retries = self._wait(job, started)
        code = P.FAIL_READ if err else ""
        if not err and self.clock() > job.budget_end:
            code, err = P.FAIL_LATE, "read finished after its budget; prefill may have reused the slot"
        return ReadResult(job.parked, job.req, code, err, ndesc, sum(o.length for o in job.ops), retries)

    def _wait(self, job: ReadJob, started: PendingRead | Exception | None) -> tuple[str, int, int]:
        """(error, "" when the bytes are in place; descriptors; retries used). A
        :class:`TransferError` is retried with whole synchronous reads; anything else is a
        bug: not retried, but still an answer."""
        it, used = job.parked.item, 0
        try:
            while True:
                try:
                    if started is None:
                        raise RuntimeError("read was never started")
                    if isinstance(started, Exception):
                        raise started
                    return "", started.wait(), used
                except TransferError as exc:
                    if used < self.retries and self.clock() < job.budget_end:
                        used += 1
                        log.warning("read attempt %d of request %r layer %d failed: %s; retrying",
                                    used, it.request_id, it.layer, exc)
                        started = DeferredRead(self.transfer, job.endpoint, job.ops)
                        continue
                    return str(exc), 0, used
        except Exception as exc:
            log.exception("read of request %r layer %d from %s failed", it.request_id, it.layer, job.endpoint)
            return f"{type(exc).__name__}: {exc}", 0, used


class PeerReader:
    """Reads from one prefill endpoint on two threads of their own: a *starter* that begins
    each job's read as soon as the job is queued and fewer than ``depth`` reads are in
    flight, and a *finisher* that waits for the started reads in order and posts their
    results.

    A stalled prefill (alive, not answering) blocks a read until the transfer
    engine's deadline; with threads per peer it stalls only its own
    requests, while the I/O thread keeps answering, expiring deadlines and
    reading from others.

    Jobs run in submission order in two steps: ``start(job)`` begins the read and
    returns a handle (on the transfer engine, :meth:`~ascend_offload.transfer.base.TransferEngine.start_read`),
    ``finish(job, handle)`` waits for it and posts the result. Up to ``depth`` jobs are
    started and not yet finished. Why two threads: one thread that starts and waits
    can start a job queued while it waits only after that wait ends, so a layer arriving
    just after the read before it began would idle behind it; the starter begins it at
    once, and the link never idles between layers while results are posted. ``finish``
    must post a result for every job whatever happens, and is called for every started
    job, also when stopping (a started read may still land bytes until it is waited
    for). The owner retires an idle reader (:attr:`idle_since`), so advertised
    endpoints cannot pile up threads.
    """

    def __init__(self, endpoint: str, start: Callable[[Any], Any], finish: Callable[[Any, Any], None], *,
                 depth: int = 2, clock: Callable[[], float] = time.monotonic) -> None:
        if depth < 1:
            raise ValueError(f"depth={depth}: must be >= 1")
        self.endpoint = endpoint
        self.depth = depth
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()  # jobs to start; None: stop
        self._started: queue.SimpleQueue[Any] = queue.SimpleQueue()  # (job, handle); None: stop
        self._slots = threading.Semaphore(depth)  # one per read started and not finished
        self._start = start
        self._finish = finish
        self._clock = clock
        self._lock = threading.Lock()
        self._pending = 0
        self._idle_since: float | None = clock()
        self._starter = threading.Thread(target=self._start_loop, name=f"pd-read-start-{endpoint}", daemon=True)
        self._thread = threading.Thread(target=self._finish_loop, name=f"pd-read-{endpoint}", daemon=True)
        self._starter.start()
        self._thread.start()

    @property
    def idle_since(self) -> float | None:
        """When the last job ended (None while a job is queued, started or running)."""
        with self._lock:
            return self._idle_since

    def submit(self, job: Any) -> None:
        """Queue ``job``. To an idle reader, the caller then steps aside for a moment: Python
        passes the GIL on only when its holder blocks, so the read would otherwise start
        after the rest of the caller's work (the I/O thread validating the other layers
        that arrived with this one), not now."""
        with self._lock:
            idle = not self._pending
            self._pending += 1
            self._idle_since = None
        self._q.put(job)
        if idle:
            time.sleep(HANDOFF_S)

    def _start_loop(self) -> None:
        while True:
            job = self._q.get()
            if job is None:  # start nothing more; the finisher ends what was started
                self._started.put(None)
                return
            # Released by the finisher when a read ends, which the engine's deadline bounds.
            self._slots.acquire()
            self._started.put((job, self._call(self._start, job)))

    def _finish_loop(self) -> None:
        while True:
            item = self._started.get()
            if item is None:
                return
            try:
                self._end(*item)
            finally:
                self._slots.release()

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception:  # a bug in one read must not kill the peer's reader
            log.exception("reader for %s failed on a job", self.endpoint)
            return None

    def _end(self, job: Any, handle: Any) -> None:
        try:
            self._call(self._finish, job, handle)
        finally:
            with self._lock:
                self._pending -= 1
                if not self._pending:
                    self._idle_since = self._clock()

    def alive(self) -> bool:
        return self._starter.is_alive() and self._thread.is_alive()

    def stop(self, *, wait: bool = True) -> None:
        """Stop once every job submitted before is finished (a later one is never run)."""
        self._q.put(None)
        if wait:
            self._starter.join(timeout=2)
            self._thread.join(timeout=2)

