"""Layer I/O for the layerwise pipeline: one layer's blocks between its KV tensor and
the store, as jobs on one ordered copy queue, and the store bookkeeping of each job
(pin, allocate, commit, unpin) until it is reaped.

Why apart from the orchestration (pipeline.py): the pipeline decides *when* a
layer's slot is loaded and saved (gate, prefetch, slot order); this module decides
*how* the bytes move. The model thread does the bookkeeping, submits, and later
waits for the ticket it needs with the GIL released; the queue's worker only copies.

Two implementations of one interface, picked once per pipeline
(``pipeline.open_layer_io``):

* ``RowLayerIO`` (row_io.py) - host KV with contiguous block rows and a
  row-addressable store: a layer's load or save is one native row job
  (``NativeRowQueue``), no Python on the worker; a step's bookkeeping is planned
  in one pass at its start.
* :class:`JobLayerIO` (here) - anything else: Python jobs (``ThreadJobQueue``) that
  copy per block between host KV and the store, or stage a layer through one host
  buffer for accelerator KV (``device.blocks_from_host`` / ``device.blocks_to_host``).

Both share this module's :class:`LayerIO`: job tracking, reaping, pinning, and the
Python copies (the row path falls back to them for objects that are not rows).
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from ascend_offload import device
from ascend_offload.layerwise.gate import ConsumerToken, GateError, ReuseGate
from ascend_offload.layerwise.steps import BlockRef, KeyFn, LoadTimeout, PipelineStats, default_key
from ascend_offload.store.base import KVStore, Pin, WriteHandle
from ascend_offload.transfer.copy_queue import CopyQueue, ThreadJobQueue

log = logging.getLogger(__name__)

# Per layer: the refs it loads, or the refs it saves (a step plan's input).
LayerRefs = Iterable[tuple[str, Sequence[BlockRef]]]


def block_rows(kv: torch.Tensor, block_dim: int) -> torch.Tensor | None:
    """``kv`` as ``[num_blocks, block bytes]`` rows (block-first and contiguous), else None."""
    if block_dim != 0 or not kv.is_contiguous() or kv.shape[0] == 0:
        return None
    return kv.view(kv.shape[0], -1)


@dataclasses.dataclass
class LoadJob:
    """A queued load: unpinned and counted when reaped."""

    ticket: int
    layer: str
    pin: Pin | None  # None: held by the step plan
    block_ids: list[int]
    native: bool


@dataclasses.dataclass
class SaveJob:
    """A queued save: committed (or aborted) and counted when reaped."""

    ticket: int
    layer: str
    handles: list[WriteHandle]
    native: bool
    unit_errors: list[BaseException]  # shared by the jobs of one unit
    token: ConsumerToken | None = None  # released after the unit's last job is reaped
    # why its step gave up waiting (a deadline): reaped as failed, never committed
    abandoned: str = ""


class LayerIO(abc.ABC):
    """The shared part: job tracking and reaping, pinning, the per-block Python copies.

    ``stats`` and ``lock`` are the pipeline's (one set of counters); ``kv``, ``rows_of``
    and ``page_bytes`` are its per-layer registry (written by its ``register_kv_caches``,
    only read here).
    """

    queue: CopyQueue[Any]

    def __init__(
        self,
        store: KVStore,
        kv: Mapping[str, torch.Tensor],
        rows_of: Mapping[str, torch.Tensor | None],
        page_bytes: Mapping[str, int],
        *,
        block_dim: int,
        key_fn: KeyFn,
        gate: ReuseGate,
        stats: PipelineStats,
        lock: threading.Lock,
        drain_timeout_s: float,
    ) -> None:
        self.store = store
        self.block_dim = block_dim
        self.key_fn = key_fn
        self.gate = gate
        self._kv = kv
        self._rows_of = rows_of
        self._page_bytes = page_bytes
        self._stats = stats
        self._lock = lock
        self._drain_timeout_s = drain_timeout_s
        self._load_errors: set[int] = set()
        # Layer -> device blocks whose load failed in the current step (added when counted;
        # the pipeline clears it at each step start): their requests' saves from the first
        # such layer on are dropped.
        self.step_failed_blocks: dict[str, set[int]] = {}
        # Test hook (the store's ``debug.fail_layer_loads``): this many next layer loads
        # fail as a broken store read would; 0 in production.
        self.fail_loads = 0
        self._jobs: collections.deque[LoadJob | SaveJob] = collections.deque()  # ticket order
        # one copy stream per direction, so a load never waits on an unrelated save's copies
        self._load_stream = device.new_stream()
        self._save_stream = device.new_stream()
        self.queue = self._open_queue()
        log.debug("layerwise: copy queue %s", type(self.queue).__name__)

    @abc.abstractmethod
    def _open_queue(self) -> CopyQueue[Any]:
        """The copy queue this path submits to (made once, at construction)."""

    # ------------------------------------------------------------------ the interface

    def plan_step(self, loads: LayerRefs, saves: LayerRefs) -> None:
        """Do a step's store bookkeeping ahead where that pays (no-op here); ``loads`` and
        ``saves`` are only iterated by an implementation that plans."""
        return None  # Python jobs do their bookkeeping per layer

    def end_plan(self) -> None:
        """Release what :meth:`plan_step` held and the step did not use (no-op here)."""
        return None

    def queue_load(self, layer: str, refs: Sequence[BlockRef]) -> int:
        """Pin ``layer``'s objects and queue their copy into its blocks; the ticket, or 0
        when nothing was queued (missing objects are load errors, counted now)."""
        if self._injected_load_failure(layer, refs):
            return 0
        pin, refs, keys, failed = self._pin(layer, refs)
        if failed:
            self._count_load(layer, 0, failed)
        if pin is None:
            return 0
        if not refs:
            self.store.unpin(pin)
            return 0
        try:
            job = self._submit_load(layer, pin, refs, keys)
        except BaseException:
            self.store.unpin(pin)
            raise
        return 0 if job is None else self._enqueue(job)

    def _injected_load_failure(self, layer: str, refs: Sequence[BlockRef]) -> bool:
        """The ``fail_loads`` test hook: fail this layer load whole (its blocks are load
        errors, nothing copied) while the count lasts."""
        if self.fail_loads <= 0 or not refs:
            return False
        self.fail_loads -= 1
        log.warning("layerwise: load of layer %s failed: injected (debug.fail_layer_loads)", layer)
        self._count_load(layer, 0, [r.block_id for r in refs])
        return True

    def queue_save(self, layer: str, refs: Sequence[BlockRef], errors: list[BaseException],
                   delay_s: float) -> int:
        """Allocate ``layer``'s objects of ``refs`` and queue the copy of its blocks into
        them; the ticket, or 0 (store full, all duplicates, or copied here). ``errors`` is
        shared by the jobs of one unit (see :meth:`release_after`)."""
        size = self._page_bytes[layer]
        keys = self.keys(refs, layer)
        got = self.store.allocate(keys, [size] * len(keys))
        if got is None:
            with self._lock:
                self._stats.save_skipped += len(keys)
            return 0
        pairs = self._allocated(refs, got)
        with self._lock:
            self._stats.save_duplicates += len(keys) - len(pairs)
        if not pairs:
            return 0
        handles = [h for _, h in pairs]
        try:
            job = self._submit_save(layer, pairs, handles, errors, delay_s)
        except BaseException:
            self.store.abort(handles)
            raise
        return 0 if job is None else self._enqueue(job)

    def release_after(self, errors: list[BaseException], gate_slot: int, generation: int,
                      unit: str) -> None:
        """Register the saves just queued for ``unit`` (the jobs sharing ``errors``) as one
        *queued* consumer of the slot's contents, released when the last is reaped (its
        commit done); nothing when none was queued (all stored already, or copied here)."""
        with self._lock:
            last = self._jobs[-1] if self._jobs else None
        if isinstance(last, SaveJob) and last.unit_errors is errors:
            last.token = self.gate.add_consumer(gate_slot, generation, f"store-save {unit}",
                                                queued=True)

    def reap(self) -> None:
        """Finish the bookkeeping of every copy job that ended (in ticket order): unpin
        loads and record their errors; commit (or abort) saves and release their consumers."""
        q = self.queue
        done = q.done()
        while True:
            with self._lock:
                if not self._jobs or self._jobs[0].ticket > done:
                    return
                job = self._jobs.popleft()
            if isinstance(job, LoadJob):
                self._reap_load(job)
            else:
                self._reap_save(job)

    def take_load_errors(self) -> set[int]:
        """Device block ids whose load failed since the last call."""
        self.reap()
        with self._lock:
            out, self._load_errors = self._load_errors, set()
            return out

    def pump(self, left_s: float) -> bool:
        """Gate pump: wait (GIL released) for the oldest queued copy and reap it. False
        when nothing is queued (the slot waits for someone else's consumer)."""
        with self._lock:
            ticket = self._jobs[0].ticket if self._jobs else 0
        if not ticket:
            return False
        self.queue.wait(ticket, max(0.0, left_s))
        self.reap()
        return True

    def wait_ticket(self, ticket: int, timeout_s: float, what: str,
                    error: type[Exception] = LoadTimeout) -> None:
        """Wait for copy job ``ticket`` (and everything before it) and reap; ``error`` naming
        ``what`` at the deadline."""
        if not self.queue.wait(ticket, timeout_s):
            self.reap()
            raise error(f"layerwise: {what} ({timeout_s}s)")
        self.reap()

    def drain(self, timeout_s: float, what: str, error: type[Exception] = TimeoutError) -> None:
        """Wait for every queued copy (see :meth:`wait_ticket`)."""
        with self._lock:
            last = self._jobs[-1].ticket if self._jobs else 0
        if last:
            self.wait_ticket(last, timeout_s, what, error)

    def abandon_saves(self, why: str) -> list[str]:
        """The step stopped waiting for its saves (``why``): every save still queued is
        aborted when its copy ends, never committed. Why: vLLM may reuse and zero the
        device blocks it reads once the step ended, so bytes copied after that are not
        the block's. The copy itself is not cancelled (nothing can stop it mid-way): its
        pending objects keep their pages, and its slot consumer stays registered, until
        it is reaped. Returns the layers of the abandoned saves."""
        with self._lock:
            jobs = [j for j in self._jobs if isinstance(j, SaveJob) and not j.abandoned]
            for j in jobs:
                j.abandoned = why
        return [j.layer for j in jobs]

    def release_abandoned(self, gate_slot: int) -> int:
        """Release the slot consumers of abandoned saves of ``gate_slot`` (a writer waited
        for them past a second deadline); returns how many. Safe: what an abandoned copy
        reads is never committed, and the host pages it writes stay pending until it is
        reaped. Its late release at reaping is ignored by the gate."""
        with self._lock:
            jobs = [j for j in self._jobs if isinstance(j, SaveJob) and j.abandoned
                    and j.token is not None and j.token.slot == gate_slot]
            tokens = [j.token for j in jobs]
            for j in jobs:
                j.token = None
        for t in tokens:
            if t is not None:
                self.gate.release_consumer(t, TimeoutError("abandoned store save"))
        return len(tokens)

    def close(self) -> None:
        """Finish the queued copies, stop the queue, and reap them."""
        self.queue.close()
        self.reap()

    def keys(self, refs: Sequence[BlockRef], layer: str) -> list[str]:
        if self.key_fn is default_key:  # inlined: ~300 keys a step
            return [f"{r.key}|{layer}" for r in refs]
        return [self.key_fn(r.key, layer) for r in refs]

    def direct(self, kv: torch.Tensor) -> bool:
        """The store copies straight between its objects and ``kv`` (else: host staging)."""
        return device.host_addressable_pages(kv, self.block_dim)

    # ------------------------------------------------------------------ submitting

    @abc.abstractmethod
    def _submit_load(self, layer: str, pin: Pin, refs: list[BlockRef], keys: list[str]
                     ) -> LoadJob | None:
        """Submit the copy of pinned ``refs`` into ``layer``; None when it was done here
        (and ``pin`` released)."""

    @abc.abstractmethod
    def _submit_save(self, layer: str, pairs: list[tuple[BlockRef, WriteHandle]],
                     handles: list[WriteHandle], errors: list[BaseException], delay_s: float
                     ) -> SaveJob | None:
        """Submit the copy of ``layer``'s blocks into pending ``handles``; None when it
        was done (and finished) here."""

    def _enqueue(self, job: LoadJob | SaveJob) -> int:
        """Track a submitted job until it is reaped; its ticket."""
        with self._lock:
            self._jobs.append(job)
        return job.ticket

    def _drain_queue(self) -> None:
        """Everything queued so far finished (the order an inline copy must keep)."""
        self.drain(self._drain_timeout_s, "queued copies did not finish")

    def _pin(self, layer: str, refs: Sequence[BlockRef]
             ) -> tuple[Pin | None, list[BlockRef], list[str], list[int]]:
        """Pin ``layer``'s objects of ``refs``: (pin, refs and keys it covers, block ids of
        objects that are missing)."""
        keys = self.keys(refs, layer)
        pin = self.store.pin(keys)
        if pin is not None:
            return pin, list(refs), keys, []
        failed: list[int] = []  # find exactly which objects are missing
        ok_refs, ok_keys = [], []
        for r, k in zip(refs, keys, strict=True):
            if self.store.contains(k):
                ok_refs.append(r)
                ok_keys.append(k)
            else:
                failed.append(r.block_id)
        pin = self.store.pin(ok_keys) if ok_keys else None
        if pin is None:  # evicted between the checks
            failed.extend(r.block_id for r in ok_refs)
            return None, [], [], failed
        return pin, ok_refs, ok_keys, failed

    @staticmethod
    def _allocated(refs: Sequence[BlockRef], got: Sequence[WriteHandle | None]
                   ) -> list[tuple[BlockRef, WriteHandle]]:
        """The refs that got a handle from ``allocate`` (the others are stored already)."""
        return [(r, h) for r, h in zip(refs, got, strict=True) if h is not None]

    # ------------------------------------------------------------------ reaping

    def _reap_load(self, job: LoadJob) -> None:
        try:
            failed = self.queue.take_result(job.ticket) or []
        except Exception as exc:  # the whole job copied nothing
            log.warning("layerwise: load of layer %s failed: %s", job.layer, exc)
            failed = list(job.block_ids)
        finally:
            if job.pin is not None:
                self.store.unpin(job.pin)
        self._count_load(job.layer, len(job.block_ids) - len(failed), failed, job.native)

    def _count_load(self, layer: str, moved: int, failed: Sequence[int], native: bool = False) -> None:
        with self._lock:
            if moved:
                self._stats.loads += 1
            self._stats.native_jobs += native
            self._stats.blocks_loaded += moved
            self._stats.bytes_loaded += moved * self._page_bytes[layer]
            self._stats.load_errors += len(failed)
            self._load_errors.update(failed)
            if failed:
                self.step_failed_blocks.setdefault(layer, set()).update(failed)

    def _reap_save(self, job: SaveJob) -> None:
        try:
            self.queue.take_result(job.ticket)
        except Exception as exc:
            self._finish_save(job, exc)
        else:
            self._finish_save(job, None)

    def _finish_save(self, job: SaveJob, copy_error: BaseException | None) -> None:
        """Commit (or, on any error, abort) the job's objects, count, release the consumer."""
        error = copy_error
        if error is None and job.abandoned:
            error = TimeoutError(f"layerwise: save of layer {job.layer} abandoned ({job.abandoned}); "
                                 f"its {len(job.handles)} objects are not committed")
        if error is None:
            try:
                self.store.commit(job.handles)
            except Exception as exc:
                error = exc
        if error is not None:
            self.store.abort(job.handles)
            if not job.unit_errors:
                with self._lock:
                    self._stats.save_errors += 1
            job.unit_errors.append(error)
            # an abandoned save was logged once, with its step's others, when abandoned
            (log.debug if job.abandoned else log.error)(
                "layerwise: store save of layer %s failed: %s", job.layer, error)
        else:
            with self._lock:
                self._stats.saves += 1
                self._stats.native_jobs += job.native
                self._stats.blocks_saved += len(job.handles)
                self._stats.bytes_saved += len(job.handles) * self._page_bytes[job.layer]
        if job.token is not None:
            try:
                self.gate.release_consumer(job.token, job.unit_errors[0] if job.unit_errors else None)
            except GateError:  # pragma: no cover - gate misuse is a bug; keep going
                log.exception("layerwise: releasing the save consumer failed")

    # ------------------------------------------------------------------ Python copies

    def _block_view(self, kv: torch.Tensor, block_id: int) -> torch.Tensor:
        return kv.select(self.block_dim, block_id)

    def _read_one(self, pin: Pin, key: str, dst: torch.Tensor) -> bool:
        try:
            self.store.read(pin, key, 0, dst)
            return True
        except Exception as exc:  # a broken object: that block only
            log.warning("layerwise: load of %s failed: %s", key, exc)
            return False

    def _read_rows(self, pin: Pin, keys: list[str], layer: str,
                   refs: Sequence[BlockRef]) -> bool:
        """A layer's blocks in one store call (one scatter, the GIL held once), or False
        when the layout does not allow it or anything failed (the caller retries per block)."""
        rows = self._rows_of[layer]
        if rows is None:
            return False
        try:
            self.store.read_rows(pin, keys, rows, [r.block_id for r in refs])
            return True
        except Exception as exc:
            log.debug("layerwise: batched load failed (%s); retrying per block", exc)
            return False

    def _copy_in(self, layer: str, pin: Pin, refs: Sequence[BlockRef], keys: list[str]) -> list[int]:
        """Copy pinned objects into ``layer``'s blocks (Python): the block ids that failed
        (a broken object fails only its own block)."""
        kv = self._kv[layer]
        failed: list[int] = []
        if self.direct(kv):
            if not self._read_rows(pin, keys, layer, refs):
                for r, k in zip(refs, keys, strict=True):
                    view = self._block_view(kv, r.block_id).view(torch.uint8).reshape(-1)
                    if not self._read_one(pin, k, view):
                        failed.append(r.block_id)
            return failed
        # staged: one host buffer, one H2D scatter per layer
        page = tuple(self._block_view(kv, 0).shape)
        staging = device.empty_host((len(refs), *page), kv.dtype)
        ok: list[int] = []
        for i, (r, k) in enumerate(zip(refs, keys, strict=True)):
            if self._read_one(pin, k, staging[i].view(torch.uint8).reshape(-1)):
                ok.append(i)
            else:
                failed.append(r.block_id)
        if ok:
            rows = staging if len(ok) == len(refs) else staging[ok]
            device.blocks_from_host(rows, kv, self.block_dim, [refs[i].block_id for i in ok],
                                    self._load_stream)
        return failed

    def _copy_out(self, layer: str, pairs: Sequence[tuple[BlockRef, WriteHandle]],
                  ready: object, delay_s: float) -> None:
        """Copy ``layer``'s blocks into pending objects (Python); raises on failure (the
        reaper aborts them all)."""
        if delay_s:
            time.sleep(delay_s)  # injected delay: proves writers wait for the gate
        if ready is not None:
            ready.synchronize()  # type: ignore[attr-defined]  # the layer's KV is computed
        kv = self._kv[layer]
        handles = [h for _, h in pairs]
        if not self.direct(kv):  # staged: one gather + one D2H copy per layer
            host = device.blocks_to_host(kv, self.block_dim, [r.block_id for r, _ in pairs],
                                         self._save_stream)
            for h, row in zip(handles, host, strict=True):
                self.store.write(h, 0, row.reshape(-1).view(torch.uint8))
            return
        rows = self._rows_of[layer]
        if rows is not None:  # host KV, block-first: one scatter
            self.store.write_rows(handles, rows, [r.block_id for r, _ in pairs])
        else:
            for r, h in pairs:
                self.store.write(h, 0, self._block_view(kv, r.block_id).reshape(-1).view(torch.uint8))


class JobLayerIO(LayerIO):
    """Python copy jobs on one thread: any store, any KV placement."""

    queue: ThreadJobQueue

    def _open_queue(self) -> ThreadJobQueue:
        return ThreadJobQueue("lw-copy")

    def _submit_load(self, layer: str, pin: Pin, refs: list[BlockRef], keys: list[str]
                     ) -> LoadJob | None:
        ticket = self.queue.submit(functools.partial(self._copy_in, layer, pin, refs, keys))
        return LoadJob(ticket, layer, pin, [r.block_id for r in refs], native=False)

    def _submit_save(self, layer: str, pairs: list[tuple[BlockRef, WriteHandle]],
                     handles: list[WriteHandle], errors: list[BaseException], delay_s: float
                     ) -> SaveJob | None:
        ready = device.record_after_compute()
        ticket = self.queue.submit(functools.partial(self._copy_out, layer, pairs, ready, delay_s))
        return SaveJob(ticket, layer, handles, False, errors)


# Makes a pipeline's layer I/O from LayerIO's arguments (a class of it, or a chooser).
LayerIOFactory = Callable[..., LayerIO]
