"""The store connector's worker role: each rank holds the *bytes* of its own shard.

A rank copies blocks by the page numbers the scheduler chose and reports each
copy done or failed (``StoreWorkerMetadata``); it knows nothing about requests.
One class per mode:

* :class:`PrefixWorker` - a host page pool mirroring the paged KV cache; copy
  jobs run before the forward (loads) and after it (saves);
* :class:`LayerwiseWorker` - the layerwise pipeline loads and saves each layer
  around its attention, on layer buffers that several layers may share.

With backend ``mooncake`` or ``memcache`` both modes register their page planes with
a client of that store (``RemotePages``, store/shared/tier.py): before the step's
loads a rank fetches the blocks the scheduler asked for into the pages it reserved,
and after a block's pages are written the rank publishes them, when the scheduler
saw the service up.
"""

from __future__ import annotations

import abc
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ascend_offload.config import ConfigError
from ascend_offload.connectors.metrics import CounterDeltas, StoreConnectorStats
from ascend_offload.connectors.store.metadata import (
    CopyJob,
    FetchJob,
    LayerwiseMetadata,
    StoreConnectorMetadata,
    StoreWorkerMetadata,
)
from ascend_offload.connectors.store.settings import NAME, StoreSettings
from ascend_offload.kv_layout import block_dim
from ascend_offload.layerwise.pipeline import LayerwisePipeline
from ascend_offload.store.pages.scheduled_store import ScheduledPageStore
from ascend_offload.store.pages.worker_pool import WorkerPagePool

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from ascend_offload.connectors.store.ssd import SsdWorker
    from ascend_offload.store.shared.tier import RemotePages

log = logging.getLogger(__name__)


def _device_id() -> int:
    """This rank's accelerator on its host (a Memcache client contributes its HBM)."""
    from vllm.distributed.parallel_state import get_world_group

    return int(get_world_group().local_rank)


def _worker_rank() -> int:
    """This rank's index among the ranks that each hold a shard of every object."""
    from vllm.distributed.parallel_state import (
        get_pp_group,
        get_tensor_model_parallel_rank,
        get_tp_group,
    )

    return get_pp_group().rank_in_group * get_tp_group().world_size + get_tensor_model_parallel_rank()


