"""The store connector's worker role: each rank holds the *bytes* of its own shard.

A rank copies blocks by the page numbers the scheduler chose and reports each
copy done or failed (``StoreWorkerMetadata``); it knows nothing about requests.
One class per mode:

* :class:`PrefixWorker` - a host page pool mirroring the paged KV cache; copy
  jobs run before the forward (loads) and after it (saves);
* :class:`LayerwiseWorker` - the layerwise pipeline loads and saves each layer
  around its attention, on layer buffers that several layers may share.
"""

from __future__ import annotations

import abc
import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch

from ascend_offload.config import ConfigError
from ascend_offload.connectors.metrics import CounterDeltas, StoreConnectorStats
from ascend_offload.connectors.store.metadata import (
    LayerwiseMetadata,
    StoreConnectorMetadata,
    StoreWorkerMetadata,
)
from ascend_offload.connectors.store.settings import NAME, StoreSettings
from ascend_offload.kv_layout import block_dim
from ascend_offload.layerwise.pipeline import LayerwisePipeline
from ascend_offload.store.scheduled import ScheduledPageStore
from ascend_offload.store.worker_pool import WorkerPagePool

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)


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
        if not self._done and not self._failed:
            return None
        meta = StoreWorkerMetadata(done=self._done, failed=self._failed)
        self._done, self._failed = Counter(), Counter()
        return meta

    @abc.abstractmethod
    def take_load_errors(self) -> set[int]:
        """Block ids whose loads failed since the last call."""

    def stats(self) -> StoreConnectorStats | None:
        """Counter deltas since the last call; None when the mode has no worker counters."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release threads and native resources."""


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

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
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

    def wait_for_save(self, meta: KVConnectorMetadata | None) -> None:
        """Copy this step's new full blocks out before the step ends, so a block freed
        by this step is never read after vLLM may reuse it."""
        if meta is None:
            return
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

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors


class LayerwiseWorker(StoreWorker):
    """Layerwise mode: a :class:`LayerwisePipeline` over a :class:`ScheduledPageStore`."""

    def __init__(self, settings: StoreSettings, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(settings, vllm_config, kv_cache_config)
        self.page_store: ScheduledPageStore | None = None
        self._deltas = CounterDeltas()

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
            save_delay_s=cfg.debug_save_delay_s,
            fail_loads=cfg.debug_fail_layer_loads,
            block_dim=block_dim(kv_caches[plan.layers[0]], num_blocks),
        )
        self.pipeline.register_kv_caches(kv_caches)
        log.info(
            "%s: layerwise, %d layers on %d physical buffers (aliased=%s), %d host pages",
            NAME, plan.num_logical, plan.num_physical, self.pipeline.aliased, num_pages,
        )

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        assert isinstance(meta, LayerwiseMetadata)
        assert self.page_store is not None and self.pipeline is not None
        self.page_store.set_step(meta.pages, meta.save_blocks, meta.freed)
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
        assert self.page_store is not None
        done, failed = self.page_store.take_results()
        self._done.update(done)
        self._failed.update(failed)

    def take_load_errors(self) -> set[int]:
        return self.pipeline.take_load_errors() if self.pipeline is not None else set()

    def stats(self) -> StoreConnectorStats | None:
        if self.pipeline is None:
            return None
        p, g = self.pipeline.stats(), self.pipeline.gate.stats()
        return self._deltas.take({
            "layerwise_blocks_loaded": p.blocks_loaded,
            "layerwise_blocks_saved": p.blocks_saved,
            "layerwise_load_errors": p.load_errors,
            "layerwise_gate_waits": g.waits,
            "layerwise_gate_queued_waits": g.queued_waits,
            "layerwise_gate_timeouts": g.timeouts,
            "layerwise_native_copies": p.native_jobs,
        }, {"layerwise_gate_consumers_held": self.pipeline.gate.consumers_held()})

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()
