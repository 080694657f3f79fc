"""``AscendStoreConnector``: vLLM adapter for the host KV store tier.

Whole-prefix mode (``use_layerwise: false``): full blocks are saved to the store
after the step that computed them and the longest committed prefix of a new
request is loaded before its first forward. Layerwise mode: each layer's blocks
are loaded before and saved after its attention, on layer buffers that several
layers may share.

Split of responsibilities (the shape of vLLM's offloading connector): this class
is a facade that hands each vLLM call to one object per role,

* the scheduler role (``scheduler.py``) owns the store *index*: lookups, page
  allocation, commit/abort, pins and eviction - so decisions are made in one
  place and never race;
* each worker rank (``worker.py``) owns the *bytes* of its own shard in a host
  page pool and copies blocks by the page numbers the scheduler chose - workers
  know nothing about requests;
* completions travel back as worker metadata (``metadata.py``), summed across
  ranks; an object is committed (or a load pin released) only when every rank
  reported.

Backend ``mooncake`` keeps this split and adds the shared Mooncake Store behind the
local pages: the scheduler asks the master for prefixes the local index lacks and
has the ranks fetch them into local pages first; the ranks publish saved blocks
from their pages (``store/shared/mooncake.py``, ``store/shared/remote_fetch.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from ascend_offload.connectors.logging_setup import wire_logging
from ascend_offload.connectors.metrics import (
    ConnectorMetrics,
    StoreConnectorStats,
    StorePromMetrics,
)
from ascend_offload.connectors.store.scheduler import (
    LayerwiseScheduler,
    PrefixScheduler,
    StoreScheduler,
)
from ascend_offload.connectors.store.settings import StoreSettings
from ascend_offload.connectors.store.worker import LayerwiseWorker, PrefixWorker, StoreWorker
from ascend_offload.layerwise.pipeline import LayerwisePipeline

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class AscendStoreConnector(ConnectorMetrics, KVConnectorBase_V1):
    """Host KV store tier; see the module docstring for the design."""

    STATS = StoreConnectorStats
    PROM = StorePromMetrics

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        # vLLM types kv_cache_config as required but stores it as given; None where an
        # engine builds no KV cache config (role checks, refused configs)
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        wire_logging()
        self.settings = StoreSettings.from_vllm(vllm_config, kv_cache_config)
        assert kv_cache_config is not None  # checked by from_vllm
        self.cfg = self.settings.cfg
        #: layerwise mode (``use_layerwise``); read by ``AscendMultiConnector``
        self.layerwise = self.settings.layerwise
        self.connector_scheduler: StoreScheduler | None = None
        self.connector_worker: StoreWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            sched = LayerwiseScheduler if self.layerwise else PrefixScheduler
            self.connector_scheduler = sched(self.settings, self._block_ids)
        else:
            worker = LayerwiseWorker if self.layerwise else PrefixWorker
            self.connector_worker = worker(self.settings, vllm_config, kv_cache_config)

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache: a dropped save is only a future miss, never lost output."""
        return False

    @property
    def pipeline(self) -> LayerwisePipeline | None:
        """The worker's layerwise pipeline (layerwise mode, after ``register_kv_caches``);
        ``AscendMultiConnector`` wires decode reads into its reuse gate."""
        return self.connector_worker.pipeline if self.connector_worker is not None else None

    @property
    def scheduler(self) -> StoreScheduler:
        assert self.connector_scheduler is not None, "scheduler call on a worker-role connector"
        return self.connector_scheduler

    @property
    def worker(self) -> StoreWorker:
        assert self.connector_worker is not None, "worker call on a scheduler-role connector"
        return self.connector_worker

    def _block_ids(self, req_id: str) -> list[int]:
        assert self._kv_cache_manager is not None, "vLLM did not bind the KV cache manager"
        return self._kv_cache_manager.get_block_ids(req_id)[0]

    # ======================================================================= scheduler

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request)

    def reset_cache(self) -> bool:
        """``LLM.reset_prefix_cache(reset_connector=True)``: forget every stored object
        (scheduler side; the ranks learn the new epoch from the next metadata)."""
        return self.scheduler.reset_cache()

    def get_kv_connector_stats(self) -> StoreConnectorStats | None:
        """Counter deltas since the last call (scheduler: store; workers: layerwise pipeline)."""
        if self.connector_scheduler is not None:
            return self.connector_scheduler.stats()
        return self.worker.stats()


    # ======================================================================= worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Start of every step, before freed blocks can be overwritten: the save fence."""
        self.worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self.worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._get_connector_metadata() if self.has_connector_metadata() else None)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.build_worker_meta()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.close()
        if self.connector_scheduler is not None:
            self.connector_scheduler.close()

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Per-layer hooks cannot be captured in full CUDA/NPU graphs."""
        return bool((extra_config or {}).get("use_layerwise", False))