class StoreWorker(abc.ABC):
    """What both modes share: completions counted per step, sent as worker metadata."""

    #: the layerwise pipeline (layerwise mode, after ``register_kv_caches``), else None
    pipeline: LayerwisePipeline | None = None

    def __init__(self, settings: StoreSettings, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
        self.settings = settings
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._done: Counter[Any] = Counter()
        self._failed: Counter[Any] = Counter()
        self._fetched: Counter[int] = Counter()
        self._fetch_failed: Counter[int] = Counter()
        self._fetch_unsafe: Counter[int] = Counter()
        # shared tier calls past their deadline: save job id / block keys held, their
        # releases, and releases of late gets (see StoreWorkerMetadata)
        self._save_held: Counter[Any] = Counter()
        self._save_released: Counter[Any] = Counter()
        self._fetch_released: Counter[int] = Counter()
        self._late: dict[Any, tuple[str, tuple[Any, ...]]] = {}  # token -> (kind, what it holds)
        self._late_ids = 0
        #: the shared tier's client (backend mooncake / memcache, after ``register_kv_caches``)
        self.remote: RemotePages | None = None
        self._remote_deltas = CounterDeltas(StoreConnectorStats)
        #: the SSD tier's file and writer (local.ssd, whole-prefix mode, after ``register_kv_caches``)
        self.ssd: SsdWorker | None = None
        self._epoch = 0  # the store epoch of the step being run (echoed in the reports)

    def _connect_shared_tier(self, planes: Mapping[str, torch.Tensor]) -> None:
        """Backend ``mooncake`` / ``memcache``: register this rank's page planes with a
        client of the shared store."""
        if not self.settings.shared_tier:
            return
        from ascend_offload.store.shared.backends import shared_tier_pages

        self.remote = shared_tier_pages(self.settings.cfg, planes, _worker_rank(),
                                        device_id=_device_id() if self.settings.cfg.backend == "memcache" else 0)
        log.info("%s: rank %d publishes to and fetches from the %s", NAME, self.remote.rank,
                 self.remote.service)

    def _run_jobs(self, jobs: Iterable[CopyJob], run: Callable[[CopyJob], None], what: str,
                  on_failure: Callable[[CopyJob], None] | None = None) -> None:
        """Run each copy job; count it done, or failed (logged, ``on_failure``)."""
        for job in jobs:
            try:
                run(job)
                self._done[job.job_id] += 1
            except Exception:
                log.exception("%s: %s job %d failed (%d blocks)", NAME, what, job.job_id, len(job.block_ids))
                if on_failure is not None:
                    on_failure(job)
                self._failed[job.job_id] += 1

    def _run_fetches(self, fetches: Iterable[FetchJob]) -> list[FetchJob]:
        """Fetch the shared tier's blocks into the reserved pages; the jobs that arrived whole."""
        ok: list[FetchJob] = []
        for job in fetches:
            if self.remote is None:  # never set up: the scheduler aborts it
                self._fetch_failed[job.job_id] += 1
                continue
            token = self._late_token("fetch", (job.job_id,))
            whole, reusable = self.remote.fetch(job.keys, job.pages, token)
            if reusable:
                self._late.pop(token, None)  # no transfer outlives it
            if whole:
                self._fetched[job.job_id] += 1
                ok.append(job)
            else:
                self._fetch_failed[job.job_id] += 1
                if not reusable:
                    self._fetch_unsafe[job.job_id] += 1
        return ok

    def _publish(self, keys: Iterable[str], pages: Iterable[int], held: tuple[Any, ...]) -> None:
        """Publish blocks whose every layer is in ``pages`` (synchronous: the page may be
        reused once this step's report reached the scheduler). A put past its deadline
        may still read the pages: ``held`` (the save job id, or the block keys) is reported
        held with this step's completions, and released once the put really ended; the
        scheduler keeps the saves' pages out of use meanwhile (no copy is made)."""
        if self.remote is None:
            return
        token = self._late_token("save", held)
        if self.remote.publish(list(keys), list(pages), token):
            self._late.pop(token, None)
        else:
            self._save_held.update(held)

    def _late_token(self, kind: str, what: tuple[Any, ...]) -> int:
        """A token for a shared-tier call whose end may come after its deadline."""
        self._late_ids += 1
        self._late[self._late_ids] = (kind, what)
        return self._late_ids

    def _take_late_ends(self) -> None:
        """Shared-tier calls past their deadline that have ended: release what they held."""
        if self.remote is None:
            return
        for token in self.remote.take_ended():
            kind, what = self._late.pop(token, ("", ()))
            if kind == "save":
                self._save_released.update(what)
            elif kind == "fetch":
                self._fetch_released.update(what)

    def _remote_stats(self, totals: dict[str, int] | None = None,
                      gauges: dict[str, int] | None = None) -> StoreConnectorStats | None:
        """Counter deltas of ``totals`` plus the shared tier's publish / fetch totals."""
        totals = dict(totals or {})
        if self.remote is not None:
            c = self.remote.counts
            totals.update(remote_published_blocks=c.published_blocks,
                          remote_publish_duplicates=c.publish_duplicates,
                          remote_publish_skipped=c.publish_skipped,
                          remote_worker_fetched_blocks=c.fetched_blocks,
                          remote_worker_fetch_failed_blocks=c.fetch_failed_blocks,
                          remote_worker_fetch_corrupt_blocks=c.fetch_corrupt_blocks,
                          remote_worker_late_calls=c.late_calls,
                          remote_worker_outages=self.remote.health.outages,
                          remote_worker_retries=self.remote.health.retries)
        return self._remote_deltas.take(totals, gauges)

    def handle_preemptions(self, meta: KVConnectorMetadata) -> None:
        """vLLM calls this at the start of every ``execute_model``, before the step's
        state update and forward, so before any block the scheduler freed (a preempted
        request's, a finished one's) can be overwritten. The fence: no save of an earlier
        step may still be reading device blocks now. Whole-prefix saves (and shared-tier
        publishes, which read host pages) are synchronous in ``wait_for_save``, device
        copies ending with ``device.synchronize()``, so none can be; the layerwise
        pipeline's copies run on a queue and are drained here."""
        self._epoch = getattr(meta, "epoch", self._epoch)
        self._fence_saves()

    def _fence_saves(self) -> None:  # noqa: B027 - optional hook
        """Wait for every save copy a previous step left running (deadline)."""

    @abc.abstractmethod
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take this rank's KV tensors and allocate its host pages."""

    @abc.abstractmethod
    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """Before the forward."""

    def wait_for_layer_load(self, layer_name: str) -> None:  # noqa: B027 - optional hook
        """Before a layer's attention."""

    def save_kv_layer(self, layer_name: str) -> None:  # noqa: B027 - optional hook
        """After a layer's attention."""

    @abc.abstractmethod
    def wait_for_save(self, meta: KVConnectorMetadata | None) -> None:
        """At the end of the step (``meta`` is None when the step carried none)."""

    def build_worker_meta(self) -> StoreWorkerMetadata | None:
        """This step's completions; None when there are none."""
        self._take_late_ends()
        meta = StoreWorkerMetadata(done=self._done, failed=self._failed, fetched=self._fetched,
                                   fetch_failed=self._fetch_failed, fetch_unsafe=self._fetch_unsafe,
                                   save_held=self._save_held, save_released=self._save_released,
                                   fetch_released=self._fetch_released, epoch=self._epoch,
                                   **(self.ssd.take_report() if self.ssd is not None else {}))
        if meta.empty():
            return None
        self._done, self._failed = Counter(), Counter()
        self._fetched, self._fetch_failed, self._fetch_unsafe = Counter(), Counter(), Counter()
        self._save_held, self._save_released, self._fetch_released = Counter(), Counter(), Counter()
        return meta

    @abc.abstractmethod
    def take_load_errors(self) -> set[int]:
        """Block ids whose loads failed since the last call."""

    def stats(self) -> StoreConnectorStats | None:
        """Counter deltas since the last call; None when nothing moved."""
        return self._remote_stats()

    def close(self) -> None:
        """Release threads and native resources."""
        if self.remote is not None:
            self.remote.close()
            self.remote = None
        if self.ssd is not None:
            self.ssd.close()
            self.ssd = None


class PrefixWorker(StoreWorker):
    """Whole-prefix mode: copy jobs against a :class:`WorkerPagePool`."""

    def __init__(self, settings: StoreSettings, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(settings, vllm_config, kv_cache_config)
        self.pool: WorkerPagePool | None = None
        self._load_errors: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.pool = WorkerPagePool(
            kv_caches,
            num_blocks=self._kv_cache_config.num_blocks,
            num_pages=self.settings.num_pages,
            expected_page_bytes=self.settings.page_bytes,
        )
        self._connect_shared_tier(self.pool.planes)
        if self.settings.ssd_tier:
            from ascend_offload.connectors.store.ssd import SsdWorker

            self.ssd = SsdWorker(self.settings, self.pool.planes, _worker_rank())

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """Fetch the shared tier's blocks into their pages, then load the accepted
        prefixes from the pages into vLLM's blocks."""
        assert isinstance(meta, StoreConnectorMetadata)
        self._epoch = meta.epoch
        self._run_fetches(meta.fetches)
        if self.ssd is not None:
            self.ssd.submit_spills(meta.ssd_spills)  # behind, on the writer thread
            self.ssd.run_promotes(meta.ssd_promotes)  # verified, before the loads
        if not meta.loads:
            return
        pool = self.pool
        assert pool is not None
        self._run_jobs(meta.loads, lambda job: pool.load(job.pages, job.block_ids), "load",
                       on_failure=lambda job: self._load_errors.update(job.block_ids))

    def wait_for_save(self, meta: KVConnectorMetadata | None) -> None:
        """Copy this step's new full blocks out before the step ends, so a block freed
        by this step is never read after vLLM may reuse it; then publish them."""
        if meta is None:
            return
        assert isinstance(meta, StoreConnectorMetadata)
        if not meta.saves:
            return
        pool = self.pool
        assert pool is not None

        def save(job: CopyJob) -> None:
            pool.save(job.block_ids, job.pages)  # synchronous: the blocks are read when it returns
            if meta.publish:
                self._publish(job.keys, job.pages, (job.job_id,))

        self._run_jobs(meta.saves, save, "save")

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors


class LayerwiseWorker(StoreWorker):
    """Layerwise mode: a :class:`LayerwisePipeline` over a :class:`ScheduledPageStore`."""

    def __init__(self, settings: StoreSettings, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(settings, vllm_config, kv_cache_config)
        self.page_store: ScheduledPageStore | None = None
        self._publish_full = False  # this step's saved full blocks go to the shared tier

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from ascend_offload.connectors.kv_layout_hook import plan_for_engine

        plan = plan_for_engine(self._vllm_config, self._kv_cache_config)
        if plan is None:
            raise ConfigError(f"{NAME}: use_layerwise is set but no layer plan could be built")
        num_blocks = self._kv_cache_config.num_blocks
        cfg, num_pages = self.settings.cfg, self.settings.num_pages
        # Indexer caches (plan.followers) are stored with their main layer's block: one
        # host plane each, at the page of the block, so an object holds both.
        layer_bytes = {
            name: kv_caches[name].numel() // num_blocks * kv_caches[name].element_size()
            for name in (*plan.layers, *plan.followers)
        }
        self.page_store = ScheduledPageStore(layer_bytes, num_pages)
        self.pipeline = LayerwisePipeline(
            plan,
            self.page_store,
            prefetch_layers=cfg.layerwise_prefetch_layers,
            load_timeout_s=cfg.load_timeout_s,
            save_timeout_s=cfg.save_timeout_s,
            save_delay_s=cfg.debug.save_delay_s,
            fail_loads=cfg.debug.fail_layer_loads,
            block_dim=block_dim(kv_caches[plan.layers[0]], num_blocks),
        )
        self.pipeline.register_kv_caches(kv_caches)
        self._connect_shared_tier(self.page_store.planes)
        log.info(
            "%s: layerwise, %d layers on %d physical buffers (aliased=%s), %d host pages",
            NAME, plan.num_logical, plan.num_physical, self.pipeline.aliased, num_pages,
        )

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        assert isinstance(meta, LayerwiseMetadata)
        assert self.page_store is not None and self.pipeline is not None
        self._epoch = meta.epoch
        self.page_store.set_step(meta.pages, meta.save_blocks, meta.freed)
        fetched = self._run_fetches(meta.fetches)
        if fetched:
            self.page_store.mark_filled({k: p for job in fetched for k, p in zip(job.keys, job.pages, strict=True)})
        self._publish_full = meta.publish
        self.pipeline.start_step(meta.io)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.pipeline is not None and self.pipeline.in_step:
            self.pipeline.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str) -> None:
        if self.pipeline is not None and self.pipeline.in_step:
            self.pipeline.save_layer(layer_name)

    def wait_for_save(self, meta: KVConnectorMetadata | None) -> None:
        """Drain the step's saves before it ends (its blocks may be re-zeroed next) and
        collect which blocks this rank wrote or failed."""
        if self.pipeline is None or not self.pipeline.in_step:
            return
        self.pipeline.finish_step()
        store = self.page_store
        assert store is not None
        done, failed = store.take_results()
        if self._publish_full and self.remote is not None:
            full = [k for k in done if not k.startswith(self.settings.partial_prefix)]
            pages = [store.committed_page(k) for k in full]
            keys = [k for k, p in zip(full, pages, strict=True) if p is not None]
            self._publish(keys, [p for p in pages if p is not None], tuple(keys))
        self._done.update(done)
        self._failed.update(failed)

    def _fence_saves(self) -> None:
        """``wait_for_save`` drains the step's saves with a deadline; one that ran past
        it raised there and may still be copying on the queue. Wait for it here, before
        this step can overwrite the blocks it reads."""
        if self.pipeline is None or self.pipeline.in_step:
            return
        try:
            self.pipeline.drain()
        except TimeoutError:
            log.error("%s: store saves of an earlier step still running at the next step's start "
                      "(save_timeout_s passed twice)", NAME)

    def take_load_errors(self) -> set[int]:
        return self.pipeline.take_load_errors() if self.pipeline is not None else set()

    def stats(self) -> StoreConnectorStats | None:
        if self.pipeline is None:
            return None
        p, g = self.pipeline.stats(), self.pipeline.gate.stats()
        return self._remote_stats({
            "layerwise_blocks_loaded": p.blocks_loaded,
            "layerwise_blocks_saved": p.blocks_saved,
            "layerwise_load_errors": p.load_errors,
            "layerwise_saves_dropped": p.save_dropped,
            "layerwise_gate_waits": g.waits,
            "layerwise_gate_queued_waits": g.queued_waits,
            "layerwise_gate_timeouts": g.timeouts,
            "layerwise_native_copies": p.native_jobs,
        }, {"layerwise_gate_consumers_held": self.pipeline.gate.consumers_held()})

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()
        super().close()
