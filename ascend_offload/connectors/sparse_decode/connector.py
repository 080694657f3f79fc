"""``AscendSparseDecodeConnector``: sparse decode offload inside one engine.

Colocated (debug) mode of sparse decode offload: the engine prefills and
decodes, and the main KV of every sparse layer lives only in a host pool (the
device keeps the indexer cache and per-layer hot buffers, :mod:`.kv_cut`).
Multi-token rows (prefill chunks) attend over the pool's rows; one-token
(decode) rows over the hot buffers that
:class:`~ascend_offload.sparse.manager.SparseOffloadManager` fills with the
indexer's top-k misses. The attention finds this connector through
``get_kv_transfer_group()`` and calls it as a
:class:`~ascend_offload.sparse.adapter.SparseDecodeAdapter`.

A facade over one object per role: :class:`.scheduler.SparseDecodeScheduler`
(request names, host-pool admission) and :class:`.worker.SparseDecodeWorker`
(the manager over the engine's hot regions).

Off by default: without ``sparse_offload.enabled`` the connector does nothing,
the KV allocation is vLLM's and the model attends exactly as without it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ascend_offload.config import SparseDecodeConfig, parse_extra_config
from ascend_offload.connectors.logging_setup import wire_logging
from ascend_offload.connectors.metrics import ConnectorMetrics
from ascend_offload.connectors.sparse_decode.metrics import (
    SparseDecodeStats,
    SparsePromMetrics,
    StatsReporter,
)
from ascend_offload.connectors.sparse_decode.scheduler import (
    SparseDecodeMetadata,
    SparseDecodeScheduler,
)
from ascend_offload.connectors.sparse_decode.settings import SparseDecodeSettings
from ascend_offload.connectors.sparse_decode.worker import SparseDecodeWorker
from ascend_offload.sparse.adapter import BatchRow, SparseStepPlan

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

NAME = "AscendSparseDecodeConnector"

__all__ = ["NAME", "AscendSparseDecodeConnector", "SparseDecodeMetadata"]


class AscendSparseDecodeConnector(ConnectorMetrics, KVConnectorBase_V1):
    """Colocated sparse decode offload; see the module docstring."""

    STATS = SparseDecodeStats
    PROM = SparsePromMetrics

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        # vLLM types kv_cache_config as required but stores it as given; None where an
        # engine builds no KV cache config (role checks, refused configs)
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        wire_logging()
        tc = vllm_config.kv_transfer_config
        assert tc is not None  # vLLM builds a connector only from a kv_transfer_config
        self.cfg: SparseDecodeConfig = parse_extra_config(NAME, tc.kv_connector_extra_config)
        self.enabled = self.cfg.sparse_offload.enabled
        self.settings: SparseDecodeSettings | None = None
        if self.enabled:  # every role checks, so a bad config fails at startup everywhere
            self.settings = SparseDecodeSettings.from_vllm(vllm_config, self.cfg.sparse_offload,
                                                           kv_cache_config)
        self.scheduler: SparseDecodeScheduler | None = None
        if self.settings is not None and role == KVConnectorRole.SCHEDULER:
            self.scheduler = SparseDecodeScheduler(self.settings, tc)
        self.worker: SparseDecodeWorker | None = None
        self._reporter = StatsReporter()
        self._gauges_version = -1  # the worker's holdings_version of the last gauges reported

    # ======================================================================= scheduler

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        if self.scheduler is None:
            return 0, False
        if not self.scheduler.admit(request):
            return None, False  # its host pool rows are not free yet: wait
        if self.scheduler.hybrid_wait(request, num_computed_tokens):
            return None, False  # resident requests give blocks back at the end of this step
        # a resumed preempted request: its history is in the pool and the stash; a new one
        # with cached prefix blocks: their rows (both loaded before the forward, synchronously)
        resumed = self.scheduler.resume_offer(request, num_computed_tokens)
        return resumed or self.scheduler.prefix_offer(request, num_computed_tokens), False

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        if self.scheduler is not None:
            self.scheduler.bind_block_pool(gpu_block_pool)

    def has_pending_block_frees(self) -> bool:
        """Hybrid residency: blocks borrowed for resident main KV go back at the end of
        this step, so vLLM waits instead of preempting."""
        return self.scheduler is not None and self.scheduler.pending_frees()

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        if self.scheduler is not None:
            self.scheduler.after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self.scheduler is None:
            return SparseDecodeMetadata({}, {}, ())
        if self.scheduler.kv_cache_manager is None:
            self.scheduler.kv_cache_manager = self._kv_cache_manager
        return self.scheduler.build_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler is not None:
            self.scheduler.finished(request.request_id, request, block_ids)
        return False, None

    def reset_cache(self) -> bool | None:
        """vLLM's ``reset_prefix_cache``: the decode-side prefix cache forgets every entry
        (those in use once their requests finish)."""
        if self.scheduler is None or self.scheduler.prefix is None:
            return None
        self.scheduler.reset_prefix()
        return True

    # ======================================================================= worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.settings is None:
            return
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        shared = None
        if get_tensor_model_parallel_world_size() > 1:  # one host pool for all ranks
            pc = self._vllm_config.parallel_config
            tc = self._vllm_config.kv_transfer_config
            assert tc is not None
            shared = f"sd_{tc.engine_id}_dp{pc.data_parallel_rank or 0}"
        self.worker = SparseDecodeWorker(self.settings, kv_caches, shared_pool=shared,
                                         tp_rank=get_tensor_model_parallel_rank())

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Apply the step's metadata as soon as vLLM hands it over, before the forward:
        the hooks after it (every layer's, the adapter's) then find it applied and pay one
        identity check each."""
        super().bind_connector_metadata(connector_metadata)
        self._prepare()

    def _prepare(self) -> SparseDecodeWorker | None:
        """Apply this step's metadata once (finish, admit, request names)."""
        worker, meta = self.worker, self._connector_metadata
        if worker is not None and meta is not None and meta is not worker.applied:
            assert isinstance(meta, SparseDecodeMetadata)
            worker.apply(meta)
        return worker

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the forward reuses the freed blocks: stash preempted requests' indexer rows."""
        if self.worker is not None and isinstance(kv_connector_metadata, SparseDecodeMetadata):
            self.worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._prepare()  # resumed requests' stashes go into their new blocks here

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set() if self.worker is None else self.worker.take_load_errors()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """The first layer's hook applies the step's metadata: vLLM may call
        :meth:`start_load_kv` only after the forward, and a layer writes its new indexer
        rows before its first adapter call, possibly into blocks freed last step whose
        rows this step's orders still copy (a prefix-cache keep, a move)."""
        self._prepare()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        if self._prepare() is not None:  # a step without a forward still finishes and admits
            assert self.worker is not None
            self.worker.end_step()

    def get_kv_connector_stats(self) -> SparseDecodeStats | None:
        if self.worker is None:
            return None
        d, gauges = self.worker.decode, None
        if self.worker.holdings_version != self._gauges_version:  # else none changed
            self._gauges_version = self.worker.holdings_version
            gauges = {**d.gauges(), **self.worker.device_kv_gauges()}
        return self._reporter.take(d.counters(), gauges)

    # ======================================================================= adapter

    def sparse_layer_index(self, layer_name: str) -> int | None:
        return None if self.worker is None else self.worker.decode.sparse_layer_index(layer_name)

    def plan_step(self, rows: Sequence[BatchRow]) -> SparseStepPlan:
        worker = self._prepare()
        assert worker is not None, f"{NAME}: plan_step without an offloaded layer"
        return worker.decode.plan_step(rows)

    # the per-layer data path goes straight to the manager (the bookkeeping object only
    # passes these through): every layer of every step pays each call frame

    def offload_new_kv(self, layer: int, new_kv: torch.Tensor, positions: torch.Tensor) -> None:
        assert self.worker is not None
        self.worker.manager.offload_new_kv(layer, new_kv, positions)

    def onload_topk(self, layer: int, topk: torch.Tensor) -> torch.Tensor:
        assert self.worker is not None
        return self.worker.decode.onload_topk(layer, topk)

    def hot_buffer(self, layer: int) -> torch.Tensor:
        assert self.worker is not None
        return self.worker.decode.hot_buffer(layer)

    def context_rows(self, layer: int, batch_index: int, positions: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.worker is not None
        return self.worker.manager.context_rows(layer, batch_index, positions)
