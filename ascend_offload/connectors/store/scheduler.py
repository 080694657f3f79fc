"""The store connector's scheduler role: vLLM's requests and steps -> store bookkeeping.

The store *index* lives here (``LocalStore(with_data=False)``): lookups, page
placement, commit/abort, pins and eviction are decided in one process, single
threaded, so they never race. With backend ``mooncake`` or ``memcache`` the store's
service (master / meta service) is the index of the shared tier behind the local pages: a prefix the local index lacks is looked
up there and fetched into local pages before it is offered
(``store/shared/remote_fetch.py``); saved blocks are published by the workers. The rules themselves are vLLM-free
(``store/book/prefix_jobs.py``, ``store/book/layerwise_saves.py``); this module only reads
vLLM's request and scheduler-output fields and turns the answers into the
messages of ``metadata.py``. One class per mode:

* :class:`PrefixScheduler` - whole prefixes: load the longest stored prefix before
  the first forward, save full blocks after the step that computed them;
* :class:`LayerwiseScheduler` - every step names the blocks each layer loads and
  saves; the workers' layerwise pipeline moves them during the forward.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ascend_offload.connectors.metrics import CounterDeltas, StoreConnectorStats
from ascend_offload.connectors.store.metadata import (
    LayerwiseMetadata,
    StoreConnectorMetadata,
    StoreWorkerMetadata,
)
from ascend_offload.connectors.store.settings import NAME, StoreSettings
from ascend_offload.layerwise.steps import StepBuilder, StepIO
from ascend_offload.store.book.layerwise_saves import LayerwiseSaves
from ascend_offload.store.book.preemption import ResidencyTracker, State
from ascend_offload.store.book.prefix_jobs import PrefixJobs
from ascend_offload.store.book.request_book import RequestBook
from ascend_offload.store.keys import block_keys
from ascend_offload.store.local import LocalStore
from ascend_offload.store.shared.remote_fetch import RemoteFetches

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from ascend_offload.connectors.store.ssd import SsdScheduler
    from ascend_offload.store.shared.tier import RemoteIndex

log = logging.getLogger(__name__)

#: ``block_ids_of(req_id)``: a running request's block table (vLLM's KV cache manager).
BlockIdsOf = Callable[[str], list[int]]


def _preempted(scheduler_output: SchedulerOutput) -> set[str]:
    """Requests vLLM preempted in this step (``None`` when none; a scheduler output of
    another shape, such as a test's stand-in, may lack the field)."""
    return getattr(scheduler_output, "preempted_req_ids", None) or set()


class StoreScheduler(abc.ABC):
    """What both modes share: keys from block hashes, lookups, completions, stats."""

    book: RequestBook[Any]

    def __init__(self, settings: StoreSettings, block_ids_of: BlockIdsOf) -> None:
        s = self.settings = settings
        self.block_size = s.block_size
        self.index = LocalStore(s.num_pages * s.page_bytes, s.page_bytes, s.cfg.local.eviction,
                                with_data=False)
        self._block_ids_of = block_ids_of
        self._requests: dict[str, Request] = {}  # every request the connector was asked about
        self._deltas = CounterDeltas(StoreConnectorStats)
        #: preempted requests: their stored blocks, the resumption wait, the counters
        self.residency = ResidencyTracker(s.cfg.save_timeout_s)
        self._computed_blocks: dict[str, int] = {}  # full blocks computed once the last scheduled step ran
        self._device_blocks: dict[str, int] = {}  # leading blocks the device cache gave at the last lookup
        self.remote_index: RemoteIndex | None = None
        self.fetches: RemoteFetches | None = None
        if s.shared_tier:
            from ascend_offload.store.shared.backends import shared_tier_index

            self.remote_index = shared_tier_index(s.cfg, s.world_size)
            self.fetches = RemoteFetches(self.index, self.remote_index, page_bytes=s.page_bytes,
                                         world_size=s.world_size, timeout_s=s.cfg.load_timeout_s)
        self.ssd: SsdScheduler | None = None  # local.ssd: the SSD tier under the host pages
        if s.ssd_tier:
            from ascend_offload.connectors.store.ssd import SsdScheduler

            self.ssd = SsdScheduler(s, self.index)
        log.info("%s: local store index with %d pages of %d bytes per rank%s", NAME, s.num_pages,
                 s.page_bytes, f", shared tier at the {self.remote_index.service}" if self.remote_index else "")

    def _book_args(self) -> dict[str, Any]:
        s = self.settings
        return {"block_size": s.block_size, "page_bytes": s.page_bytes, "world_size": s.world_size,
                "min_load_blocks": s.cfg.min_load_blocks,
                # the tier behind the host pages: shared (fetches) or SSD (promotes), never both
                "remote": self.fetches if self.ssd is None else self.ssd.jobs}

    def _shared_tier_meta(self) -> dict[str, Any]:
        """This step's fetch jobs and whether the ranks publish its saves."""
        if self.fetches is None or self.remote_index is None:
            return {}
        return {"fetches": self.fetches.take_jobs(), "publish": self.remote_index.available()}

    def _keys(self, request: Request, upto: int) -> list[str]:
        hashes, ratio = request.block_hashes, self.settings.hash_ratio
        per_block = [hashes[(i + 1) * ratio - 1] for i in range(upto)]
        return block_keys(self.settings.cfg.model_tag, self.settings.fingerprint, 0, per_block)

    def _full_blocks_with_hash(self, request: Request) -> int:
        return len(request.block_hashes) // self.settings.hash_ratio

    def _track(self, request: Request) -> None:
        self._requests.setdefault(request.request_id, request)

    # ------------------------------------------------------------------ preemption

    def _save_pending(self, key: str) -> bool:
        """A save of ``key`` was placed and not every rank reported it yet."""
        return self.index.has(key) and not self.index.is_committed(key)

    def _note_preemption(self, request: Request) -> None:
        """Register a preemption vLLM made (seen once, either in the step's
        ``preempted_req_ids`` or, when vLLM resumes it in the same step, at its lookup)."""
        rid = request.request_id
        n = self._computed_blocks.get(rid, 0)
        if self.residency.preempt(rid, request.num_preemptions, self._keys(request, n), self._save_pending):
            self.book.preempted(rid)  # its resumption asks the SSD / shared tier again
            log.debug("%s: request %s preempted with %d computed full blocks (%s)", NAME, rid, n,
                      self.residency.state(rid).value)

    def _note_scheduled(self, scheduler_output: SchedulerOutput) -> None:
        """Preemptions of this step, and every scheduled request's computed full blocks
        once this step ran (what a later preemption leaves in the store)."""
        for rid in _preempted(scheduler_output):
            request = self._requests.get(rid)
            if request is not None:
                self._note_preemption(request)
        computed = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for rid, before in computed.items():
            request = self._requests.get(rid)
            if request is not None:
                after = before + scheduler_output.num_scheduled_tokens.get(rid, 0)
                self._computed_blocks[rid] = min(after // self.block_size, self._full_blocks_with_hash(request))

    def _resumed(self, request: Request, loaded_blocks: int) -> bool:
        """vLLM admitted the request with ``loaded_blocks`` from the store: if it was a
        preempted one, account what came back and what is recomputed."""
        rid = request.request_id
        if self.residency.state(rid) not in (State.SAVING, State.STORED, State.LOST):
            return False
        self.residency.resume(rid, self._device_blocks.get(rid, 0), loaded_blocks)
        return True

    def _meta_fields(self, scheduler_output: SchedulerOutput) -> dict[str, Any]:
        """Epoch and preemption count of this step, and the shared tier's part."""
        return {"epoch": self.book.epoch, "preempted": len(_preempted(scheduler_output)),
                **self._shared_tier_meta()}

    # ------------------------------------------------------------------ vLLM calls

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._track(request)
        rid = request.request_id
        if request.num_preemptions:
            self._note_preemption(request)
            # its own saves still in flight: ask again later (bounded by save_timeout_s)
            if self.residency.wait_for_saves(rid, self._save_pending):
                return None, False
        self._device_blocks[rid] = num_computed_tokens // self.block_size
        # vLLM must compute at least the last prompt token itself.
        max_blocks = min((request.num_tokens - 1) // self.block_size, self._full_blocks_with_hash(request))
        n = self.book.lookup(request.request_id, num_computed_tokens, max_blocks,
                             lambda upto: self._keys(request, upto))
        return n, False

    @abc.abstractmethod
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Take (or drop) the offer made by the last lookup."""

    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """What the worker ranks copy in this step."""

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, StoreWorkerMetadata):
            # holds and their releases count whatever the epoch: a late put reads its pages
            # until it ends, reset or not (a reset keeps held saves pending, then aborts them)
            if meta.save_held:
                self.book.hold(meta.save_held)
            if (meta.done or meta.failed) and self.book.current(meta.epoch):
                self.book.report(meta.done, meta.failed)
                self._after_report()
            if meta.save_released:
                self.book.release(meta.save_released)
            if self.fetches is not None and (meta.fetched or meta.fetch_failed):
                self.fetches.report(meta.fetched, meta.fetch_failed, meta.fetch_unsafe)
            if self.fetches is not None and meta.fetch_released:
                self.fetches.release(meta.fetch_released)
            if self.ssd is not None:
                self.ssd.report(meta.ssd_spilled, meta.ssd_spill_failed, meta.ssd_promoted, meta.ssd_corrupt)

    def _after_report(self) -> None:  # noqa: B027 - optional hook
        """Mode-specific follow-up of the ranks' reports."""

    def _request_ended(self, req_id: str) -> None:  # noqa: B027 - optional hook
        """Mode-specific cleanup of a finished request (before its pins are released)."""

    # ------------------------------------------------------------------ reset

    def _can_reset(self) -> bool:
        """Whether the index may forget its objects now: not while a request vLLM did not
        preempt holds computed tokens (vLLM's own device-cache reset refuses then too).
        Its KV predates the reset, so its later saves would bring pre-reset blocks into the
        new index; in layerwise mode its later steps also load its blocks back from the
        store. With ``reset_running_requests=True`` vLLM preempts them all first."""
        return all(r.num_computed_tokens == 0 for r in self._requests.values())

    def _reset_tiers(self) -> None:
        """Forget what the tiers behind the local pages hold for this engine: the SSD
        tier (private to this engine) is reset; the shared tier (mooncake / memcache) is
        shared with other engines and is not (see docs/store.md)."""
        if self.ssd is not None:
            self.ssd.reset()

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``: forget every stored
        object. Open jobs are settled first (saves aborted, loads fenced), the epoch
        grows so the ranks' reports of those jobs never commit into the new index, and
        every preempted request's blocks count as lost (it recomputes them)."""
        if not self._can_reset():
            log.warning("%s: reset refused: a running request still reads the store", NAME)
            return False
        for request in self._requests.values():  # preempted by the reset itself, just now
            if request.num_preemptions:
                self._note_preemption(request)
        dropped = self.book.reset()
        lost = self.residency.reset()
        self._reset_tiers()
        log.info("%s: store reset (epoch %d): %d objects dropped, %d preempted requests lost their blocks",
                 NAME, self.book.epoch, dropped, lost)
        return True

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Release what the request holds; its block counts and the store's occupancy go
        back in ``kv_transfer_params['ascend_store']``."""
        rid = request.request_id
        if self._requests.pop(rid, None) is None:
            return False, None
        self._request_ended(rid)
        self._computed_blocks.pop(rid, None)
        self._device_blocks.pop(rid, None)
        stats: dict[str, Any] = dict(self.book.finish(rid) or {})
        stats.update(self.residency.forget(rid))
        stats["store"] = self.book.store_gauges()
        if self.remote_index is not None:
            stats["store"].update(self.remote_index.counters())
        if self.ssd is not None:
            stats["store"].update(self.ssd.jobs.counters(), **self.ssd.gauges())
        log.debug("%s: request %s finished: %s", NAME, rid, stats)
        return False, {"ascend_store": stats}

    def stats(self) -> StoreConnectorStats | None:
        """Counter deltas since the last call, and the index's pinned / pending objects."""
        totals, gauges = self.book.metrics()
        totals.update(self.residency.counters())
        if self.remote_index is not None:
            totals.update(self.remote_index.counters())
        if self.ssd is not None:
            gauges.update(self.ssd.gauges())
        return self._deltas.take(totals, gauges)

    def close(self) -> None:
        """Release the shared tier's client (its prober thread, its master connection)."""
        if self.remote_index is not None:
            self.remote_index.close()
            self.remote_index = None
        if self.ssd is not None:
            self.ssd.close()  # writes the index one last time (persist)
            self.ssd = None


class PrefixScheduler(StoreScheduler):
    """Whole-prefix mode: copy jobs (see ``store/book/prefix_jobs.py``)."""

    def __init__(self, settings: StoreSettings, block_ids_of: BlockIdsOf) -> None:
        super().__init__(settings, block_ids_of)
        self.book: PrefixJobs = PrefixJobs(self.index, **self._book_args())

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._track(request)
        block_ids = blocks.get_block_ids()[0] if num_external_tokens else []
        job = self.book.accept_load(request.request_id, num_external_tokens, block_ids)
        loaded = len(job.block_ids) if job is not None else 0
        if self._resumed(request, loaded):  # blocks past the load are recomputed: save them again
            self.book.rewind_saves(request.request_id, self._device_blocks.get(request.request_id, 0) + loaded)

    def _after_report(self) -> None:
        for rid, ok in self.book.settled_loads:
            self.residency.loaded(rid, ok)
        self.book.settled_loads.clear()

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StoreConnectorMetadata:
        self._note_scheduled(scheduler_output)
        meta = StoreConnectorMetadata(loads=self.book.take_loads(), **self._meta_fields(scheduler_output),
                                      **(self.ssd.meta() if self.ssd is not None else {}))
        computed: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            computed[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, n in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            computed[req_id] = n
        for req_id, before in computed.items():
            request = self._requests.get(req_id)
            if request is None:
                continue
            after = before + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            full = min(after // self.block_size, self._full_blocks_with_hash(request))
            if full > self.book.saved_upto(req_id):
                job = self.book.plan_save(req_id, self._keys(request, full), self._block_ids_of(req_id))
                if job is not None:
                    meta.saves.append(job)
                    if self.ssd is not None:
                        self.ssd.watch(job.keys)
        return meta


class LayerwiseScheduler(StoreScheduler):
    """Layerwise mode: per-step block keys (``StepBuilder``) and their save placement
    (see ``store/book/layerwise_saves.py``)."""

    def __init__(self, settings: StoreSettings, block_ids_of: BlockIdsOf) -> None:
        super().__init__(settings, block_ids_of)
        self.steps = StepBuilder(self.block_size, partial_prefix=settings.partial_prefix)
        self.book: LayerwiseSaves = LayerwiseSaves(
            self.index, partial_prefix=self.steps.partial_prefix, **self._book_args())

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._track(request)
        accepted = self.book.accept_load(request.request_id, num_external_tokens)
        loaded = num_external_tokens // self.block_size if accepted else 0
        if self._resumed(request, loaded):
            # the pipeline loads them in the request's first step and reports no
            # per-request completion: counted as resumed when accepted
            self.residency.loaded(request.request_id, True)

    def _full_key_fn(self, request: Request) -> Callable[[int], str | None]:
        n = self._full_blocks_with_hash(request)
        keys = self._keys(request, n)
        return lambda i: keys[i] if i < n else None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> LayerwiseMetadata:
        # start_load_kv must run before the forward: the pipeline owns and fills the
        # first layer's slot there (vLLM otherwise starts loads after the forward).
        scheduler_output.has_sync_kv_loads = True
        self._note_scheduled(scheduler_output)
        steps, book = self.steps, self.book
        ios: list[tuple[str, StepIO]] = []
        n_sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            request = self._requests.get(new.req_id)
            if request is None:
                continue
            steps.begin(new.req_id, new.block_ids[0], book.hit_keys(new.req_id))
            steps.schedule(new.req_id, new.num_computed_tokens, n_sched[new.req_id], self._full_key_fn(request))
            ios.append((new.req_id, steps.build()))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            request = self._requests.get(rid)
            if request is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids or rid not in steps:
                steps.begin(rid, self._block_ids_of(rid), book.hit_keys(rid))
            elif new_ids is not None:
                steps.add_blocks(rid, new_ids[0])
            steps.schedule(rid, cached.num_computed_tokens[i], n_sched[rid], self._full_key_fn(request))
            ios.append((rid, steps.build()))
        save_blocks: list[str] = []
        for rid, io in ios:
            save_blocks += book.place(rid, [ref.key for ref in io.save])
        io = StepIO(
            load=tuple(r for _, x in ios for r in x.load),
            load_shared=tuple(r for _, x in ios for r in x.load_shared),
            save=tuple(r for _, x in ios for r in x.save),
        )
        pages = book.pages(ref.key for ref in (*io.load, *io.load_shared, *io.save))
        return LayerwiseMetadata(io=io, pages=pages, save_blocks=save_blocks, freed=book.take_freed(),
                                 **self._meta_fields(scheduler_output))

    def _request_ended(self, req_id: str) -> None:
        self.steps.end(req_id)
