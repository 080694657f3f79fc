"""Per-layer load / save / prefetch orchestration for layerwise prefill offload.

Why a vLLM-free domain object: the ordering rules (gate before write, save
before reuse, prefetch in slot order) are the whole correctness story of
layer sharing, so they live here where unit tests can drive them with plain
tensors and a dict store. The connector is a thin adapter over these calls,
made from vLLM's per-layer connector hooks on the worker side:

=====================================  =========================================
vLLM connector hook (worker)           pipeline call
=====================================  =========================================
``register_kv_caches(kv_caches)``      ``register_kv_caches(kv_caches)``
``start_load_kv(ctx)``                 ``start_step(StepIO(load, load_shared, save))``
``wait_for_layer_load(layer)``         ``wait_for_layer_load(layer)``
``save_kv_layer(layer, kv, meta)``     ``save_layer(layer)``
``wait_for_save()``                    ``finish_step()``
``get_block_ids_with_load_errors()``   ``take_load_errors()``
``shutdown()``                         ``close()``
=====================================  =========================================

Per layer L with physical slot S (see plan.py):

1. S is owned through the reuse gate (waiting, with a deadline, for the store
   save / remote reads of S's previous contents) and L's objects are read from
   the store into S. Because vLLM writes a layer's new KV *before* it calls
   ``wait_for_layer_load`` (``unified_kv_cache_update``), this happens for layer
   0 in ``start_step`` and for layer L+1 at the end of ``save_layer(L)``
   (``ready_before_hook=True``); ``wait_for_layer_load`` then only checks.
2. vLLM writes L's new KV into S and runs attention.
3. ``save_layer(L)``: queue the store save and register it as a *queued*
   consumer of S (plus ``extra_consumers`` and save listeners, e.g. the P/D
   producer's decode reads), release the write lease, and own + queue the loads of
   the next ``prefetch_layers`` layers whose slots allow it.

All byte copies run on one ordered copy queue (transfer/copy_queue.py): a native
worker thread for host KV and row-addressable stores, else one Python thread. The
model thread does the store bookkeeping (pin, allocate, commit, unpin), submits,
and later waits for the ticket it needs, with the GIL released. Why: Python I/O
threads took the GIL for ~25-50 us a job and slowed the model thread by ~7 %
(docs/bench-layerwise.md). Order replaces most waiting: a load queued after the
save of the slot's previous contents cannot start before that save's copy ended,
so the gate grants it behind the queued save (``behind_queued``); only a writer
that does not go through the queue (the layer's own attention) waits for the save
to be reaped, and it reaps while it waits (``pump``).

What is loaded: ``StepIO.load`` (prefix hits found in the store) into every
layer, and ``StepIO.load_shared`` (the step's requests' own earlier chunks,
and for decode steps their whole history) only into layers whose slot is shared
- an independent layer still holds them. ``StepIO.save`` blocks are saved for
every layer. Object keys are ``key_fn(block_key, layer_name)``; the caller names
blocks, and a block saved while partially filled must get a key that includes
its fill level (objects are immutable once committed).

The save consumer is released only after the store commit: so by the time a
later writer owns the slot, the bytes it replaced are readable from the store
(the next chunk's ``load_shared`` of the same layer can never miss its own
previous save). Within a step only the gate orders saves against reuse;
``finish_step`` additionally drains the step's saves by default (see there).
A failed or missing object is a load error for exactly the affected device
blocks (``take_load_errors``), never silent garbage.
"""

from __future__ import annotations

import array
import collections
import ctypes
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from ascend_offload import device
from ascend_offload.layerwise.gate import ConsumerToken, GateError, ReuseGate, WriteLease
from ascend_offload.layerwise.plan import LayerwisePlan
from ascend_offload.native import int32_array
from ascend_offload.store.base import KVStore, Pin, WriteHandle
from ascend_offload.transfer.copy_queue import NativeRowQueue, ThreadJobQueue

log = logging.getLogger(__name__)

KeyFn = Callable[[str, str], str]


def default_key(block_key: str, layer: str) -> str:
    """Store key of one layer's page of one block."""
    return f"{block_key}|{layer}"


class PipelineError(RuntimeError):
    """The pipeline was driven against its protocol (unknown layer, save before load...)."""


class LoadTimeout(TimeoutError):
    """A layer's store load did not finish within ``load_timeout_s``."""


@dataclasses.dataclass(frozen=True)
class BlockRef:
    """One device block (index along the block dim of every layer's KV tensor) and its key."""

    block_id: int
    key: str


@dataclasses.dataclass(frozen=True)
class StepIO:
    """What one forward step moves; built by the connector from its scheduler metadata."""

    load: tuple[BlockRef, ...] = ()  # store prefix hits: every layer loads them
    load_shared: tuple[BlockRef, ...] = ()  # own earlier KV: only layers of shared slots reload it
    save: tuple[BlockRef, ...] = ()  # KV computed in this step: every layer saves it

    def __post_init__(self) -> None:
        ids = [r.block_id for r in (*self.load, *self.load_shared)]
        if len(set(ids)) != len(ids):
            raise PipelineError(f"StepIO: a device block is loaded twice in one step: {sorted(ids)}")
        saved = [r.block_id for r in self.save]
        if len(set(saved)) != len(saved):
            raise PipelineError(f"StepIO: a device block is saved twice in one step: {sorted(saved)}")


@dataclasses.dataclass
class _Tracked:
    block_ids: list[int]
    keys: dict[int, str]  # block index -> key of its latest saved (or hit) object
    hits: int  # leading blocks loaded from the store in the request's first step
    first: bool = True


