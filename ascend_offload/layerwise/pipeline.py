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
   ``wait_for_layer_load`` (``unified_kv_cache_update``), S is made writable for
   layer 0 in ``start_step`` and for layer L+1 at the end of ``save_layer(L)``
   (``ready_before_hook=True``). When the step writes no block it also loads,
   writable only means S's earlier readers are done: L's load runs on beside the
   rest of layer L-1 and L's KV write, and ``wait_for_layer_load`` waits for it;
   otherwise the load is waited for there as well.
2. vLLM writes L's new KV into S and runs attention.
3. ``save_layer(L)``: queue the store save and register it as a *queued*
   consumer of S (plus ``extra_consumers`` and save listeners, e.g. the P/D
   producer's decode reads), release the write lease, and own + queue the loads of
   the next ``prefetch_layers`` layers whose slots allow it.

All byte copies run on one ordered copy queue (transfer/copy_queue.py), driven by
the layer I/O (layer_io.py): a native worker thread for host KV and row-addressable
stores, else one Python thread. The model thread does the store bookkeeping (pin,
allocate, commit, unpin), submits, and later waits for the ticket it needs, with
the GIL released. Why: Python I/O
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

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ascend_offload import device
from ascend_offload.layerwise.gate import ConsumerToken, GateTimeout, ReuseGate, WriteLease
from ascend_offload.layerwise.layer_io import (
    JobLayerIO,
    LayerIO,
    LayerIOFactory,
    block_rows,
)
from ascend_offload.layerwise.plan import LayerwisePlan
from ascend_offload.layerwise.row_io import RowLayerIO
from ascend_offload.layerwise.steps import (
    BlockRef,
    KeyFn,
    PipelineError,
    PipelineStats,
    StepIO,
    default_key,
)
from ascend_offload.store.base import KVStore
from ascend_offload.transfer.copy_queue import NativeRowQueue

log = logging.getLogger(__name__)


def open_layer_io(
    store: KVStore,
    kv: Mapping[str, torch.Tensor],
    rows_of: Mapping[str, torch.Tensor | None],
    page_bytes: Mapping[str, int],
    *,
    block_dim: int,
    **kw: Any,
) -> LayerIO:
    """The layer I/O for these tensors and this store (the arguments of :class:`LayerIO`):
    native row jobs when every layer's KV is host memory with contiguous block rows (then
    a job's bytes are two row lists) and the store hands out rows, else Python jobs."""
    rows = all(rows_of[n] is not None and device.host_addressable_pages(t, block_dim)
               for n, t in kv.items())
    cls = RowLayerIO if rows and store.row_addressable and NativeRowQueue.available() else JobLayerIO
    return cls(store, kv, rows_of, page_bytes, block_dim=block_dim, **kw)


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
    before: int = 0  # the last ticket queued before its loads: the slot's earlier saves
    writable: bool = False  # vLLM may write the layer's new KV (its slot's readers are done)
    loaded: bool = False
    released: bool = False


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
        fail_loads: int = 0,
        gate: ReuseGate | None = None,
        block_dim: int = 0,
        ready_before_hook: bool = True,
        layer_io: LayerIOFactory = open_layer_io,
    ) -> None:
        """``save_delay_s`` delays each unit's store save by that long (the connector's
        ``debug.save_delay_s``: a slow store, to prove writers wait for the gate).
        ``fail_loads``: the first that many layer loads fail as a broken store read
        (the connector's ``debug.fail_layer_loads``, for fault tests).
        ``layer_io`` makes the copy path at the first step from the arguments of
        :class:`~ascend_offload.layerwise.layer_io.LayerIO` (default: the one that fits
        the tensors and the store)."""
        if prefetch_layers < 0:
            raise ValueError(f"layerwise_prefetch_layers={prefetch_layers}: must be >= 0")
        self.plan = plan
        self.store = store
        self.key_fn = key_fn
        self.prefetch_layers = prefetch_layers
        self.load_timeout_s = load_timeout_s
        self.save_timeout_s = save_timeout_s
        self.save_delay_s = save_delay_s
        self.fail_loads = fail_loads
        self.block_dim = block_dim
        self.ready_before_hook = ready_before_hook
        self.defer_next_ready = False
        self._write_apart = False  # set per step (start_step)
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
        self._rows_of: dict[str, torch.Tensor | None] = {}  # layer -> its KV as block rows
        self._lock = threading.Lock()
        self._stats = PipelineStats()
        self._step: StepIO | None = None
        self._state: dict[str, _UnitState] = {}
        self._open_io = layer_io
        self._lio: LayerIO | None = None  # made at the first step
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
                self._rows_of[name] = block_rows(kv, self.block_dim)
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
        lio = self._io()
        # A previous step's saves (finish_step(wait_saves=False)) must be committed before
        # this step pins what it loads: its own earlier chunks are among them. Bounded: a
        # save still running past save_timeout_s is abandoned (never committed; a block
        # it was saving is then a load error, recomputed) instead of failing the step.
        self._drain_or_abandon("at the next step's start")
        lio.end_plan()
        lio.step_failed_blocks.clear()
        self._step = io
        # vLLM writes a layer's new KV into the step's save blocks only: when no block of
        # the step is both loaded and written, that write need not wait for the layer's
        # load, only for the earlier readers of its slot (see _make_ready).
        loaded = {r.block_id for r in (*io.load, *io.load_shared)}
        self._write_apart = not any(r.block_id in loaded for r in io.save)
        with self._lock:
            self._stats.steps += 1
        lio.plan_step(((m, self._load_refs(m)) for u in self._units for m in u.members),
                      ((m, io.save) for u in self._units for m in u.members))
        self._prefetch_from(0)
        if self.ready_before_hook and self._units:
            self._make_ready(self._units[0], load=False)

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
            dropped, kept = self._split_failed(unit, self._step.save)
            if dropped:
                self._drop_unit_save(unit, dropped)
            if kept:
                self._queue_unit_save(unit, kept, st.lease.generation)
        st.released = True
        self.gate.release_write(st.lease)
        self._lio.reap()  # type: ignore[union-attr]  # made by start_step
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
            self._make_ready(self._units[unit.index + 1], load=False)

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
                self._lio.wait_ticket(  # type: ignore[union-attr]  # a ticket: it exists
                    st.ticket, self.load_timeout_s,
                    f"prefetch of layer {main!r} still running at step end")
            if st.lease is not None:
                self.gate.release_write(st.lease)
        self._state.clear()
        self._step = None
        if self._lio is not None:
            self._lio.end_plan()
        if wait_saves:
            self._drain_or_abandon("at the step's end")

    @property
    def in_step(self) -> bool:
        """True between ``start_step`` and ``finish_step``."""
        return self._step is not None

    def take_load_errors(self) -> set[int]:
        """Device block ids whose load failed since the last call (vLLM recomputes or fails them)."""
        return self._lio.take_load_errors() if self._lio is not None else set()

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait for every queued copy to finish and commit its saves (deadline: ``save_timeout_s``,
        then ``TimeoutError``)."""
        if self._lio is not None:
            self._lio.drain(self.save_timeout_s if timeout_s is None else timeout_s,
                            "store saves still running after the deadline")

    def _drain_or_abandon(self, when: str) -> None:
        """:meth:`drain`, but a deadline is not an error of the step (vLLM treats an
        exception from ``wait_for_save`` / ``start_load_kv`` as fatal): the saves still
        queued are abandoned - aborted when their copies end, so their blocks are reported
        failed, never committed - and logged. Their slots stay held by their consumers
        until then: the next writer of a slot waits for them in the gate (bounded by its
        deadline), and the worker's ``handle_preemptions`` drains again before freed
        blocks can be reused."""
        try:
            self.drain()
        except TimeoutError as exc:
            layers = self._lio.abandon_saves(f"still running {when}") if self._lio is not None else []
            log.error("%s; %d saves abandoned (layers %s): their blocks are not committed, and "
                      "their copies are waited for again before their buffers are reused",
                      exc, len(layers), ", ".join(dict.fromkeys(layers)) or "-")

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
            if self._lio is not None:
                self._lio.close()

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

    def _io(self) -> LayerIO:
        """The layer I/O, made at the first use (the tensors are registered by then)."""
        if self._lio is None:
            self._lio = self._open_io(
                self.store, self._kv, self._rows_of, self._page_bytes,
                block_dim=self.block_dim, key_fn=self.key_fn, gate=self.gate,
                stats=self._stats, lock=self._lock,
                drain_timeout_s=self.load_timeout_s + self.save_timeout_s)
            self._lio.fail_loads = self.fail_loads
        return self._lio

    def _make_ready(self, unit: _Unit, load: bool = True) -> None:
        """Own ``unit``'s slot (gate, deadline) and have its store objects in it, or with
        ``load=False`` only make it writable for the layer's new KV.

        Why two levels: vLLM writes a layer's new KV before its ``wait_for_layer_load``
        (``ready_before_hook``), and with one shared buffer (B = 1) the load of layer
        L + 1 can only start once layer L is done with the slot. When the step writes no
        block it loads (``_write_apart``), the new KV only has to wait for the slot's
        earlier readers (the saves queued before the load, in queue order), so the load
        runs on while vLLM finishes layer L and writes layer L + 1's KV, and
        ``wait_for_layer_load`` waits for it. Otherwise (a partial block continued by the
        step) the write waits for the load as well."""
        st = self._state.get(unit.main)
        if st is not None and (st.loaded or st.released or (st.writable and not load)):
            return
        t0 = time.perf_counter()
        if st is None:  # not prefetched: own the slot here and queue the load
            loads = self._has_loads(unit)
            lease = self._acquire(unit, loads)
            st = self._own(unit, lease, loads)
        lio = self._lio
        assert lio is not None  # made by start_step
        if load or not self._write_apart:
            if st.ticket:
                lio.wait_ticket(st.ticket, self.load_timeout_s,
                                f"store load of layer {unit.main!r} (slot {unit.gate_slot}) did not finish")
            st.loaded = True
        elif st.before:
            lio.wait_ticket(st.before, self.load_timeout_s,
                            f"store save before layer {unit.main!r}'s KV write (slot "
                            f"{unit.gate_slot}) did not finish")
        st.writable = True
        with self._lock:
            self._stats.load_wait_s += time.perf_counter() - t0

    def _acquire(self, unit: _Unit, loads: bool) -> WriteLease:
        """Own ``unit``'s slot through the gate (deadline). A wait that times out only on
        saves abandoned at an earlier deadline (``_drain_or_abandon``) is not an error:
        their copies were waited for twice, their objects are never committed, so their
        consumers are released and the slot is reused (logged)."""
        lio = self._lio
        assert lio is not None  # made by start_step
        try:
            return self.gate.acquire_write(unit.gate_slot, unit.main, behind_queued=loads, pump=lio.pump)
        except GateTimeout as exc:
            if not lio.release_abandoned(unit.gate_slot):
                raise
            log.error("%s: only abandoned store saves held it (never committed); the slot is "
                      "reused while their copies end", exc)
            return self.gate.acquire_write(unit.gate_slot, unit.main, behind_queued=loads, pump=lio.pump)

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
                st.before, st.ticket = self._queue_unit_load(unit)
            except BaseException:
                st.released = True
                self.gate.release_write(lease)
                raise
        return st

    def _queue_unit_load(self, unit: _Unit) -> tuple[int, int]:
        """Queue the loads of ``unit``'s layers; the ticket before its first job and its
        last job's ticket (0: nothing queued)."""
        lio = self._lio
        assert lio is not None  # made by start_step
        first = last = 0
        for layer in unit.members:
            refs = self._load_refs(layer)
            if refs:
                last = lio.queue_load(layer, refs) or last
                first = first or last
        return max(first - 1, 0), last

    def failed_requests_at_or_before(self, layer: str) -> frozenset[str] | None:
        """The requests whose load of the current step failed for ``layer``'s unit or a
        layer before it: the KV this step wrote for them from there on is wrong (a sibling
        must not hand it on either). Empty: none failed; None: a failed block's request is
        unknown, so every request of the step counts as failed."""
        unit = self._unit_of.get(layer)
        if unit is None or self._lio is None:
            return frozenset()
        return self._failed_owners(unit)

    def _failed_owners(self, unit: _Unit) -> frozenset[str] | None:
        """See :meth:`failed_requests_at_or_before`."""
        if not self._failed_at_or_before(unit):
            return frozenset()
        lio = self._lio
        assert lio is not None and self._step is not None  # made by start_step
        failed = {b for layer, blocks in lio.step_failed_blocks.items()
                  if self._unit_of[layer].index <= unit.index for b in blocks}
        owners = {r.owner for r in (*self._step.load, *self._step.load_shared) if r.block_id in failed}
        return None if not owners or "" in owners else frozenset(owners)

    def _failed_at_or_before(self, unit: _Unit) -> bool:
        """A load of this step failed for ``unit`` or a layer before it (its own load was
        waited for, so reaping now counts it)."""
        lio = self._lio
        assert lio is not None  # made by start_step
        lio.reap()
        return any(self._unit_of[name].index <= unit.index for name in lio.step_failed_blocks)

    def _split_failed(self, unit: _Unit, refs: Sequence[BlockRef]
                      ) -> tuple[Sequence[BlockRef], Sequence[BlockRef]]:
        """``refs`` split into (not to save, to save) for ``unit``: after a load of this
        step failed at or before it, the saves of every request that owns a failed block
        are dropped; the other requests' attention read only their own, complete blocks,
        so their KV is right and is saved (dropping it too would make such a request miss
        its own blocks in its next chunk and be recomputed as well). A failed block whose
        owner is unknown drops every save of the step."""
        owners = self._failed_owners(unit)
        if owners is None:
            return refs, ()
        if not owners:
            return (), refs
        return ([r for r in refs if r.owner in owners], [r for r in refs if r.owner not in owners])

    def _drop_unit_save(self, unit: _Unit, refs: Sequence[BlockRef]) -> None:
        """Save none of ``refs`` (the blocks of requests whose load failed) for ``unit``: a
        load earlier in the step failed for them, so this layer's attention (or an earlier
        one's) read a buffer the load never filled and the KV it handed on is wrong. vLLM
        recomputes those requests; committing these objects would make the recompute's
        saves duplicates and serve the wrong KV to every later load (planned objects are
        released at the next step start)."""
        n = len(refs) * len(unit.members)
        with self._lock:
            first = self._stats.save_dropped == 0
            self._stats.save_dropped += n
        (log.warning if first else log.debug)(
            "layerwise: %d objects of layer %s not saved: a load of this step failed before it",
            n, unit.main)

    def _queue_unit_save(self, unit: _Unit, refs: Sequence[BlockRef], generation: int) -> None:
        """Queue the saves of ``unit``'s layers and register them as one queued consumer of
        the slot, released once the last of them is committed."""
        lio = self._lio
        assert lio is not None  # made by start_step
        errors: list[BaseException] = []
        delay = self.save_delay_s
        for layer in unit.members:
            lio.queue_save(layer, refs, errors, delay)
            delay = 0.0  # the injected delay is once per unit, like one slow save
        lio.release_after(errors, unit.gate_slot, generation, unit.main)
