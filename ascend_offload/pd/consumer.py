"""Decode side of the P/D pull: validate, read each layer in one batch, answer.

One consumer per decode TP rank binds a ZMQ ROUTER on its port. For each
``read_ready`` item it checks everything it is about to trust — the sender's
place in the topology, tensor counts and sizes against its own layout, block
ids against both sides' block counts, the contributor's main/indexer share —
then issues one batched transfer-engine read (contiguous runs coalesced) and
answers ``read_done`` or ``read_failed``. A request is received only when
every layer is terminal on every contributing prefill rank; anything that
failed, timed out or finished past its read budget turns into load errors for
exactly the decode blocks it should have filled (invariant I2).

The destination is either the rank's own KV blocks (any model) or, with
sparse decode offload, the host KV pool for the main KV
(:meth:`Consumer.expect_pool`; layout from
:func:`~ascend_offload.pd.layout.pool_layer_descs`): the pool's layer regions
are registered like any KV tensor, a request's destination blocks are its
pool blocks, and an indexer cache, if present, still goes to device blocks
(``index_blocks``).

A third destination serves hybrid residency (a request whose main KV lives in
device rows borrowed from the indexer cache, ``sparse/hybrid.py``): per-token
rows at a fixed pitch from a per-layer base (:class:`~ascend_offload.pd.layout.RowArea`,
given at construction), one row table per request (:meth:`Consumer.expect_rows`,
or ``expect_pool(..., rows=)``). Consecutive rows are read as one run; the
indexer still goes to the request's device blocks. The rows must lie inside the
registered layout (they are checked against its extents at construction).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import zmq

from ascend_offload.pd import protocol as P
from ascend_offload.pd._loop import IoLoop
from ascend_offload.pd.auth import ControlKeys, ServerAuth, secure_server
from ascend_offload.pd.consumer_records import (
    BlockPool,
    ConsumerStats,
    ParkedItem,
    ReadJob,
    ReadResult,
    RecvOutcome,
    RequestState,
)
from ascend_offload.pd.layout import (
    RowArea,
    block_capacity,
    extents,
    out_of_range,
    row_area_error,
    row_runs,
)
from ascend_offload.pd.reads import PeerReader, ReadRunner, affected_blocks, build_ops, item_error
from ascend_offload.pd.topology import Topology
from ascend_offload.transfer.base import PendingRead, ReadOp, TransferEngine

# Largest control message accepted (ZMQ_MAXMSGSIZE): a peer sending more is disconnected.
DEFAULT_MAX_MSG_BYTES = 64 << 20

log = logging.getLogger(__name__)


class Consumer:
    """One decode TP rank's reader. Thread-safe; sockets and reads run on its I/O thread."""

    def __init__(
        self,
        *,
        engine_id: str,
        d_rank: int,
        topology: Topology,
        transfer: TransferEngine,
        layers: Sequence[P.LayerDesc],
        host: str = "127.0.0.1",
        port: int,
        read_timeout_s: float = 30.0,
        request_timeout_s: float = 120.0,
        read_retries: int = 1,
        max_parked: int = 100_000,
        max_peers: int = 256,
        reader_idle_s: float = 60.0,
        max_msg_bytes: int = DEFAULT_MAX_MSG_BYTES,
        keys: ControlKeys | None = None,
        register_memory: bool = True,
        pool_block_size: int | None = None,
        row_areas: Sequence[RowArea] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``pool_block_size``: set when ``layers`` describe a host KV pool
        (:func:`~ascend_offload.pd.layout.pool_layer_descs`); size mismatches are
        then reported in pool row bytes. ``row_areas`` (one per layer, with
        ``pool_block_size``): where :meth:`expect_rows` puts a request's main KV, one
        token per row; each must lie inside the registered extents of ``layers``.

        Peers choose their engine ids and endpoints, so what they can make us
        hold is bounded: at most ``max_peers`` prefill metadata entries (least
        recently used evicted; an evicted sender is asked to resend) and reader
        threads (one per endpoint, retired after ``reader_idle_s`` idle), and no
        message over ``max_msg_bytes``. ``keys`` (see :mod:`~ascend_offload.pd.auth`)
        admits only peers holding the shared secret.
        """
        topology.contributors(d_rank)  # validates d_rank
        if max_peers < 1 or reader_idle_s <= 0 or max_msg_bytes < 1:
            raise ValueError(f"max_peers={max_peers}, reader_idle_s={reader_idle_s}, "
                             f"max_msg_bytes={max_msg_bytes}: all must be > 0")
        self.max_peers = max_peers
        self.reader_idle_s = reader_idle_s
        self.max_parked = max_parked
        self.engine_id = engine_id
        self.d_rank = d_rank
        self.topology = topology
        self.transfer = transfer
        self.layers = list(layers)
        self.read_timeout_s = read_timeout_s
        self.request_timeout_s = request_timeout_s
        self.read_retries = read_retries
        self.pool_block_size = pool_block_size
        self.row_areas = list(row_areas) if row_areas is not None else None
        if self.row_areas is not None:
            if pool_block_size is None or len(self.row_areas) != len(self.layers):
                raise ValueError(f"{len(self.row_areas)} row areas for {len(self.layers)} layers "
                                 f"(pool_block_size={pool_block_size}): one per layer, with a pool "
                                 "block size")
            for i, (area, layer) in enumerate(zip(self.row_areas, self.layers, strict=True)):
                if len(layer.main) != 1:
                    raise ValueError(f"layer {i}: a row destination needs one main tensor, the "
                                     f"layout has {len(layer.main)}")
                why = row_area_error(area, self.layers, block_size=pool_block_size,
                                     main_block_bytes=layer.main[0].block_bytes)
                if why:
                    raise ValueError(f"layer {i} row area: {why}")
        self.stats = ConsumerStats()
        self._clock = clock
        self._registered: list[int] = []
        if register_memory:
            for addr, length in extents(self.layers):
                transfer.register(addr, length)
                self._registered.append(addr)
        self._lock = threading.Lock()
        self._requests: dict[str, RequestState] = {}
        self._parked: dict[str, list[ParkedItem]] = {}
        self._metas: OrderedDict[tuple[str, int], P.MfMeta] = OrderedDict()  # LRU, <= max_peers
        self._commands: list[tuple[str, str]] = []
        self._readers: dict[str, PeerReader] = {}
        self._runner = ReadRunner(transfer, retries=read_retries, clock=clock)
        self._results: list[ReadResult] = []
        self._finished: list[RecvOutcome] = []
        self._finished_cv = threading.Condition(self._lock)
        # With keys: a context of our own whose ZAP handler admits only the derived client key.
        self._auth = ServerAuth(keys)
        self._ctx = self._auth.context
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
        # Handover lets a reconnecting prefill keep its identity; without authentication it would
        # let any peer take a prefill's identity (and its replies), so only with keys.
        self._router.setsockopt(zmq.ROUTER_HANDOVER, int(keys is not None))
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        secure_server(self._router, keys)
        try:
            self._router.bind(f"tcp://{host}:{port}")
        except BaseException:
            self._router.close(linger=0)
            self._auth.close()
            raise
        self.address = f"tcp://{host}:{port}"
        self._loop = IoLoop(f"pd-consumer-{d_rank}", self._tick, self._next_wait)
        self._loop.add(self._router)
        self._loop.start()

    # ------------------------------------------------------------ caller API

    def expect(self, request_id: str, dst_blocks: Sequence[int], num_layers: int | None = None, *,
               index_blocks: Sequence[int] | None = None) -> None:
        """Decode allocated ``dst_blocks`` for this request; reads may start (or resume).

        ``index_blocks`` (aligned with ``dst_blocks``) is where the indexer goes
        when main KV goes elsewhere (a host pool); by default both use ``dst_blocks``.
        """
        n = len(self.layers) if num_layers is None else num_layers
        if not 0 < n <= len(self.layers):
            raise ValueError(f"request {request_id!r}: num_layers={n} outside 1..{len(self.layers)}")
        blocks = self._check_blocks(request_id, dst_blocks, n, "main" if index_blocks is not None else "all")
        idx = None
        if index_blocks is not None:
            idx = self._check_blocks(request_id, index_blocks, n, "indexer")
            if len(idx) != len(blocks):
                raise ValueError(f"request {request_id!r}: {len(idx)} indexer blocks for {len(blocks)} "
                                 "main-KV blocks")
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request {request_id!r} already expected")
            self._requests[request_id] = RequestState(request_id, blocks, n,
                                                  self._clock() + self.request_timeout_s, index_blocks=idx)
        self._loop.wake()

    def _check_blocks(self, request_id: str, blocks_in: Sequence[int], n: int, part: str) -> list[int]:
        blocks = [int(b) for b in blocks_in]
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"request {request_id!r}: duplicate destination blocks")
        cap = block_capacity(self.layers[:n], part=part)
        bad = out_of_range(blocks, cap)
        if bad:
            raise ValueError(f"request {request_id!r}: destination blocks {bad[:8]} outside 0..{cap - 1}")
        return blocks

    def expect_rows(self, request_id: str, rows: Sequence[int], blocks: Sequence[int],
                    num_layers: int | None = None) -> None:
        """Expect the request with its main KV into per-token rows of every layer's row area.

        ``rows[j]``: the row of wire position ``j`` (position 0 is the first token of the
        first wire block); ``blocks``: the request's device blocks, one per wire block: the
        indexer's destination (if the layout has one) and what a failed outcome reports.
        ``rows`` covers the prompt only: ``len(blocks) - 1`` full blocks and a last one of
        1..block_size tokens; the rest of the last source block is not read (no row past
        the prompt is written).
        """
        if self.row_areas is None or self.pool_block_size is None:
            raise ValueError(f"request {request_id!r}: this consumer has no row areas")
        n = len(self.layers) if num_layers is None else num_layers
        if not 0 < n <= len(self.layers):
            raise ValueError(f"request {request_id!r}: num_layers={n} outside 1..{len(self.layers)}")
        table = [int(r) for r in rows]
        bs = self.pool_block_size
        nblocks = len(blocks)
        if not (nblocks - 1) * bs < len(table) <= nblocks * bs:
            raise ValueError(f"request {request_id!r}: {len(table)} destination rows for {nblocks} "
                             f"blocks of {bs} tokens")
        if len(set(table)) != len(table):
            raise ValueError(f"request {request_id!r}: duplicate destination rows")
        cap = min(a.num_rows for a in self.row_areas[:n])
        bad = out_of_range(table, cap)
        if bad:
            raise ValueError(f"request {request_id!r}: destination rows {bad[:8]} outside 0..{cap - 1}")
        has_indexer = any(layer.indexer is not None for layer in self.layers[:n])
        dst = (self._check_blocks(request_id, blocks, n, "indexer") if has_indexer
               else [int(b) for b in blocks])
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request {request_id!r} already expected")
            self._requests[request_id] = RequestState(request_id, dst, n,
                                                      self._clock() + self.request_timeout_s,
                                                      row_runs=row_runs(table, bs))
        self._loop.wake()

    def expect_pool(self, request_id: str, pool: BlockPool, *, prompt_tokens: int, max_tokens: int,
                    index_blocks: Sequence[int] | None = None, shared: Sequence[int] = (),
                    rows: Sequence[int] | None = None) -> bool:
        """Reserve the request's rows in the host pool and expect its prompt KV there.

        ``max_tokens`` (prompt + max new tokens) is reserved now, so decode
        never runs out of rows later. If the pool cannot admit the request, it
        ends at once as a failed outcome naming the request and the pool's
        reason (its readiness items are refused as ``unknown_request``);
        other requests are unaffected and nothing is overwritten. Returns
        whether the request is expected. The caller releases the pool rows
        (``pool.release``) when decode finished with them and this request's
        outcome arrived (no read into them in flight).

        ``shared``: pool blocks of cached prefix blocks the table starts with (the pool's
        prefix cache): the prompt's first ``len(shared)`` blocks are not read, the wire
        (and ``index_blocks``, all of the prompt's) starts after them.

        ``rows`` (a row per prompt position, with ``index_blocks``): the pool rows are
        reserved all the same, but the main KV lands in these rows of the row areas
        (:meth:`expect_rows`), not in the pool.
        """
        with self._lock:
            if request_id in self._requests:  # before admission: a refused duplicate must not fail the original
                raise ValueError(f"request {request_id!r} already expected")
        if not 0 < prompt_tokens <= max_tokens:
            raise ValueError(f"request {request_id!r}: need 0 < prompt_tokens={prompt_tokens} <= "
                             f"max_tokens={max_tokens}")
        if rows is not None and (index_blocks is None or len(rows) < prompt_tokens):
            raise ValueError(f"request {request_id!r}: a row destination needs index_blocks and a "
                             f"row for each of the {prompt_tokens} prompt positions ({len(rows)})")
        try:
            table = pool.admit(request_id, max_tokens, shared)
        except Exception as exc:  # PoolCapacityError and friends: this request only
            reason = f"host KV pool admission failed for request {request_id!r}: {exc}"
            log.error("%s", reason)
            self.fail(request_id, reason)
            return False
        nblocks = -(-prompt_tokens // pool.block_size)
        skip = len(shared)
        try:
            if rows is not None:
                assert index_blocks is not None
                self.expect_rows(request_id, rows[skip * pool.block_size:prompt_tokens],
                                 index_blocks[skip:])
            else:
                self.expect(request_id, [int(b) for b in table[skip:nblocks]],
                            index_blocks=None if index_blocks is None else index_blocks[skip:])
        except ValueError:
            pool.release(request_id)
            raise
        return True

    def fail(self, request_id: str, reason: str) -> None:
        """End a request as failed (aborted, registration failed); always yields an outcome.

        Runs on the I/O thread between reads, so when the outcome appears no
        read into the request's blocks is in flight and they may be reused.
        """
        with self._lock:
            self._commands.append((request_id, reason))
        self._loop.wake()

    def finished(self) -> list[RecvOutcome]:
        """Drain requests that became terminal."""
        with self._lock:
            out, self._finished = self._finished, []
        return out

    def wait_finished(self, count: int, timeout_s: float) -> list[RecvOutcome]:
        """Block until ``count`` outcomes are available (or the deadline); drains them."""
        end = time.monotonic() + timeout_s
        with self._finished_cv:
            while len(self._finished) < count:
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._finished_cv.wait(left)
            out, self._finished = self._finished, []
        return out

    def active(self) -> list[str]:
        """Requests still being received (for leak checks)."""
        with self._lock:
            return sorted(self._requests)

    def peers(self) -> tuple[int, int]:
        """(prefill metadata entries held, reader threads alive): both bounded by ``max_peers``."""
        with self._lock:
            return len(self._metas), len(self._readers)

    def parked(self) -> int:
        """Readiness messages parked for requests not started yet (bounded by ``max_parked``)."""
        with self._lock:
            return sum(len(ps) for ps in self._parked.values())

    def inflight(self) -> int:
        """Reads submitted to reader threads and not answered yet (for leak checks)."""
        with self._lock:
            return sum(r.inflight for r in self._requests.values())

    def close(self) -> None:
        self._loop.stop()
        self._router.close(linger=0)
        self._auth.close()
        for r in self._readers.values():
            r.stop()
        self._readers.clear()
        for addr in self._registered:
            try:
                self.transfer.unregister(addr)
            except Exception:
                log.debug("unregister %#x failed", addr, exc_info=True)
        self._registered.clear()

    # ------------------------------------------------------------ I/O thread

    def _remember(self, meta: P.MfMeta) -> None:
        """Keep a sender's metadata; the least recently used beyond ``max_peers`` is dropped."""
        with self._lock:
            key = (meta.engine_id, meta.p_rank)
            self._metas[key] = meta
            self._metas.move_to_end(key)
            while len(self._metas) > self.max_peers:
                old, _ = self._metas.popitem(last=False)
                self.stats.metas_evicted += 1
                log.warning("forgot mf_meta of prefill %s rank %d (%d peers held); it is asked again "
                            "on its next item", old[0], old[1], self.max_peers)

    def _retire_readers(self, now: float, *, keep: int) -> None:
        """Stop reader threads idle for ``reader_idle_s`` (all idle ones while above ``keep``)."""
        idle = sorted((r.idle_since, ep) for ep, r in self._readers.items() if r.idle_since is not None)
        for since, ep in idle:
            if now - since < self.reader_idle_s and len(self._readers) <= keep:
                continue
            self._readers.pop(ep).stop(wait=False)
            self.stats.readers_retired += 1

    def _next_wait(self) -> float:
        now = self._clock()
        with self._lock:
            ds = [r.deadline for r in self._requests.values() if r.deadline != float("inf")]
            ds += [p.received + p.budget_s for ps in self._parked.values() for p in ps]
        return max(0.0, min(ds) - now) if ds else 0.2

    def _reply(self, ident: bytes, msg: P.ReadDone | P.ReadFailed) -> None:
        try:
            self._router.send_multipart([ident, P.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone (ROUTER_MANDATORY) or queue full
            log.warning("could not answer prefill %r: %s", ident, exc)

    def _fail(self, ident: bytes, p_rank: int, it: P.ReadReady, code: str, reason: str) -> None:
        self.stats.failed += 1
        log.warning("read_failed request %r layer %d from prefill rank %d: %s: %s",
                    it.request_id, it.layer, p_rank, code, reason)
        self._reply(ident, P.ReadFailed(
            version=P.PROTOCOL_VERSION, engine_id=self.engine_id, d_rank=self.d_rank, p_rank=p_rank,
            request_id=it.request_id, layer=it.layer, slot=it.slot, generation=it.generation,
            code=code, reason=reason[:4000],
        ))

    def _terminal(self, req: RequestState, p_rank: int, layer: int, ok: bool, reason: str = "") -> None:
        """Record one (layer, contributor) result; finish the request when all are in."""
        key = (layer, p_rank)
        if key in req.done:
            return
        req.done[key] = ok
        if not ok:
            main, index = affected_blocks(self.topology, self.layers[layer], p_rank, req.dst_blocks,
                                          req.index_blocks)
            req.failed |= main
            req.failed_index |= index
            req.reasons.append(f"layer {layer} rank {p_rank}: {reason}")
        self._maybe_finish(req)

    def _maybe_finish(self, req: RequestState) -> None:
        """Report a request once all its items are terminal *and* no read into it is in flight.

        The second condition is what makes a failure safe to act on: vLLM may
        recompute into these blocks as soon as it hears, so no late write may follow.
        """
        if req.finished or req.inflight or len(req.done) < req.num_layers * self.topology.ratio:
            return
        req.finished = True
        if self._requests.get(req.request_id) is req:
            del self._requests[req.request_id]
        self._finished.append(RecvOutcome(req.request_id, not req.reasons, tuple(sorted(req.failed)),
                                          tuple(req.reasons), tuple(sorted(req.failed_index))))
        self._finished_cv.notify_all()

    def _ops(self, meta: P.MfMeta, req: RequestState, it: P.ReadReady) -> list[ReadOp]:
        area = None
        if req.row_runs is not None:
            assert self.row_areas is not None
            area = self.row_areas[it.layer]
        return build_ops(meta.layers[it.layer], self.layers[it.layer], it.src_blocks, req.dst_blocks,
                         main=it.main, index_range=(it.index_lo, it.index_hi), index_blocks=req.index_blocks,
                         row_runs=req.row_runs, row_area=area)

    def _serve(self, p: ParkedItem) -> None:
        """Validate, read and answer one item (I/O thread, lock not held during the read)."""
        it = p.item
        with self._lock:
            req = self._requests.get(it.request_id)
            meta = self._metas.get((p.engine_id, p.p_rank))
            if meta is not None:
                self._metas.move_to_end((p.engine_id, p.p_rank))
        if req is None:
            self._fail(p.ident, p.p_rank, it, P.FAIL_UNKNOWN_REQUEST,
                       f"request {it.request_id!r} is not (or no longer) expected here")
            return
        if (it.layer, p.p_rank) in req.done:
            self._fail(p.ident, p.p_rank, it, P.FAIL_INVALID,
                       f"duplicate item for layer {it.layer} from prefill rank {p.p_rank}")
            return
        bad = item_error(self.topology, self.d_rank, self.layers, meta, p.p_rank, it, num_layers=req.num_layers,
                         num_blocks=len(req.dst_blocks), pool_block_size=self.pool_block_size)
        if bad is not None:
            self._fail(p.ident, p.p_rank, it, *bad)
            if it.layer < req.num_layers and p.p_rank in self.topology.contributors(self.d_rank):
                with self._lock:
                    if self._requests.get(it.request_id) is req:
                        self._terminal(req, p.p_rank, it.layer, False, f"{bad[0]}: {bad[1]}")
            return
        assert meta is not None
        ops = self._ops(meta, req, it)
        if not ops:  # a contributor with nothing to send: acknowledge at once
            empty = ReadResult(p, req, "", "", 0, 0, 0)
            self._answer(empty)
            with self._lock:
                self.stats.acked_empty += 1
                self._record(empty, counted=False)
            return
        budget_end = p.received + min(p.budget_s, self.read_timeout_s)
        reader = self._readers.get(meta.endpoint)
        if reader is None:
            if len(self._readers) >= self.max_peers:
                self._retire_readers(self._clock(), keep=self.max_peers - 1)
            if len(self._readers) >= self.max_peers:
                reason = f"{self.max_peers} prefill endpoints have reads in flight; refusing a new one"
                self._fail(p.ident, p.p_rank, it, P.FAIL_READ, reason)
                with self._lock:
                    if self._requests.get(it.request_id) is req:
                        self._terminal(req, p.p_rank, it.layer, False, f"{P.FAIL_READ}: {reason}")
                return
            reader = self._readers[meta.endpoint] = PeerReader(meta.endpoint, self._runner.start,
                                                               self._finish_read, clock=self._clock)
        with self._lock:
            req.inflight += 1
        reader.submit(ReadJob(p, req, meta.endpoint, ops, budget_end))

    def _finish_read(self, job: ReadJob, started: PendingRead | Exception | None) -> None:
        """Reader thread: wait for the read and record its outcome at once (a request whose
        last read this was is reported from here, no hand-off); only the answer to prefill
        waits for the I/O thread, which owns the socket."""
        res = self._runner.finish(job, started)
        with self._lock:
            self._record(res)
            self._results.append(res)
        self._loop.wake()

    def _record(self, r: ReadResult, *, counted: bool = True) -> None:
        """Under the lock, any thread: count one item's read and make its (layer, contributor) terminal."""
        it = r.parked.item
        if counted:
            r.req.inflight -= 1
            self.stats.read_retries += r.retries
            if not r.code or r.code == P.FAIL_LATE:
                self.stats.reads += 1
                self.stats.descriptors += r.descriptors
            if not r.code:
                self.stats.bytes_read += r.nbytes
        if self._requests.get(it.request_id) is r.req:
            self._terminal(r.req, r.parked.p_rank, it.layer, not r.code, f"{r.code}: {r.err}")
        self._maybe_finish(r.req)

    def _answer(self, r: ReadResult) -> None:
        """I/O thread: tell prefill how one item's read ended."""
        p, it = r.parked, r.parked.item
        if r.code:
            self._fail(p.ident, p.p_rank, it, r.code, r.err)
        else:
            self._reply(p.ident, P.ReadDone(
                version=P.PROTOCOL_VERSION, engine_id=self.engine_id, d_rank=self.d_rank, p_rank=p.p_rank,
                request_id=it.request_id, layer=it.layer, slot=it.slot, generation=it.generation,
            ))

    def _drain_results(self) -> None:
        with self._lock:
            results, self._results = self._results, []
        for r in results:
            self._answer(r)

    def _run_commands(self) -> None:
        with self._lock:
            cmds, self._commands = self._commands, []
        for rid, reason in cmds:
            with self._lock:
                parked = self._parked.pop(rid, [])
                req = self._requests.get(rid)
                if req is None:
                    self._finished.append(RecvOutcome(rid, False, (), (reason,)))
                    self._finished_cv.notify_all()
                else:
                    for layer in range(req.num_layers):
                        for r in self.topology.contributors(self.d_rank):
                            self._terminal(req, r, layer, False, reason)
            for p in parked:
                self._fail(p.ident, p.p_rank, p.item, P.FAIL_UNKNOWN_REQUEST, reason)

    def _tick(self, ready: list[zmq.Socket]) -> None:
        self._drain_results()
        self._run_commands()
        work: list[ParkedItem] = []
        if ready:
            while True:
                try:
                    frames = self._router.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) != 2:
                    self.stats.rejected += 1
                    log.warning("rejected %d-frame message", len(frames))
                    continue
                ident, data = frames
                try:
                    msg = P.decode(data, expect=P.TO_DECODE)
                except P.ProtocolError as exc:
                    self.stats.rejected += 1
                    log.warning("rejected message from %r: %s", ident, exc)
                    continue
                now = self._clock()
                if isinstance(msg, P.MfMeta):
                    self._remember(msg)
                    continue
                assert isinstance(msg, P.ReadReadyBatch)
                for it in msg.items:
                    self.stats.items += 1
                    # A garbled budget must not park items forever: never beyond our own read timeout.
                    budget = min(msg.read_budget_ms / 1000.0, self.read_timeout_s)
                    work.append(ParkedItem(ident, msg.engine_id, msg.p_rank, budget, now, it))
        now = self._clock()
        with self._lock:
            # Items that arrived before expect(): serve them once it happens.
            for rid in [r for r in self._parked if r in self._requests]:
                work[:0] = self._parked.pop(rid)
            run: list[ParkedItem] = []
            refused: list[ParkedItem] = []
            n_parked = sum(len(v) for v in self._parked.values())
            for p in work:
                if p.item.request_id in self._requests:
                    run.append(p)
                elif n_parked >= self.max_parked:
                    refused.append(p)
                else:
                    self._parked.setdefault(p.item.request_id, []).append(p)
                    self.stats.parked += 1
                    n_parked += 1
            expired: list[ParkedItem] = []
            for rid in list(self._parked):
                keep = [p for p in self._parked[rid] if p.received + p.budget_s > now]
                expired += [p for p in self._parked[rid] if p.received + p.budget_s <= now]
                if keep:
                    self._parked[rid] = keep
                else:
                    del self._parked[rid]
        for p in expired:
            self._fail(p.ident, p.p_rank, p.item, P.FAIL_UNKNOWN_REQUEST,
                       f"request {p.item.request_id!r} was never expected within the read budget")
        for p in refused:
            self._fail(p.ident, p.p_rank, p.item, P.FAIL_UNKNOWN_REQUEST,
                       f"request {p.item.request_id!r} is not expected and {self.max_parked} items are parked")
        for p in run:
            self._serve(p)
        self._drain_results()
        self._run_commands()
        now = self._clock()
        self._retire_readers(now, keep=self.max_peers)
        with self._lock:
            for req in list(self._requests.values()):
                if req.deadline <= now:
                    req.deadline = float("inf")  # handled once; in-flight reads may still hold it open
                    missing = [(layer, r) for layer in range(req.num_layers)
                               for r in self.topology.contributors(self.d_rank) if (layer, r) not in req.done]
                    log.error("request %r: %d (layer, prefill rank) reads missing after %.1fs%s",
                              req.request_id, len(missing), self.request_timeout_s,
                              f"; waiting for {req.inflight} reads in flight" if req.inflight else "")
                    for layer, r in missing:
                        self._terminal(req, r, layer, False, "timeout: not read before the deadline")