class StepBuilder:
    """Scheduler-side bookkeeping that turns the scheduled requests into a :class:`StepIO`.

    Why here: which blocks a step must load and save follows from block ids and token
    counts alone, so it is plain logic the connector feeds from vLLM's SchedulerOutput:

    * ``begin(req, block_ids, hit_keys)`` - a request is scheduled for the first time
      (or again after preemption); ``hit_keys`` name its leading blocks found in the store;
    * ``add_blocks(req, ids)`` - blocks appended to a running request;
    * ``schedule(req, num_computed, num_scheduled, full_key)`` - it runs in this step;
      ``full_key(i)`` is the shareable key of full block ``i`` (its block hash) or None;
    * ``build()`` - the step's StepIO (and reset); ``end(req)`` - forget a request.

    A full block is saved under ``full_key(i)``; a partial one under
    ``{partial_prefix}/{req}/{i}/{fill}`` (objects are immutable, so every fill level
    is its own object), and later steps load whatever key was saved last.
    """

    def __init__(self, block_size: int, partial_prefix: str = "partial") -> None:
        if block_size < 1:
            raise ValueError(f"block_size={block_size}: must be >= 1")
        self.block_size = block_size
        self.partial_prefix = partial_prefix
        self._reqs: dict[str, _Tracked] = {}
        self._load: list[BlockRef] = []
        self._shared: list[BlockRef] = []
        self._save: list[BlockRef] = []

    def begin(self, req_id: str, block_ids: Sequence[int], hit_keys: Sequence[str] = ()) -> None:
        if len(hit_keys) > len(block_ids):
            raise PipelineError(
                f"StepBuilder: request {req_id!r} has {len(hit_keys)} store hits but only "
                f"{len(block_ids)} blocks"
            )
        self._reqs[req_id] = _Tracked(list(block_ids), dict(enumerate(hit_keys)), len(hit_keys))

    def add_blocks(self, req_id: str, block_ids: Sequence[int]) -> None:
        self._tracked(req_id).block_ids.extend(block_ids)

    def schedule(
        self, req_id: str, num_computed: int, num_scheduled: int,
        full_key: Callable[[int], str | None],
    ) -> None:
        st = self._tracked(req_id)
        bs = self.block_size
        ids = st.block_ids
        end = num_computed + num_scheduled
        if -(-end // bs) > len(ids):
            raise PipelineError(
                f"StepBuilder: request {req_id!r} computes up to token {end} but has only "
                f"{len(ids)} blocks of {bs}"
            )
        own_from = 0
        if st.first:
            self._load += [BlockRef(ids[i], st.keys[i]) for i in range(st.hits)]
            own_from = st.hits
            st.first = False
        for i in range(own_from, -(-num_computed // bs)):
            if i not in st.keys:
                raise PipelineError(
                    f"StepBuilder: request {req_id!r} block {i} was computed but never saved"
                )
            self._shared.append(BlockRef(ids[i], st.keys[i]))
        for i in range(num_computed // bs, -(-end // bs)):
            fill = min(bs, end - i * bs)
            key = full_key(i) if fill == bs else None
            st.keys[i] = key or f"{self.partial_prefix}/{req_id}/{i}/{fill}"
            self._save.append(BlockRef(ids[i], st.keys[i]))

    def build(self) -> StepIO:
        io = StepIO(tuple(self._load), tuple(self._shared), tuple(self._save))
        self._load, self._shared, self._save = [], [], []
        return io

    def end(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._reqs

    def _tracked(self, req_id: str) -> _Tracked:
        try:
            return self._reqs[req_id]
        except KeyError:
            raise PipelineError(f"StepBuilder: unknown request {req_id!r} (begin was not called)") from None


@dataclasses.dataclass
class PipelineStats:
    steps: int = 0
    loads: int = 0  # (layer, step) loads that moved at least one block
    prefetched_loads: int = 0  # of which started ahead of their layer
    blocks_loaded: int = 0
    bytes_loaded: int = 0
    load_errors: int = 0  # blocks that could not be loaded (missing, evicted, failed)
    load_wait_s: float = 0.0  # time wait_for_layer_load blocked (gate + load)
    saves: int = 0
    blocks_saved: int = 0
    bytes_saved: int = 0
    save_duplicates: int = 0  # objects already in the store
    save_skipped: int = 0  # objects not stored because the store was full
    save_errors: int = 0
    native_jobs: int = 0  # copies run by the native queue (the rest: the Python queue or inline)

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class _Unit:
    """A main layer and its indexer followers: one gate slot, one lease per step."""

    main: str
    members: tuple[str, ...]
    index: int
    gate_slot: int
    earlier: tuple[str, ...]  # main layers that use the same slot earlier in a step


@dataclasses.dataclass
class _UnitState:
    lease: WriteLease | None = None
    ticket: int = 0  # copy-queue ticket of its last load job (0: nothing queued)
    loaded: bool = False
    released: bool = False


@dataclasses.dataclass
class _RowCopy:
    """One layer's rows, resolved ahead: a load (plane -> KV) or a save (KV -> plane)."""

    args: ctypes.Array  # the packed native job (NativeRowQueue.prepare_rows)
    keep: tuple[array.array, array.array]  # its index arrays, alive until submitted
    block_ids: list[int]
    handles: list[WriteHandle]  # saves: the pending objects, in row order


@dataclasses.dataclass
class _StepPlan:
    """A step's store bookkeeping done in one pass at its start (native queue only).

    Why: per layer, pin + row lookup + allocate + their Python cost ~230 us on the
    model thread inside a step (cold caches between the layer's compute), against
    ~20 us measured alone; one pass over every layer's keys costs a fraction of that.
    Layers missing here (an object absent, the store full) take the per-layer path.
    """

    pin: Pin | None = None  # every planned load object, held until the step ends
    loads: dict[str, _RowCopy] = dataclasses.field(default_factory=dict)
    saves: dict[str, _RowCopy] = dataclasses.field(default_factory=dict)
    nothing_to_save: set[str] = dataclasses.field(default_factory=set)  # all duplicates


@dataclasses.dataclass
class _LoadJob:
    ticket: int
    layer: str
    pin: Pin | None  # None: held by the step plan
    block_ids: list[int]
    native: bool


@dataclasses.dataclass
class _SaveJob:
    ticket: int
    layer: str
    handles: list[WriteHandle]
    native: bool
    unit_errors: list[BaseException]  # shared by the jobs of one unit
    token: ConsumerToken | None = None  # released after the unit's last job is reaped


class LayerwisePipeline:
    """Drives one worker's per-layer store traffic for a :class:`LayerwisePlan`; see module doc."""

    def __init__(
        self,
        plan: LayerwisePlan,
        store: KVStore,
        *,
        key_fn: KeyFn = default_key,
        prefetch_layers: int = 2,
        load_timeout_s: float = 30.0,
        save_timeout_s: float = 30.0,
        save_delay_s: float = 0.0,
        gate: ReuseGate | None = None,
        block_dim: int = 0,
        ready_before_hook: bool = True,
    ) -> None:
        if prefetch_layers < 0:
            raise ValueError(f"layerwise_prefetch_layers={prefetch_layers}: must be >= 0")
        self.plan = plan
        self.store = store
        self.key_fn = key_fn
        self.prefetch_layers = prefetch_layers
        self.load_timeout_s = load_timeout_s
        self.save_timeout_s = save_timeout_s
        self.save_delay_s = save_delay_s
        self.block_dim = block_dim
        self.ready_before_hook = ready_before_hook
        self.defer_next_ready = False
        self._direct_host_io = True  # tests turn it off to run the staging path on CPU
        # A writer waits for the store save (or a remote read) of the slot's previous contents.
        self.gate = gate or ReuseGate(plan.num_physical, default_timeout_s=save_timeout_s)
        followers: dict[str, list[str]] = {}
        for f in plan.followers:
            followers.setdefault(plan.main_of[f], []).append(f)
        self._units: list[_Unit] = []
        for i, name in enumerate(plan.layers):
            slot = plan.gate_slot_of[name]
            earlier = tuple(m for m in plan.layers[:i] if plan.gate_slot_of[m] == slot)
            self._units.append(
                _Unit(name, (name, *followers.get(name, [])), i, slot, earlier)
            )
        self._unit_of = {m: u for u in self._units for m in u.members}
        self._kv: dict[str, torch.Tensor] = {}
        self._page_bytes: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stats = PipelineStats()
        self._load_errors: set[int] = set()
        self._step: StepIO | None = None
        self._state: dict[str, _UnitState] = {}
        self._queue: NativeRowQueue | ThreadJobQueue | None = None  # made at the first step
        self._jobs: collections.deque[_LoadJob | _SaveJob] = collections.deque()  # ticket order
        self._plan: _StepPlan | None = None
        self._rows_of: dict[str, torch.Tensor | None] = {}  # layer -> its KV as block rows
        self._rows_ok: dict[tuple[int, str], bool] = {}
        # one copy stream per direction, so a load never waits on an unrelated save's copies
        self._load_stream = device.new_stream()
        self._save_stream = device.new_stream()
        self.aliased = False
        self._closed = False
        self._save_listeners: list[Callable[[str, int, int], None]] = []

    # ------------------------------------------------------------------ setup

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Take the per-layer KV tensors (block index along ``block_dim``)."""
        missing = [n for u in self._units for n in u.members if n not in kv_caches]
        if missing:
            raise PipelineError(f"layerwise pipeline: no KV cache registered for layers {missing}")
        for u in self._units:
            for name in u.members:
                kv = kv_caches[name]
                self._kv[name] = kv
                self._rows_of[name] = self._block_rows(kv)
                self._page_bytes[name] = kv.select(self.block_dim, 0).numel() * kv.element_size()
        # With the layout hook, layers of one slot alias one allocation. Without it sharing
        # is still correct (only pointless), so this is a diagnostic, not an error.
        self.aliased = all(
            len({self._kv[n].data_ptr() for n in buf.layers}) == 1
            for buf in self.plan.buffers
        )
        if not self.aliased and self.plan.num_physical < self.plan.num_logical:
            log.warning("layerwise: KV tensors of shared slots do not alias (layout hook not "
                        "applied?); correct, but device memory is not saved")

    def add_save_listener(self, listener: Callable[[str, int, int], None]) -> None:
        """Call ``listener(layer, gate_slot, generation)`` in every ``save_layer``, before the
        slot is handed on. Why: a sibling connector (the P/D producer in a multi connector)
        registers its reads with ``gate.add_consumer(gate_slot, generation, ...)`` here, so
        the next layer of the slot cannot take it before those reads are answered."""
        self._save_listeners.append(listener)

    def members_of(self, layer: str) -> tuple[str, ...]:
        """The layers saved and handed on together with ``layer`` (a main layer and its
        indexer followers): a sibling's reads must cover all of them."""
        unit = self._unit_of.get(layer)
        return tuple(unit.members) if unit is not None else (layer,)

    # ------------------------------------------------------------------ per step

    def start_step(self, io: StepIO) -> None:
        """``start_load_kv``: remember what this step moves and prefetch the first layers."""
        self._check_open()
        if self._state:
            self.finish_step()
        self._io()
        # A previous step's saves (finish_step(wait_saves=False)) must be committed before
        # this step pins what it loads: its own earlier chunks are among them.
        self.drain()
        self._end_plan()
        self._step = io
        with self._lock:
            self._stats.steps += 1
        if isinstance(self._queue, NativeRowQueue):
            self._plan = self._build_plan(
                [(m, self._load_refs(m)) for u in self._units for m in u.members],
                [(m, io.save) for u in self._units for m in u.members])
        self._prefetch_from(0)
        if self.ready_before_hook and self._units:
            self._make_ready(self._units[0])

    def wait_for_layer_load(self, layer: str) -> None:
        """Block until ``layer``'s slot is owned by it and its store objects are in it."""
        unit = self._unit_of.get(layer)
        if unit is None:
            return  # not a cache-bearing layer of the plan
        self._check_step(layer)
        self._make_ready(unit)
        self._prefetch_from(unit.index + 1)

    def save_layer(self, layer: str, extra_consumers: Sequence[str] = ()) -> list[ConsumerToken]:
        """``save_kv_layer``: queue the store save of ``layer``'s new KV and hand its slot on.

        Indexer followers are saved together with their main layer (their own call is a
        no-op), so the slot is released as soon as the main layer's attention is done.
        ``extra_consumers`` are registered on the same slot contents before the release
        and returned; their owner (e.g. the P/D producer) releases them on its acks.
        """
        unit = self._unit_of.get(layer)
        if unit is None or layer != unit.main:
            return []
        self._check_step(layer)
        assert self._step is not None
        st = self._state.get(unit.main)
        if st is not None and st.released:
            raise PipelineError(f"layerwise: layer {layer!r} saved twice in one step")
        if st is None or not st.loaded or st.lease is None:
            raise PipelineError(
                f"layerwise: save_kv_layer({layer!r}) without a preceding wait_for_layer_load "
                "in this step (the slot was never owned)"
            )
        tokens = [self.gate.add_consumer(unit.gate_slot, st.lease.generation, name)
                  for name in extra_consumers]
        for listener in self._save_listeners:
            listener(layer, unit.gate_slot, st.lease.generation)
        if self._step.save:
            self._queue_unit_save(unit, self._step.save, st.lease.generation)
        st.released = True
        self.gate.release_write(st.lease)
        self._reap()
        self._prefetch_from(unit.index + 1)
        if not self.defer_next_ready:
            self.ready_next(layer)
        return tokens

    def ready_next(self, layer: str) -> None:
        """Own the slot of the layer after ``layer`` and fill it (``ready_before_hook``).

        ``save_layer`` does this itself unless ``defer_next_ready`` is set: a sibling
        connector that publishes ``layer`` for remote reads *after* ``save_layer``
        (the P/D producer under ``AscendMultiConnector``) holds the slot through the
        gate, so waiting for it inside ``save_layer`` would wait for a publish that
        only comes after; the multi connector calls this once every child saved.
        """
        unit = self._unit_of.get(layer)
        if (self.ready_before_hook and unit is not None and layer == unit.main
                and self._step is not None and unit.index + 1 < len(self._units)):
            self._make_ready(self._units[unit.index + 1])

    def finish_step(self, wait_saves: bool = True) -> None:
        """``wait_for_save``: end the step; leases of layers that did not run are returned.

        ``wait_saves=True`` (the default) also waits for this step's store saves. vLLM
        may hand a finished request's blocks to another request and zero them
        (``_zero_block_ids``) before the next forward, outside any connector hook and so
        outside the gate; a save still reading such a block would commit zeros. Only a
        connector that delays freeing blocks until their saves finished may pass False.
        """
        for main, st in list(self._state.items()):
            if st.released:
                continue
            st.released = True
            if st.ticket:  # a prefetched load writes into the slot: it must end first
                self._wait_ticket(st.ticket, self.load_timeout_s,
                                  f"prefetch of layer {main!r} still running at step end")
            if st.lease is not None:
                self.gate.release_write(st.lease)
        self._state.clear()
        self._step = None
        self._end_plan()
        if wait_saves:
            self.drain()

    @property
    def in_step(self) -> bool:
        """True between ``start_step`` and ``finish_step``."""
        return self._step is not None

    def take_load_errors(self) -> set[int]:
        """Device block ids whose load failed since the last call (vLLM recomputes or fails them)."""
        self._reap()
        with self._lock:
            out, self._load_errors = self._load_errors, set()
            return out

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait for every queued copy to finish and commit its saves (deadline: ``save_timeout_s``)."""
        timeout = self.save_timeout_s if timeout_s is None else timeout_s
        with self._lock:
            last = self._jobs[-1].ticket if self._jobs else 0
        if last:
            self._wait_ticket(last, timeout, "store saves still running after the deadline",
                              TimeoutError)

    def move_now(self, items: Sequence[tuple[str, Sequence[BlockRef], Sequence[BlockRef]]]) -> float:
        """For each ``(layer, load, save)``: load ``load`` into the layer's blocks and save
        ``save`` from them, through the same queue and copy code as a step, all submitted
        at once (no gate, no ordering between layers) and waited for here, outside any
        step. Returns the seconds from the first submit to the end of the copies; the
        store bookkeeping before is planned as at a step start and not counted.
        Why: ``bench layerwise`` measures its transfer-alone baseline and its
        dependency-free floor with exactly the pipeline's own transfer."""
        self._check_open()
        if self._step is not None:
            raise PipelineError("move_now inside a step")
        q = self._io()
        if isinstance(q, NativeRowQueue):
            self._plan = self._build_plan([(n, tuple(ld)) for n, ld, _ in items],
                                          [(n, tuple(sv)) for n, _, sv in items])
        try:
            t0 = time.perf_counter()
            last = 0
            for layer, load, save in items:
                if load:
                    last = self._queue_load(layer, load) or last
                if save:
                    last = self._queue_save(layer, save, [], 0.0) or last
            if last and not q.wait(last, self.load_timeout_s + self.save_timeout_s):
                raise LoadTimeout(f"layerwise: transfer of {len(items)} layers did not finish")
            took = time.perf_counter() - t0
            self._reap()
        finally:
            self._end_plan()
        return took

    def stats(self) -> PipelineStats:
        with self._lock:
            return dataclasses.replace(self._stats)

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.drain()  # first: a step that failed (a load deadline) may have jobs queued
            if self._state:
                self.finish_step()
        finally:
            self._closed = True
            if self._queue is not None:
                self._queue.close()
            self._reap()

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise PipelineError("layerwise pipeline is closed")
        if not self._kv:
            raise PipelineError("layerwise pipeline: register_kv_caches was not called")

    def _check_step(self, layer: str) -> None:
        if self._step is None:
            raise PipelineError(
                f"layerwise: hook for layer {layer!r} outside a step: start_step (start_load_kv) "
                "must run before the forward - the connector sets "
                "scheduler_output.has_sync_kv_loads=True so vLLM calls it first"
            )

    def _io(self) -> NativeRowQueue | ThreadJobQueue:
        """The copy queue, chosen at the first use: native when every layer's KV is host
        memory with contiguous block rows (then a job's bytes are two row lists)."""
        if self._queue is None:
            rows = all(self._rows_of[n] is not None and self._direct(kv)
                       for n, kv in self._kv.items())
            if rows and self.store.row_addressable and NativeRowQueue.available():
                self._queue = NativeRowQueue()
            else:
                self._queue = ThreadJobQueue("lw-copy")
            log.debug("layerwise: copy queue %s", type(self._queue).__name__)
        return self._queue

    def _reap(self) -> None:
        """Finish the bookkeeping of every copy job that ended (in ticket order): unpin
        loads and record their errors; commit (or abort) saves and release their consumers."""
        q = self._queue
        if q is None:
            return
        done = q.done()
        while True:
            with self._lock:
                if not self._jobs or self._jobs[0].ticket > done:
                    return
                job = self._jobs.popleft()
            if isinstance(job, _LoadJob):
                self._reap_load(q, job)
            else:
                self._reap_save(q, job)

    def _reap_load(self, q: NativeRowQueue | ThreadJobQueue, job: _LoadJob) -> None:
        try:
            failed = q.take_result(job.ticket) or []
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

    def _reap_save(self, q: NativeRowQueue | ThreadJobQueue, job: _SaveJob) -> None:
        try:
            q.take_result(job.ticket)
        except Exception as exc:
            self._finish_save(job, exc)
        else:
            self._finish_save(job, None)

    def _finish_save(self, job: _SaveJob, copy_error: BaseException | None) -> None:
        """Commit (or, on any error, abort) the job's objects, count, release the consumer."""
        error = copy_error
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
            log.error("layerwise: store save of layer %s failed: %s", job.layer, error)
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

    def _pump(self, left_s: float) -> bool:
        """Gate pump: wait (GIL released) for the oldest queued copy and reap it. False
        when nothing is queued (the slot waits for someone else's consumer)."""
        with self._lock:
            ticket = self._jobs[0].ticket if self._jobs else 0
        if not ticket:
            return False
        assert self._queue is not None
        self._queue.wait(ticket, max(0.0, left_s))
        self._reap()
        return True

    def _wait_ticket(self, ticket: int, timeout_s: float, what: str,
                     error: type[Exception] = LoadTimeout) -> None:
        """Wait for copy job ``ticket`` (and everything before it) and reap; ``error`` naming
        ``what`` at the deadline."""
        assert self._queue is not None
        if not self._queue.wait(ticket, timeout_s):
            self._reap()
            raise error(f"layerwise: {what} ({timeout_s}s)")
        self._reap()

    def _make_ready(self, unit: _Unit) -> None:
        """Own ``unit``'s slot (gate, deadline) and have its store objects in it."""
        st = self._state.get(unit.main)
        if st is not None and (st.loaded or st.released):
            return
        t0 = time.perf_counter()
        if st is None:  # not prefetched: own the slot here and queue the load
            loads = self._has_loads(unit)
            lease = self.gate.acquire_write(unit.gate_slot, unit.main, behind_queued=loads,
                                            pump=self._pump)
            st = self._own(unit, lease, loads)
        if st.ticket:
            self._wait_ticket(st.ticket, self.load_timeout_s,
                              f"store load of layer {unit.main!r} (slot {unit.gate_slot}) did "
                              "not finish")
        st.loaded = True
        with self._lock:
            self._stats.load_wait_s += time.perf_counter() - t0

    def _has_loads(self, unit: _Unit) -> bool:
        return any(self._load_refs(m) for m in unit.members)

    def _load_refs(self, layer: str) -> tuple[BlockRef, ...]:
        assert self._step is not None
        if self.plan.is_shared(self.plan.layers[self._unit_of[layer].index]):
            return self._step.load + self._step.load_shared
        return self._step.load

    def _prefetch_from(self, start: int) -> None:
        """Own and queue the loads of the next ``prefetch_layers`` layers.

        A slot whose previous contents have only queued consumers (this pipeline's store
        saves) is granted at once: the load runs after those saves on the queue. One
        held by anything else (a remote read) is tried again at the next hook, and
        waited for when its layer comes.
        """
        if self._step is None:
            return
        stop = min(len(self._units), start + (self.prefetch_layers if start else 1 + self.prefetch_layers))
        for unit in self._units[start:stop]:
            if unit.main in self._state or not self._has_loads(unit):
                continue  # owned already, or nothing to move: the slot is owned when it runs
            # Slot order within a step: an earlier user of the slot must be done with it.
            if any(e not in self._state or not self._state[e].released for e in unit.earlier):
                continue
            lease = self.gate.try_acquire_write(unit.gate_slot, unit.main, behind_queued=True)
            if lease is None:
                continue
            self._own(unit, lease, True)
            with self._lock:
                self._stats.prefetched_loads += 1

    def _own(self, unit: _Unit, lease: WriteLease, load: bool) -> _UnitState:
        """Record ``unit``'s lease for this step and queue its loads (``load``); the lease
        is handed back if queueing fails."""
        st = self._state[unit.main] = _UnitState(lease=lease)
        if load:
            try:
                st.ticket = self._queue_unit_load(unit)
            except BaseException:
                st.released = True
                self.gate.release_write(lease)
                raise
        return st

    def _queue_unit_load(self, unit: _Unit) -> int:
        """Queue the loads of ``unit``'s layers; the last job's ticket (0: nothing queued)."""
        last = 0
        for layer in unit.members:
            refs = self._load_refs(layer)
            if refs:
                last = self._queue_load(layer, refs) or last
        return last

    def _queue_unit_save(self, unit: _Unit, refs: Sequence[BlockRef], generation: int) -> None:
        """Queue the saves of ``unit``'s layers and register them as one queued consumer of
        the slot, released once the last of them is committed."""
        errors: list[BaseException] = []
        delay = self.save_delay_s
        for layer in unit.members:
            self._queue_save(layer, refs, errors, delay)
            delay = 0.0  # the injected delay is once per unit, like one slow save
        with self._lock:
            last = self._jobs[-1] if self._jobs else None
        if isinstance(last, _SaveJob) and last.unit_errors is errors:
            last.token = self.gate.add_consumer(unit.gate_slot, generation,
                                                f"store-save {unit.main}", queued=True)

    def _block_view(self, kv: torch.Tensor, block_id: int) -> torch.Tensor:
        return kv.select(self.block_dim, block_id)

    def _direct(self, kv: torch.Tensor) -> bool:
        """Host KV with contiguous block pages: copy straight between store and KV tensor."""
        return (self._direct_host_io and not device.is_accelerator(kv)
                and self._block_view(kv, 0).is_contiguous())

    def _block_rows(self, kv: torch.Tensor) -> torch.Tensor | None:
        """``kv`` as ``[num_blocks, block bytes]`` rows (block-first and contiguous), else None."""
        if self.block_dim != 0 or not kv.is_contiguous() or kv.shape[0] == 0:
            return None
        return kv.view(kv.shape[0], -1)

    def _pin(self, layer: str, refs: Sequence[BlockRef]
             ) -> tuple[Pin | None, list[BlockRef], list[str], list[int]]:
        """Pin ``layer``'s objects of ``refs``: (pin, refs and keys it covers, block ids of
        objects that are missing)."""
        keys = self._keys(refs, layer)
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

    def _queue_load(self, layer: str, refs: Sequence[BlockRef]) -> int:
        """Pin ``layer``'s objects and queue their copy into its blocks; the ticket, or 0
        when nothing was queued (missing objects are load errors, counted now)."""
        planned = self._plan.loads.pop(layer, None) if self._plan is not None else None
        if planned is not None:
            assert isinstance(self._queue, NativeRowQueue)
            ticket = self._queue.submit_prepared(planned.args)
            return self._enqueue(_LoadJob(ticket, layer, None, planned.block_ids, native=True))
        pin, refs, keys, failed = self._pin(layer, refs)
        if failed:
            self._count_load(layer, 0, failed)
        if pin is None:
            return 0
        if not refs:
            self.store.unpin(pin)
            return 0
        q = self._io()
        ids = [r.block_id for r in refs]
        try:
            if isinstance(q, NativeRowQueue):
                rc = self._load_rows(q, layer, self.store.pinned_rows(pin, keys), ids)
                if rc is None:  # not row-addressable: copy here, after everything queued before
                    self._drain_queue()
                    bad = self._copy_in(layer, pin, refs, keys)
                    self._count_load(layer, len(refs) - len(bad), bad)
                    self.store.unpin(pin)
                    return 0
                job = _LoadJob(q.submit_prepared(rc.args), layer, pin, ids, native=True)
            else:
                ticket = q.submit(functools.partial(self._copy_in, layer, pin, refs, keys))
                job = _LoadJob(ticket, layer, pin, ids, native=False)
        except BaseException:
            self.store.unpin(pin)
            raise
        return self._enqueue(job)

    def _queue_save(self, layer: str, refs: Sequence[BlockRef], errors: list[BaseException],
                    delay_s: float) -> int:
        """Allocate ``layer``'s objects of ``refs`` and queue the copy of its blocks into
        them; the ticket, or 0 (store full, all duplicates, or copied here)."""
        planned = self._plan.saves.pop(layer, None) if self._plan is not None else None
        if planned is None and self._plan is not None and layer in self._plan.nothing_to_save:
            self._plan.nothing_to_save.discard(layer)
            return 0
        if planned is not None:
            assert isinstance(self._queue, NativeRowQueue)
            planned.args[8] = int(delay_s * 1e6)
            try:
                ticket = self._queue.submit_prepared(planned.args)
            except BaseException:
                self.store.abort(planned.handles)
                raise
            return self._enqueue(_SaveJob(ticket, layer, planned.handles, True, errors))
        size = self._page_bytes[layer]
        keys = self._keys(refs, layer)
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
        q = self._io()
        try:
            if isinstance(q, NativeRowQueue):
                rc = self._save_rows(q, layer, handles, [r.block_id for r, _ in pairs])
                if rc is None:  # not row-addressable: copy here, in queue order
                    self._drain_queue()
                    copy_error: BaseException | None = None
                    try:
                        self._copy_out(layer, pairs, None, delay_s)
                    except Exception as exc:
                        copy_error = exc
                    self._finish_save(_SaveJob(0, layer, handles, False, errors), copy_error)
                    return 0
                rc.args[8] = int(delay_s * 1e6)
                job = _SaveJob(q.submit_prepared(rc.args), layer, handles, True, errors)
            else:
                ready = device.record_after_compute()
                ticket = q.submit(functools.partial(self._copy_out, layer, pairs, ready, delay_s))
                job = _SaveJob(ticket, layer, handles, False, errors)
        except BaseException:
            self.store.abort(handles)
            raise
        return self._enqueue(job)

    def _enqueue(self, job: _LoadJob | _SaveJob) -> int:
        """Track a submitted job until it is reaped; its ticket."""
        with self._lock:
            self._jobs.append(job)
        return job.ticket

    def _build_plan(self, loads: Sequence[tuple[str, Sequence[BlockRef]]],
                    saves: Sequence[tuple[str, Sequence[BlockRef]]]) -> _StepPlan:
        """Pin every load object and allocate every save object of ``loads``/``saves``
        (per layer: its refs) in one store call each, and pack their native jobs."""
        q = self._queue
        assert isinstance(q, NativeRowQueue)
        plan = _StepPlan()
        ids_of: dict[int, tuple[list[int], array.array]] = {}  # refs seen -> block ids

        def block_ids(refs: Sequence[BlockRef]) -> tuple[list[int], array.array]:
            got = ids_of.get(id(refs))
            if got is None:
                ids = [r.block_id for r in refs]
                got = ids_of[id(refs)] = (ids, int32_array(ids))
            return got

        want = [(layer, refs, self._keys(refs, layer)) for layer, refs in loads if refs]
        all_keys = [k for _, _, keys in want for k in keys]
        if all_keys:
            plan.pin = self.store.pin(all_keys)  # None (something missing): per-layer path
        if plan.pin is not None:
            joint = self.store.pinned_rows(plan.pin, all_keys) if len(want) > 1 else None
            at = 0
            for layer, refs, keys in want:
                if joint is not None:
                    placed: tuple[torch.Tensor, list[int]] | None = (
                        joint[0], joint[1][at:at + len(keys)])
                else:
                    placed = self.store.pinned_rows(plan.pin, keys)
                at += len(keys)
                rc = self._load_rows(q, layer, placed, *block_ids(refs))
                if rc is not None:
                    plan.loads[layer] = rc
        save_want = [(layer, refs, self._keys(refs, layer)) for layer, refs in saves if refs]
        save_keys = [k for _, _, keys in save_want for k in keys]
        if not save_keys:
            return plan
        sizes = [self._page_bytes[layer] for layer, _, keys in save_want for _ in keys]
        got = self.store.allocate(save_keys, sizes)
        if got is None:
            return plan  # store full for all of them at once: per layer at save time
        at = 0
        dups = 0
        for layer, refs, keys in save_want:
            part = got[at:at + len(keys)]
            at += len(keys)
            if all(h is not None for h in part):  # the usual case: the step's ids, shared
                handles: list[WriteHandle] = part  # type: ignore[assignment]
                ids, kv_idx = block_ids(refs)
            else:
                pairs = self._allocated(refs, part)
                dups += len(keys) - len(pairs)
                if not pairs:
                    plan.nothing_to_save.add(layer)
                    continue
                handles = [h for _, h in pairs]
                ids, kv_idx = [r.block_id for r, _ in pairs], None
            rc = self._save_rows(q, layer, handles, ids, kv_idx)
            if rc is None:
                self.store.abort(handles)  # allocated again on the per-layer path
                continue
            plan.saves[layer] = rc
        with self._lock:
            self._stats.save_duplicates += dups
        return plan

    def _load_rows(self, q: NativeRowQueue, layer: str,
                   placed: tuple[torch.Tensor, list[int]] | None, ids: list[int],
                   kv_idx: array.array | None = None) -> _RowCopy | None:
        """The packed native job copying ``placed`` (store plane, rows) into ``layer``'s
        blocks ``ids``, or None when the plane's rows do not fit the layer's."""
        if placed is None or not self._same_rows(placed[0], layer):
            return None
        kv_rows = self._rows_of[layer]
        assert kv_rows is not None  # _same_rows checked it
        kv_idx = int32_array(ids) if kv_idx is None else kv_idx
        src_idx = int32_array(placed[1])
        return _RowCopy(q.prepare_rows(placed[0], src_idx, kv_rows, kv_idx), (src_idx, kv_idx),
                        ids, [])

    def _save_rows(self, q: NativeRowQueue, layer: str, handles: list[WriteHandle],
                   ids: list[int], kv_idx: array.array | None = None) -> _RowCopy | None:
        """The packed native job copying ``layer``'s blocks ``ids`` into pending ``handles``,
        or None when the store cannot place them as rows that fit."""
        placed = self.store.pending_rows(handles)
        if placed is None or not self._same_rows(placed[0], layer):
            return None
        kv_rows = self._rows_of[layer]
        assert kv_rows is not None
        kv_idx = int32_array(ids) if kv_idx is None else kv_idx
        dst_idx = int32_array(placed[1])
        return _RowCopy(q.prepare_rows(kv_rows, kv_idx, placed[0], dst_idx), (kv_idx, dst_idx),
                        ids, handles)

    @staticmethod
    def _allocated(refs: Sequence[BlockRef], got: Sequence[WriteHandle | None]
                   ) -> list[tuple[BlockRef, WriteHandle]]:
        """The refs that got a handle from ``allocate`` (the others are stored already)."""
        return [(r, h) for r, h in zip(refs, got, strict=True) if h is not None]

    def _keys(self, refs: Sequence[BlockRef], layer: str) -> list[str]:
        if self.key_fn is default_key:  # inlined: ~300 keys a step
            return [f"{r.key}|{layer}" for r in refs]
        return [self.key_fn(r.key, layer) for r in refs]

    def _same_rows(self, plane: torch.Tensor, layer: str) -> bool:
        """``plane``'s rows take ``layer``'s block rows (host, 2-D, same bytes); cached."""
        key = (plane.data_ptr(), layer)
        ok = self._rows_ok.get(key)
        if ok is None:
            kv_rows = self._rows_of.get(layer)
            ok = self._rows_ok[key] = (
                kv_rows is not None and plane.dim() == 2 and plane.is_contiguous()
                and plane.device.type == "cpu"
                and plane.shape[1] * plane.element_size()
                == kv_rows.shape[1] * kv_rows.element_size())
        return ok

    def _end_plan(self) -> None:
        """Release what the step plan held: the load pin (every load job ended by now)
        and the objects of layers that never saved (their layer did not run)."""
        plan, self._plan = self._plan, None
        if plan is None:
            return
        if plan.pin is not None:
            self.store.unpin(plan.pin)
        for rc in plan.saves.values():
            self.store.abort(rc.handles)

    def _drain_queue(self) -> None:
        """Everything queued so far finished (the order an inline copy must keep)."""
        with self._lock:
            last = self._jobs[-1].ticket if self._jobs else 0
        if last:
            self._wait_ticket(last, self.load_timeout_s + self.save_timeout_s,
                              "queued copies did not finish", TimeoutError)

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
        """Copy pinned objects into ``layer``'s blocks (the Python-queue path): the block
        ids that failed (a broken object fails only its own block)."""
        kv = self._kv[layer]
        failed: list[int] = []
        if self._direct(kv):
            if not self._read_rows(pin, keys, layer, refs):
                for r, k in zip(refs, keys, strict=True):
                    view = self._block_view(kv, r.block_id).view(torch.uint8).reshape(-1)
                    if not self._read_one(pin, k, view):
                        failed.append(r.block_id)
            return failed
        # accelerator: one host staging buffer, one H2D scatter per layer
        with device.stream_context(self._load_stream):
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
                idx = torch.tensor([refs[i].block_id for i in ok], dtype=torch.long)
                kv.index_copy_(
                    self.block_dim, idx.to(kv.device),
                    rows.to(kv.device, non_blocking=True).movedim(0, self.block_dim),
                )
            self._load_stream.synchronize()
        return failed

    def _copy_out(self, layer: str, pairs: Sequence[tuple[BlockRef, WriteHandle]],
                  ready: object, delay_s: float) -> None:
        """Copy ``layer``'s blocks into pending objects (the Python-queue path); raises on
        failure (the reaper aborts them all)."""
        if delay_s:
            time.sleep(delay_s)  # test hook: proves writers wait for the gate
        if ready is not None:
            ready.synchronize()  # type: ignore[attr-defined]  # the layer's KV is computed
        kv = self._kv[layer]
        handles = [h for _, h in pairs]
        direct = self._direct(kv)
        block_rows = self._rows_of[layer] if direct else None
        with device.stream_context(self._save_stream):
            if block_rows is not None:  # host KV, block-first: one scatter
                self.store.write_rows(handles, block_rows, [r.block_id for r, _ in pairs])
            elif direct:
                for r, h in pairs:
                    self.store.write(h, 0, self._block_view(kv, r.block_id).reshape(-1).view(torch.uint8))
            else:  # accelerator: one gather + one D2H copy per layer
                idx = torch.tensor([r.block_id for r, _ in pairs], dtype=torch.long)
                picked = kv.index_select(self.block_dim, idx.to(kv.device)).movedim(self.block_dim, 0)
                host = device.empty_host(tuple(picked.shape), kv.dtype)
                host.copy_(picked, non_blocking=True)
                self._save_stream.synchronize()
                for h, row in zip(handles, host, strict=True):
                    self.store.write(h, 0, row.reshape(-1).view(torch.uint8))
            self._save_stream.synchronize()
