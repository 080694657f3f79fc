"""``AscendStoreConnector``: vLLM adapter for the host KV store tier.

Whole-prefix mode (``use_layerwise: false``): full blocks are saved to the store
after the step that computed them and the longest committed prefix of a new
request is loaded before its first forward.

Split of responsibilities (the shape of vLLM's ``kv_offload``):

* the scheduler side owns the store *index* (``LocalStore(with_data=False)``):
  lookups, page allocation, commit/abort, pins and eviction — so decisions are
  made in one place and never race;
* each worker rank owns the *bytes* of its own shard in a host page pool and
  copies blocks by the page numbers the scheduler chose — workers know nothing
  about requests;
* completions travel back as worker metadata, summed across ranks; an object is
  committed (or a load pin released) only when every rank reported.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from ascend_offload.config import ConfigError, StoreConnectorConfig, parse_extra_config
from ascend_offload.connectors.metrics import CounterDeltas, StoreConnectorStats, StorePromMetrics
from ascend_offload.layerwise.pipeline import LayerwisePipeline, StepBuilder, StepIO
from ascend_offload.store.base import Pin, WriteHandle
from ascend_offload.store.keys import block_keys, layout_fingerprint
from ascend_offload.store.local import LocalStore
from ascend_offload.store.scheduled import ScheduledPageStore
from ascend_offload.store.worker_pool import WorkerPagePool, block_dim

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

NAME = "AscendStoreConnector"


# ----------------------------------------------------------------------------- messages


@dataclasses.dataclass(frozen=True)
class CopyJob:
    """Copy ``block_ids[i]`` <-> pool page ``pages[i]`` on every rank."""

    job_id: int
    block_ids: tuple[int, ...]
    pages: tuple[int, ...]


@dataclasses.dataclass
class StoreConnectorMetadata(KVConnectorMetadata):
    loads: list[CopyJob] = dataclasses.field(default_factory=list)
    saves: list[CopyJob] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class LayerwiseMetadata(KVConnectorMetadata):
    """Layerwise mode: what the step moves (block keys) and where each block lives."""

    io: StepIO
    pages: dict[str, int]  # block key -> page, for every block of ``io``
    save_blocks: list[str]  # blocks newly placed for saving this step
    freed: list[str]  # block keys whose pages were freed since the last step


@dataclasses.dataclass
class StoreWorkerMetadata(KVConnectorWorkerMetadata):
    """Per-step completions of one or more ranks: job id (whole-prefix mode) or block key
    (layerwise mode) -> number of ranks."""

    done: Counter[Any] = dataclasses.field(default_factory=Counter)
    failed: Counter[Any] = dataclasses.field(default_factory=Counter)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, StoreWorkerMetadata)
        return StoreWorkerMetadata(done=self.done + other.done, failed=self.failed + other.failed)


# ----------------------------------------------------------------------------- scheduler state


@dataclasses.dataclass
class _RequestState:
    request: Request
    saved_upto: int = 0  # blocks [0, saved_upto) are stored, being stored, or skipped
    load_pin: Pin | None = None
    load_range: tuple[int, int] = (0, 0)  # [first, last) block indices to load
    loaded_blocks: int = 0
    saved_blocks: int = 0
    skipped_blocks: int = 0
    duplicate_blocks: int = 0
    # layerwise mode: the request's own stored blocks stay pinned until it ends
    hit_keys: tuple[str, ...] = ()
    pins: list[Pin] = dataclasses.field(default_factory=list)
    private_keys: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Job:
    kind: str  # "load" | "save"
    req_id: str
    handles: list[WriteHandle] = dataclasses.field(default_factory=list)
    pin: Pin | None = None
    done: int = 0
    failed: int = 0


def object_bytes(kv_cache_config: KVCacheConfig) -> int:
    """Bytes of one block across all cache-bearing layers on one rank."""
    group = kv_cache_config.kv_cache_groups[0]
    return group.kv_cache_spec.page_size_bytes * len(group.layer_names)


class AscendStoreConnector(KVConnectorBase_V1):
    """Host KV store tier; see the module docstring for the design."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        tc = vllm_config.kv_transfer_config
        self.cfg: StoreConnectorConfig = parse_extra_config(NAME, tc.kv_connector_extra_config)
        if kv_cache_config is None:
            raise ConfigError(f"{NAME} needs the KV cache config (vLLM >= 0.11)")
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise ConfigError(
                f"{NAME} supports models with one KV cache group, got "
                f"{len(kv_cache_config.kv_cache_groups)}"
            )
        self.layerwise = self.cfg.use_layerwise
        if self.layerwise and vllm_config.cache_config.enable_prefix_caching:
            raise ConfigError(
                "key 'use_layerwise'=True needs vLLM's device prefix caching off: layers that "
                "share a physical buffer cannot keep cached blocks (set "
                "enable_prefix_caching=False / --no-enable-prefix-caching)"
            )
        self.block_size = vllm_config.cache_config.block_size
        hash_bs = kv_cache_config.hash_block_size or self.block_size
        if self.block_size % hash_bs:
            raise ConfigError(f"block_size {self.block_size} is not a multiple of hash block size {hash_bs}")
        self._hash_ratio = self.block_size // hash_bs
        self.object_bytes = object_bytes(kv_cache_config)
        self.page_bytes = self.cfg.local.page_bytes or self.object_bytes
        if self.page_bytes != self.object_bytes:
            raise ConfigError(
                f"key 'local.page_bytes'={self.page_bytes}: must equal one block across all "
                f"layers on one rank ({self.object_bytes} bytes) or be unset"
            )
        self.num_pages = self.cfg.local.capacity_bytes // self.page_bytes
        if self.num_pages < 1:
            raise ConfigError(
                f"key 'local.capacity_bytes'={self.cfg.local.capacity_bytes}: holds no block "
                f"of {self.page_bytes} bytes (accepted: >= {self.page_bytes})"
            )
        pc = vllm_config.parallel_config
        self.world_size = pc.tensor_parallel_size * pc.pipeline_parallel_size
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self.fingerprint = layout_fingerprint(
            vllm_config.model_config.model,
            spec,
            self.block_size,
            pc.tensor_parallel_size,
            pc.pipeline_parallel_size,
        )
        self._job_ids = itertools.count(1)
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            self._init_worker()

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache: a dropped save is only a future miss, never lost output."""
        return False

    # ======================================================================= scheduler

    def _init_scheduler(self) -> None:
        self.index = LocalStore(
            self.num_pages * self.page_bytes, self.page_bytes, self.cfg.local.eviction, with_data=False
        )
        self._reqs: dict[str, _RequestState] = {}
        self._jobs: dict[int, _Job] = {}
        self._pending_loads: list[CopyJob] = []
        self._totals: Counter[str] = Counter()
        self._deltas = CounterDeltas()
        # layerwise mode
        engine_id = self._vllm_config.kv_transfer_config.engine_id
        self.steps = StepBuilder(self.block_size, partial_prefix=f"partial:{engine_id}")
        self._saving: dict[str, tuple[WriteHandle, list[str]]] = {}  # block key -> (handle, readers)
        self._save_reports: Counter[str] = Counter()
        self._save_failures: Counter[str] = Counter()
        log.info(
            "%s: local store index with %d pages of %d bytes per rank", NAME, self.num_pages, self.page_bytes
        )

    def _keys(self, request: Request, upto: int) -> list[str]:
        hashes = request.block_hashes
        per_block = [hashes[(i + 1) * self._hash_ratio - 1] for i in range(upto)]
        return block_keys(self.cfg.model_tag, self.fingerprint, 0, per_block)

    def _full_blocks_with_hash(self, request: Request) -> int:
        return len(request.block_hashes) // self._hash_ratio

    def _state(self, request: Request) -> _RequestState:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _RequestState(request=request)
        return st

    def _release_load_pin(self, st: _RequestState) -> None:
        if st.load_pin is not None:
            self.index.unpin(st.load_pin)
            st.load_pin = None
            st.load_range = (0, 0)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._state(request)
        self._release_load_pin(st)  # asked again (e.g. allocation failed last time)
        # vLLM must compute at least the last prompt token itself.
        max_blocks = min((request.num_tokens - 1) // self.block_size, self._full_blocks_with_hash(request))
        first = num_computed_tokens // self.block_size
        if max_blocks - first < self.cfg.min_load_blocks:
            return 0, False
        keys = self._keys(request, max_blocks)
        hit = self.index.lookup_prefix(keys)
        if hit - first < self.cfg.min_load_blocks:
            return 0, False
        pin = self.index.pin(keys[first:hit])
        if pin is None:  # cannot happen single-threaded; stay safe
            return 0, False
        st.load_pin, st.load_range = pin, (first, hit)
        return (hit - first) * self.block_size, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        st = self._state(request)
        if num_external_tokens == 0 or st.load_pin is None:
            self._release_load_pin(st)
            return
        first, last = st.load_range
        if self.layerwise and (last - first) * self.block_size == num_external_tokens:
            # the pipeline loads these per layer; the pin is held until the request ends
            st.hit_keys = st.load_pin.keys
            st.pins.append(st.load_pin)
            st.load_pin = None
            st.loaded_blocks += last - first
            self._totals["loaded_blocks"] += last - first
            return
        if (last - first) * self.block_size != num_external_tokens:
            log.warning("%s: scheduler accepted %d external tokens, expected %d; not loading",
                        NAME, num_external_tokens, (last - first) * self.block_size)
            self._release_load_pin(st)
            return
        block_ids = blocks.get_block_ids()[0]
        pin = st.load_pin
        pages = tuple(self.index.pages(k)[0] for k in pin.keys)
        job = CopyJob(next(self._job_ids), tuple(block_ids[first:last]), pages)
        self._jobs[job.job_id] = _Job(kind="load", req_id=request.request_id, pin=pin)
        self._pending_loads.append(job)
        st.load_pin = None  # owned by the job now; released when every rank reported
        st.loaded_blocks += last - first
        self._totals["loaded_blocks"] += last - first
        st.saved_upto = max(st.saved_upto, last)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self.layerwise:
            return self._build_layerwise_meta(scheduler_output)
        self.index.take_freed()  # whole-prefix workers address pages only through jobs
        meta = StoreConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        computed: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            computed[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, n in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            computed[req_id] = n
        for req_id, before in computed.items():
            st = self._reqs.get(req_id)
            if st is None:
                continue
            after = before + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            full = min(after // self.block_size, self._full_blocks_with_hash(st.request))
            if full > st.saved_upto:
                job = self._plan_save(st, full)
                if job is not None:
                    meta.saves.append(job)
        return meta

    def _plan_save(self, st: _RequestState, full: int) -> CopyJob | None:
        first = st.saved_upto
        st.saved_upto = full
        keys = self._keys(st.request, full)[first:]
        handles = self.index.allocate(keys, [self.page_bytes] * len(keys))
        if handles is None:
            st.skipped_blocks += len(keys)
            self._totals["skipped_blocks"] += len(keys)
            return None
        assert self._kv_cache_manager is not None, "vLLM did not bind the KV cache manager"
        block_ids = self._kv_cache_manager.get_block_ids(st.request.request_id)[0]
        ids, pages, owned = [], [], []
        for i, h in enumerate(handles):
            if h is None:
                st.duplicate_blocks += 1
                self._totals["duplicate_blocks"] += 1
                continue
            ids.append(block_ids[first + i])
            pages.append(self.index.pages(h.key)[0])
            owned.append(h)
        if not owned:
            return None
        st.saved_blocks += len(owned)
        self._totals["saved_blocks"] += len(owned)
        job = CopyJob(next(self._job_ids), tuple(ids), tuple(pages))
        self._jobs[job.job_id] = _Job(kind="save", req_id=st.request.request_id, handles=owned)
        return job

    # ----------------------------------------------------------------- layerwise

    def _full_key_fn(self, request: Request) -> Any:
        n = self._full_blocks_with_hash(request)
        keys = self._keys(request, n)
        return lambda i: keys[i] if i < n else None

    def _build_layerwise_meta(self, scheduler_output: SchedulerOutput) -> LayerwiseMetadata:
        # start_load_kv must run before the forward: the pipeline owns and fills the
        # first layer's slot there (vLLM otherwise starts loads after the forward).
        scheduler_output.has_sync_kv_loads = True
        steps = self.steps
        ios: list[tuple[str, StepIO]] = []
        n_sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            steps.begin(new.req_id, new.block_ids[0], st.hit_keys)
            steps.schedule(new.req_id, new.num_computed_tokens, n_sched[new.req_id], self._full_key_fn(st.request))
            ios.append((new.req_id, steps.build()))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids or rid not in steps:
                assert self._kv_cache_manager is not None
                steps.begin(rid, self._kv_cache_manager.get_block_ids(rid)[0], st.hit_keys)
            elif new_ids is not None:
                steps.add_blocks(rid, new_ids[0])
            steps.schedule(rid, cached.num_computed_tokens[i], n_sched[rid], self._full_key_fn(st.request))
            ios.append((rid, steps.build()))
        save_blocks: list[str] = []
        for rid, io in ios:
            st = self._reqs[rid]
            for ref in io.save:
                key = ref.key
                if key.startswith(steps.partial_prefix):
                    st.private_keys.append(key)
                if key in self._saving:  # another request stores the same block this step
                    self._saving[key][1].append(rid)
                    st.duplicate_blocks += 1
                    self._totals["duplicate_blocks"] += 1
                    continue
                if self.index.is_committed(key):  # stored earlier: read it back, pinned
                    pin = self.index.pin([key])
                    if pin is not None:
                        st.pins.append(pin)
                    st.duplicate_blocks += 1
                    self._totals["duplicate_blocks"] += 1
                    continue
                handles = self.index.allocate([key], [self.page_bytes])
                if not handles or handles[0] is None:
                    # full store: not saved; a later step needing it reports a load error
                    st.skipped_blocks += 1
                    self._totals["skipped_blocks"] += 1
                    continue
                self._saving[key] = (handles[0], [rid])
                save_blocks.append(key)
                st.saved_blocks += 1
                self._totals["saved_blocks"] += 1
        io = StepIO(
            load=tuple(r for _, x in ios for r in x.load),
            load_shared=tuple(r for _, x in ios for r in x.load_shared),
            save=tuple(r for _, x in ios for r in x.save),
        )
        pages: dict[str, int] = {}
        for ref in (*io.load, *io.load_shared, *io.save):
            if ref.key not in pages and self.index.has(ref.key):
                # a key without a page (store was full) makes the worker report a load error
                pages[ref.key] = self.index.pages(ref.key)[0]
        return LayerwiseMetadata(io=io, pages=pages, save_blocks=save_blocks, freed=self.index.take_freed())

    def _account_layerwise_save(self, key: str) -> None:
        done, failed = self._save_reports[key], self._save_failures[key]
        if done + failed < self.world_size:
            return
        del self._save_reports[key]
        self._save_failures.pop(key, None)
        handle, readers = self._saving.pop(key)
        if failed:
            self._totals["save_failed_jobs"] += 1
            self.index.abort([handle])
            return
        self.index.commit([handle])
        alive = [self._reqs[r] for r in readers if r in self._reqs]
        for st in alive:  # they read it back in later steps: keep it resident
            pin = self.index.pin([key])
            if pin is not None:
                st.pins.append(pin)
        if not alive and key.startswith(self.steps.partial_prefix):
            self.index.discard([key])

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, StoreWorkerMetadata):
            return
        if self.layerwise:
            for key, n in meta.done.items():
                if key in self._saving:
                    self._save_reports[key] += n
            for key, n in meta.failed.items():
                if key in self._saving:
                    self._save_failures[key] += n
            for key in set(meta.done) | set(meta.failed):
                if key in self._saving:
                    self._account_layerwise_save(key)
            return
        for job_id, n in meta.done.items():
            self._account(job_id, done=n)
        for job_id, n in meta.failed.items():
            self._account(job_id, failed=n)

    def _account(self, job_id: int, done: int = 0, failed: int = 0) -> None:
        job = self._jobs.get(job_id)
        if job is None:
            log.warning("%s: completion for unknown job %d ignored", NAME, job_id)
            return
        job.done += done
        job.failed += failed
        if job.done + job.failed < self.world_size:
            return
        del self._jobs[job_id]
        if job.failed:
            self._totals[f"{job.kind}_failed_jobs"] += 1
        if job.kind == "save":
            if job.failed:
                self.index.abort(job.handles)
            else:
                self.index.commit(job.handles)
        elif job.pin is not None:
            self.index.unpin(job.pin)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        self._release_load_pin(st)
        if self.layerwise:
            self.steps.end(request.request_id)
            for pin in st.pins:
                self.index.unpin(pin)
            st.pins.clear()
            # its partial-block objects can never be hit again: free them now
            self.index.discard([k for k in st.private_keys if k not in self._saving])
        stats: dict[str, Any] = {
            "loaded_blocks": st.loaded_blocks,
            "saved_blocks": st.saved_blocks,
            "skipped_blocks": st.skipped_blocks,
            "duplicate_blocks": st.duplicate_blocks,
        }
        g = self.index.stats()
        stats["store"] = {
            "stored_objects": g.stored_objects,
            "pinned_objects": g.pinned_objects,
            "pending_objects": g.pending_objects,
            "free_pages": g.free_pages,
            "total_pages": g.total_pages,
            "skipped_stores": g.skipped_stores,
            "evicted_objects": g.evicted_objects,
        }
        log.debug("%s: request %s finished: %s", NAME, request.request_id, stats)
        return False, {"ascend_store": stats}

    def get_kv_connector_stats(self) -> StoreConnectorStats | None:
        """Counter deltas since the last call (scheduler: store; workers: layerwise pipeline)."""
        if self.role != KVConnectorRole.SCHEDULER:
            if self.pipeline is None:
                return None
            p, g = self.pipeline.stats(), self.pipeline.gate.stats()
            return self._worker_deltas.take({
                "layerwise_blocks_loaded": p.blocks_loaded,
                "layerwise_blocks_saved": p.blocks_saved,
                "layerwise_load_errors": p.load_errors,
                "layerwise_gate_waits": g.waits,
                "layerwise_gate_queued_waits": g.queued_waits,
                "layerwise_gate_timeouts": g.timeouts,
                "layerwise_native_copies": p.native_jobs,
            })
        g = self.index.stats()
        totals = dict(self._totals)
        totals.update(
            lookups=g.lookups, hit_objects=g.hit_objects, miss_objects=g.miss_objects,
            evicted_objects=g.evicted_objects,
        )
        return self._deltas.take(totals)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> StoreConnectorStats | None:
        return StoreConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> StorePromMetrics:
        return StorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ======================================================================= worker

    def _init_worker(self) -> None:
        self.pool: WorkerPagePool | None = None
        self.page_store: ScheduledPageStore | None = None
        self.pipeline: LayerwisePipeline | None = None
        self._done: Counter[Any] = Counter()
        self._failed: Counter[Any] = Counter()
        self._load_errors: set[int] = set()
        self._worker_deltas = CounterDeltas()

    def _register_layerwise(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from ascend_offload.layerwise.layout import plan_for_engine

        plan = plan_for_engine(self._vllm_config, self._kv_cache_config)
        if plan is None:
            raise ConfigError(f"{NAME}: use_layerwise is set but no layer plan could be built")
        num_blocks = self._kv_cache_config.num_blocks
        first = kv_caches[plan.layers[0]]
        dim = block_dim(first, num_blocks)
        layer_bytes = {
            name: kv_caches[name].numel() // num_blocks * kv_caches[name].element_size()
            for name in plan.layers
        }
        self.page_store = ScheduledPageStore(layer_bytes, self.num_pages)
        self.pipeline = LayerwisePipeline(
            plan,
            self.page_store,
            prefetch_layers=self.cfg.layerwise_prefetch_layers,
            load_timeout_s=self.cfg.load_timeout_s,
            save_timeout_s=self.cfg.save_timeout_s,
            save_delay_s=self.cfg.debug_save_delay_s,
            block_dim=dim,
        )
        self.pipeline.register_kv_caches(kv_caches)
        log.info(
            "%s: layerwise, %d layers on %d physical buffers (aliased=%s), %d host pages",
            NAME, plan.num_logical, plan.num_physical, self.pipeline.aliased, self.num_pages,
        )

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.layerwise:
            self._register_layerwise(kv_caches)
            return
        self.pool = WorkerPagePool(
            kv_caches,
            num_blocks=self._kv_cache_config.num_blocks,
            num_pages=self.num_pages,
            expected_page_bytes=self.page_bytes,
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, LayerwiseMetadata):
            assert self.page_store is not None and self.pipeline is not None
            self.page_store.set_step(meta.pages, meta.save_blocks, meta.freed)
            self.pipeline.start_step(meta.io)
            return
        assert isinstance(meta, StoreConnectorMetadata)
        if not meta.loads:
            return
        assert self.pool is not None
        for job in meta.loads:
            try:
                self.pool.load(job.pages, job.block_ids)
                self._done[job.job_id] += 1
            except Exception:
                log.exception("%s: load job %d failed; reporting %d blocks", NAME, job.job_id, len(job.block_ids))
                self._load_errors.update(job.block_ids)
                self._failed[job.job_id] += 1

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.pipeline is not None and self.pipeline.in_step:
            self.pipeline.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if self.pipeline is not None and self.pipeline.in_step:
            self.pipeline.save_layer(layer_name)

    def wait_for_save(self) -> None:
        """Copy this step's new full blocks out before the step ends, so a block freed
        by this step is never read after vLLM may reuse it."""
        if self.pipeline is not None:
            if self.pipeline.in_step:
                self.pipeline.finish_step()  # drains the step's saves (blocks may be re-zeroed next)
                assert self.page_store is not None
                done, failed = self.page_store.take_results()
                self._done.update(done)
                self._failed.update(failed)
            return
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, StoreConnectorMetadata)
        if not meta.saves:
            return
        assert self.pool is not None
        for job in meta.saves:
            try:
                self.pool.save(job.block_ids, job.pages)
                self._done[job.job_id] += 1
            except Exception:
                log.exception("%s: save job %d failed; objects aborted", NAME, job.job_id)
                self._failed[job.job_id] += 1

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._done and not self._failed:
            return None
        meta = StoreWorkerMetadata(done=self._done, failed=self._failed)
        self._done, self._failed = Counter(), Counter()
        return meta

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        if self.pipeline is not None:
            errors |= self.pipeline.take_load_errors()
        return errors

    def shutdown(self) -> None:
        if self._role == KVConnectorRole.WORKER and self.pipeline is not None:
            self.pipeline.close()

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Per-layer hooks cannot be captured in full CUDA/NPU graphs."""
        return bool((extra_config or {}).get("use_layerwise", False))
