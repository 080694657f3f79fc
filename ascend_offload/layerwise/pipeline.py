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
3. ``save_layer(L)``: register the store save as a consumer of S (plus
   ``extra_consumers`` and save listeners, e.g. the P/D producer's decode reads),
   release the write lease, queue the save on the save thread, and queue gate +
   load of the next ``prefetch_layers`` layers on the load thread.

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

import concurrent.futures as cf
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
from ascend_offload.store.base import KVStore, WriteHandle

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
    stolen_loads: int = 0  # queued loads the waiting thread ran itself
    stolen_saves: int = 0  # queued saves drain ran itself

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
    job: cf.Future[WriteLease] | None = None  # prefetch: gate + load on the I/O thread
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
        self._job_timeout_s = save_timeout_s + load_timeout_s  # gate wait + load
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
        # queued saves (gate slot, job), so drain can run a not-yet-started save itself
        self._save_futures: dict[cf.Future[None], tuple[int, Callable[[], None]]] = {}
        self._loader = cf.ThreadPoolExecutor(1, thread_name_prefix="lw-load")
        self._saver = cf.ThreadPoolExecutor(1, thread_name_prefix="lw-save")
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
        self._step = io
        with self._lock:
            self._stats.steps += 1
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
        refs = self._step.save
        if refs:
            token = self.gate.add_consumer(
                unit.gate_slot, st.lease.generation, f"store-save {layer}"
            )
            ready = device.record_after_compute()
            job = functools.partial(self._save_unit, unit, refs, token, ready)
            fut = self._saver.submit(job)
            with self._lock:
                self._save_futures[fut] = (unit.gate_slot, job)
            fut.add_done_callback(self._forget_save)
        st.released = True
        self.gate.release_write(st.lease)
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
            lease = st.lease
            if lease is None and st.job is not None and not st.job.cancel():
                try:  # a prefetch that started owns the slot once it ends
                    lease = st.job.result(timeout=self._job_timeout_s)
                except cf.TimeoutError:
                    raise LoadTimeout(
                        f"layerwise: prefetch of layer {main!r} still running at step end after "
                        f"{self._job_timeout_s}s"
                    ) from None
                except Exception as exc:  # the layer did not run; its prefetch never owned it
                    log.warning("layerwise: prefetch of unused layer %s failed: %s", main, exc)
            if lease is not None:
                self.gate.release_write(lease)
        self._state.clear()
        self._step = None
        if wait_saves:
            self.drain()

    @property
    def in_step(self) -> bool:
        """True between ``start_step`` and ``finish_step``."""
        return self._step is not None

    def take_load_errors(self) -> set[int]:
        """Device block ids whose load failed since the last call (vLLM recomputes or fails them)."""
        with self._lock:
            out, self._load_errors = self._load_errors, set()
            return out

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait for every queued save to finish (deadline: ``save_timeout_s``)."""
        deadline = time.monotonic() + (self.save_timeout_s if timeout_s is None else timeout_s)
        with self._lock:
            pending = list(self._save_futures)
        for fut in pending:  # run queued saves here rather than wait for the I/O thread
            self._steal(fut)
        _done, not_done = cf.wait(pending, timeout=max(0.0, deadline - time.monotonic()))
        if not_done:
            raise TimeoutError(
                f"layerwise: {len(not_done)} store saves still running after the deadline"
            )

    def stats(self) -> PipelineStats:
        with self._lock:
            return dataclasses.replace(self._stats)

    def close(self) -> None:
        if self._closed:
            return
        try:
            if self._state:
                self.finish_step()
            self.drain()
        finally:
            self._closed = True
            self._loader.shutdown(wait=True)
            self._saver.shutdown(wait=True)

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

    def _steal(self, fut: cf.Future[None]) -> None:
        """Run a queued save on this thread if the I/O thread has not started it.

        Why: under CPU oversubscription a hand-off to a starved I/O thread costs a
        scheduler time slice per layer; a waiter that would block anyway does the work.
        """
        with self._lock:
            entry = self._save_futures.get(fut)
        if entry is not None and fut.cancel():
            entry[1]()
            with self._lock:
                self._stats.stolen_saves += 1

    def _make_ready(self, unit: _Unit) -> None:
        """Own ``unit``'s slot (gate, deadline) and have its store objects in it."""
        st = self._state.get(unit.main)
        if st is not None and (st.loaded or st.released):
            return
        t0 = time.perf_counter()
        if st is None:  # not prefetched: own the slot and load on this thread
            lease = self._acquire_and_load(unit)
            st = self._state[unit.main] = _UnitState(lease=lease)
        else:
            assert st.job is not None
            if st.job.cancel():  # the I/O thread has not started it: do it here
                st.lease = self._acquire_and_load(unit)
                with self._lock:
                    self._stats.stolen_loads += 1
            else:
                try:
                    st.lease = st.job.result(timeout=self._job_timeout_s)
                except cf.TimeoutError:
                    raise LoadTimeout(
                        f"layerwise: store load of layer {unit.main!r} (slot {unit.gate_slot}) "
                        f"did not finish within {self._job_timeout_s}s"
                    ) from None
        st.loaded = True
        with self._lock:
            self._stats.load_wait_s += time.perf_counter() - t0

    def _acquire_and_load(self, unit: _Unit) -> WriteLease:
        """Wait (with the gate's deadline) for the slot, then fill it from the store."""
        lease = self.gate.acquire_write(unit.gate_slot, unit.main)
        try:
            self._load_unit(unit)
        except BaseException:
            self.gate.release_write(lease)
            raise
        return lease

    def _forget_save(self, fut: cf.Future[None]) -> None:
        with self._lock:
            self._save_futures.pop(fut, None)

    def _load_refs(self, layer: str) -> tuple[BlockRef, ...]:
        assert self._step is not None
        if self.plan.is_shared(self.plan.layers[self._unit_of[layer].index]):
            return self._step.load + self._step.load_shared
        return self._step.load

    def _prefetch_from(self, start: int) -> None:
        """Queue gate + load of the next ``prefetch_layers`` layers on the I/O thread.

        A queued job waits on the gate itself, so a slot whose previous contents are
        still being saved is filled as soon as that save ends, while this thread computes.
        """
        if self._step is None:
            return
        stop = min(len(self._units), start + (self.prefetch_layers if start else 1 + self.prefetch_layers))
        for unit in self._units[start:stop]:
            if unit.main in self._state:
                continue
            if not any(self._load_refs(m) for m in unit.members):
                continue  # nothing to move: the slot is owned when the layer runs
            # Slot order within a step: an earlier user of the slot must be done with it.
            if any(e not in self._state or not self._state[e].released for e in unit.earlier):
                continue
            st = self._state[unit.main] = _UnitState()
            st.job = self._loader.submit(self._acquire_and_load, unit)
            with self._lock:
                self._stats.prefetched_loads += 1

    def _block_view(self, kv: torch.Tensor, block_id: int) -> torch.Tensor:
        return kv.select(self.block_dim, block_id)

    def _load_unit(self, unit: _Unit) -> None:
        with device.stream_context(self._load_stream):
            for layer in unit.members:
                refs = self._load_refs(layer)
                if refs:
                    self._load_layer(layer, refs)
            self._load_stream.synchronize()

    def _direct(self, kv: torch.Tensor) -> bool:
        """Host KV with contiguous block pages: copy straight between store and KV tensor."""
        return (self._direct_host_io and not device.is_accelerator(kv)
                and self._block_view(kv, 0).is_contiguous())

    def _read_one(self, pin: object, key: str, dst: torch.Tensor) -> bool:
        try:
            self.store.read(pin, key, 0, dst)  # type: ignore[arg-type]
            return True
        except Exception as exc:  # a broken object: that block only
            log.warning("layerwise: load of %s failed: %s", key, exc)
            return False

    def _block_rows(self, kv: torch.Tensor) -> torch.Tensor | None:
        """``kv`` as ``[num_blocks, block bytes]`` rows (block-first and contiguous), else None."""
        if self.block_dim != 0 or not kv.is_contiguous() or kv.shape[0] == 0:
            return None
        return kv.view(kv.shape[0], -1)

    def _read_rows(self, pin: object, keys: list[str], kv: torch.Tensor,
                   refs: Sequence[BlockRef]) -> bool:
        """A layer's blocks in one store call (one scatter, the GIL held once), or False
        when the layout does not allow it or anything failed (the caller retries per block)."""
        rows = self._block_rows(kv)
        if rows is None:
            return False
        try:
            self.store.read_rows(pin, keys, rows, [r.block_id for r in refs])  # type: ignore[arg-type]
            return True
        except Exception as exc:
            log.debug("layerwise: batched load failed (%s); retrying per block", exc)
            return False

    def _load_layer(self, layer: str, refs: Sequence[BlockRef]) -> None:
        kv = self._kv[layer]
        keys = [self.key_fn(r.key, layer) for r in refs]
        failed: list[int] = []
        pin = self.store.pin(keys)
        if pin is None:  # find exactly which objects are missing
            ok_refs, ok_keys = [], []
            for r, k in zip(refs, keys, strict=True):
                if self.store.contains(k):
                    ok_refs.append(r)
                    ok_keys.append(k)
                else:
                    failed.append(r.block_id)
            refs, keys = ok_refs, ok_keys
            pin = self.store.pin(keys) if keys else None
            if pin is None and keys:  # evicted between the checks
                failed.extend(r.block_id for r in refs)
                refs, keys = [], []
        moved = 0
        try:
            if pin is not None and refs:
                if self._direct(kv):
                    if self._read_rows(pin, keys, kv, refs):
                        moved = len(refs)
                    else:  # per block, so a broken object fails only its own block
                        for r, k in zip(refs, keys, strict=True):
                            view = self._block_view(kv, r.block_id).view(torch.uint8).reshape(-1)
                            if self._read_one(pin, k, view):
                                moved += 1
                            else:
                                failed.append(r.block_id)
                else:  # accelerator: one host staging buffer, one H2D scatter per layer
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
                    moved = len(ok)
        finally:
            if pin is not None:
                self.store.unpin(pin)
        with self._lock:
            if moved:
                self._stats.loads += 1
            self._stats.blocks_loaded += moved
            self._stats.bytes_loaded += moved * self._page_bytes[layer]
            self._stats.load_errors += len(failed)
            self._load_errors.update(failed)

    def _save_unit(
        self, unit: _Unit, refs: Sequence[BlockRef], token: ConsumerToken, ready: object
    ) -> None:
        error: BaseException | None = None
        try:
            if self.save_delay_s:
                time.sleep(self.save_delay_s)  # test hook: proves writers wait for the gate
            ready.synchronize()  # type: ignore[attr-defined]  # the layer's KV is computed
            for layer in unit.members:
                self._save_layer(layer, refs)
        except BaseException as exc:
            error = exc
            with self._lock:
                self._stats.save_errors += 1
            log.error("layerwise: store save of layer %s failed: %s", unit.main, exc)
        finally:
            try:
                self.gate.release_consumer(token, error)
            except GateError:  # pragma: no cover - gate misuse is a bug; keep the thread alive
                log.exception("layerwise: releasing the save consumer failed")

    def _save_layer(self, layer: str, refs: Sequence[BlockRef]) -> None:
        kv = self._kv[layer]
        size = self._page_bytes[layer]
        keys = [self.key_fn(r.key, layer) for r in refs]
        got = self.store.allocate(keys, [size] * len(keys))
        if got is None:
            with self._lock:
                self._stats.save_skipped += len(keys)
            return
        pairs = [(r, h) for r, h in zip(refs, got, strict=True) if h is not None]
        handles: list[WriteHandle] = [h for _, h in pairs]  # all aborted if anything fails
        try:
            direct = self._direct(kv)
            block_rows = self._block_rows(kv) if direct else None
            with device.stream_context(self._save_stream):
                if block_rows is not None:  # host KV, block-first: one scatter below
                    rows = []
                elif direct:
                    rows = [self._block_view(kv, r.block_id) for r, _ in pairs]
                elif pairs:  # accelerator: one gather + one D2H copy per layer
                    idx = torch.tensor([r.block_id for r, _ in pairs], dtype=torch.long)
                    picked = kv.index_select(self.block_dim, idx.to(kv.device)).movedim(self.block_dim, 0)
                    host = device.empty_host(tuple(picked.shape), kv.dtype)
                    host.copy_(picked, non_blocking=True)
                    self._save_stream.synchronize()
                    rows = list(host)
                else:
                    rows = []
                if block_rows is not None:
                    if pairs:
                        self.store.write_rows(handles, block_rows, [r.block_id for r, _ in pairs])
                else:
                    for (_, h), row in zip(pairs, rows, strict=True):
                        self.store.write(h, 0, row.reshape(-1).view(torch.uint8))
                self._save_stream.synchronize()
            self.store.commit(handles)
        except BaseException:
            self.store.abort(handles)
            raise
        with self._lock:
            self._stats.saves += 1
            self._stats.blocks_saved += len(handles)
            self._stats.bytes_saved += len(handles) * size
            self._stats.save_duplicates += len(keys) - len(handles)
