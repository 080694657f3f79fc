"""``SfaRemoteD2HConnector``: the vLLM connector facade of the P/D pull.

vLLM builds one instance per process and role. The scheduler process gets a
:class:`~.scheduler.RemoteD2HScheduler`; a worker rank gets a
:class:`~.decode_worker.DecodeWorker` (``kv_consumer``), a
:class:`~.prefill_worker.PrefillWorker` (``kv_producer``) or both
(``kv_both``), so a process carries only its own role's state. This class only
dispatches vLLM's hooks to them and applies each step's metadata once.
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

from ascend_offload.config import RemoteD2HConfig
from ascend_offload.connectors.logging_setup import wire_logging
from ascend_offload.connectors.metrics import (
    ConnectorMetrics,
    CounterDeltas,
    RD2HConnectorStats,
    RD2HPromMetrics,
)
from ascend_offload.connectors.remote_d2h.decode_worker import DecodeWorker
from ascend_offload.connectors.remote_d2h.kv_region import (
    KVRegion,
    indexer_layers,
    open_kv_region,
    open_region,
    pair_layers,
)
from ascend_offload.connectors.remote_d2h.metadata import RemoteD2HMetadata
from ascend_offload.connectors.remote_d2h.prefill_worker import PrefillWorker
from ascend_offload.connectors.remote_d2h.scheduler import RemoteD2HScheduler
from ascend_offload.connectors.remote_d2h.settings import NAME, build_settings, parse_config
from ascend_offload.connectors.sparse_decode.settings import SparseDecodeSettings
from ascend_offload.pd.slot_sharing import SlotSharing
from ascend_offload.sparse.adapter import BatchRow, SparseStepPlan

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from ascend_offload.sparse.colocated import ColocatedSparseDecode

log = logging.getLogger(__name__)


class SfaRemoteD2HConnector(ConnectorMetrics, KVConnectorBase_V1):
    """P/D pull connector; see the package docstring."""

    STATS = RD2HConnectorStats
    PROM = RD2HPromMetrics

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
        self.cfg: RemoteD2HConfig = parse_config(vllm_config)
        self.settings = build_settings(vllm_config, self.cfg)
        # Checked in every role, so a bad sparse config fails at startup, scheduler included.
        self.sparse_settings: SparseDecodeSettings | None = None
        if self.settings.sparse and self.settings.is_consumer:
            self.sparse_settings = SparseDecodeSettings.from_vllm(
                vllm_config, self.cfg.sparse_offload, kv_cache_config
            )
        self.is_producer = self.settings.is_producer
        self.is_consumer = self.settings.is_consumer
        self.scheduler: RemoteD2HScheduler | None = None
        self.decode: DecodeWorker | None = None
        self.prefill: PrefillWorker | None = None
        self._region: KVRegion | None = None
        self._prepared: KVConnectorMetadata | None = None
        self._deltas = CounterDeltas(RD2HConnectorStats)
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = RemoteD2HScheduler(
                self.settings, self.sparse_settings, vllm_config.kv_transfer_config
            )
            return
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        tp_rank = get_tensor_model_parallel_rank()
        if self.is_consumer:
            self.decode = DecodeWorker(self.settings, tp_rank, sparse=self.sparse_settings)
        if self.is_producer:
            self.prefill = PrefillWorker(self.settings, tp_rank, prepare=self._prepare)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # save_kv_layer must run between layers

    # ======================================================================= scheduler

    def _sched(self) -> RemoteD2HScheduler:
        assert self.scheduler is not None, f"{NAME}: scheduler hook called on a worker"
        return self.scheduler

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._sched().kv_cache_manager = kv_cache_manager

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        """Called by vLLM's ``bind_kv_cache_manager`` (ours calls the base class's): hybrid
        residency on a sparse decode borrows from this pool."""
        if self.scheduler is not None:
            self.scheduler.bind_block_pool(gpu_block_pool)

    def has_pending_block_frees(self) -> bool:
        """Hybrid residency: blocks borrowed for resident main KV go back at the end of
        this step, so vLLM waits instead of preempting."""
        return self.scheduler is not None and self.scheduler.has_pending_block_frees()

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().update_connector_output(connector_output)

    def reset_cache(self) -> bool | None:
        """vLLM's ``reset_prefix_cache`` with the external caches: a sparse decode's prefix
        cache forgets every entry (those in use once their requests finish)."""
        sparse = None if self.scheduler is None else self.scheduler.sparse
        if sparse is None or sparse.prefix is None:
            return None
        sparse.reset_prefix()
        return True

    # ======================================================================= worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self._kv_cache_config.num_blocks
        if self.sparse_settings is not None and self.sparse_settings.paged:  # vllm-ascend
            from ascend_offload.connectors.sparse_decode.worker import unwrap_paged_caches

            kv_caches, indexers = unwrap_paged_caches(kv_caches, self.sparse_settings)
        else:
            indexers = indexer_layers(self._kv_cache_config)
        pairs = pair_layers(list(kv_caches), indexers)
        first = next((t for t in kv_caches.values() if isinstance(t, torch.Tensor)), None)
        is_producer = self.settings.is_producer
        device_id = (first.device.index or 0) if first is not None else 0
        if self.decode is not None and self.sparse_settings is not None:
            layers = self.decode.pool_layers(kv_caches, pairs, num_blocks)
            self._region = open_region(
                layers, self.cfg, self.settings.host, is_producer=is_producer, device_id=device_id
            )
        else:  # vLLM's KV, in place or staged through host memory (kv_region)
            self._region = open_kv_region(
                kv_caches,
                pairs,
                num_blocks,
                self.cfg,
                self.settings.host,
                is_producer=is_producer,
                device_id=device_id,
            )
        if self.decode is not None:
            self.decode.start(self._region)
        if self.prefill is not None:
            self.prefill.start(self._region, [main for main, _ in pairs])

    def hold_early_requests(self) -> None:
        """Layer sharing on this prefill (``AscendMultiConnector``, every role): an
        early-dispatched request is held until the scheduler claimed its registration.
        Why: a shared layer buffer is reused within the forward, so every layer must be
        published as it is written, which needs the decode's blocks before the forward."""
        if self.scheduler is not None and self.scheduler.prefill is not None:
            self.scheduler.prefill.claim_in_worker = False

    def attach_reuse_gate(self, pipeline: SlotSharing) -> None:
        """Layer sharing on this prefill: decode's reads hold each layer's buffer
        (see :meth:`PrefillWorker.attach_reuse_gate`). Called by ``AscendMultiConnector``."""
        assert self.prefill is not None, f"{NAME}: attach_reuse_gate needs a kv_producer worker"
        self.prefill.attach_reuse_gate(pipeline)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """A prefill rank applies the step's metadata now, before the forward: the claims
        of its late sends then wait at the proxy while the model computes, instead of
        starting at the first layer's save."""
        super().bind_connector_metadata(connector_metadata)
        if self.prefill is not None:
            self._prepare()

    def _prepare(self) -> None:
        """Apply this step's metadata once, from whichever hook runs first.

        vLLM (0.32) calls ``start_load_kv`` *after* the forward for async
        connectors, but the producer must know this step's requests before the
        first ``save_kv_layer``.
        """
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, RemoteD2HMetadata)
        if meta is self._prepared:
            return
        self._prepared = meta
        if not meta.empty:
            log.debug("%s: step metadata %s", NAME, meta)
        if self.decode is not None:
            self.decode.apply(meta)
        if self.prefill is not None:
            self.prefill.apply(meta)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._prepare()

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are asynchronous (a request runs only after all its layers
        # arrived); this hook only makes sure the step's metadata is applied.
        self._prepare()

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self._prepare()
        if self.prefill is not None:
            self.prefill.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self._prepare()
        if self.prefill is not None:
            self.prefill.wait_for_save()
        if self.decode is not None and self.decode.sparse is not None:
            self.decode.sparse.end_step()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending: set[str] = set()
        recving: set[str] = set()
        if self.decode is not None:
            meta = self._get_connector_metadata() if self.has_connector_metadata() else None
            idle = isinstance(meta, RemoteD2HMetadata) and meta.idle
            sending, recving = self.decode.get_finished(
                finished_req_ids, wait_s=self.cfg.idle_wait_ms / 1000 if idle else 0.0
            )
        if self.prefill is not None:
            sending |= self.prefill.get_finished(finished_req_ids)
        return (sending or None), (recving or None)

    def get_kv_connector_stats(self) -> RD2HConnectorStats | None:
        """Counter deltas since the last call, and the idle gauges (workers; the scheduler
        has none)."""
        totals: dict[str, int] = {}
        gauges: dict[str, int] = {}
        for part in (self.decode, self.prefill):
            for k, v in (part.totals() if part is not None else {}).items():
                totals[k] = totals.get(k, 0) + v
            gauges.update(part.gauges() if part is not None else {})
        sparse = self.decode.sparse if self.decode is not None else None
        if sparse is not None:
            totals.update({f"sparse_{k}": v for k, v in sparse.decode.counters().items()})
            gauges.update(
                {
                    f"sparse_{k}": v
                    for k, v in {**sparse.decode.gauges(), **sparse.device_kv_gauges()}.items()
                }
            )
        out = self._deltas.take(totals, gauges) if totals or gauges else None
        assert out is None or isinstance(out, RD2HConnectorStats)
        return out

    # ======================================================================= sparse decode adapter
    # (the model's attention finds the active connector; see sparse/adapter.py)

    def _sparse(self) -> ColocatedSparseDecode:
        assert self.decode is not None and self.decode.sparse is not None, (
            f"{NAME}: sparse decode call without sparse offload on this decode"
        )
        self._prepare()
        return self.decode.sparse.decode

    def sparse_layer_index(self, layer_name: str) -> int | None:
        if self.decode is None or self.decode.sparse is None:
            return None
        return self.decode.sparse.decode.sparse_layer_index(layer_name)

    def plan_step(self, rows: Sequence[BatchRow]) -> SparseStepPlan:
        return self._sparse().plan_step(rows)

    def offload_new_kv(self, layer: int, new_kv: torch.Tensor, positions: torch.Tensor) -> None:
        self._sparse().offload_new_kv(layer, new_kv, positions)

    def onload_topk(self, layer: int, topk: torch.Tensor) -> torch.Tensor:
        return self._sparse().onload_topk(layer, topk)

    def hot_buffer(self, layer: int) -> torch.Tensor:
        return self._sparse().hot_buffer(layer)

    def context_rows(
        self, layer: int, batch_index: int, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._sparse().context_rows(layer, batch_index, positions)

    # ======================================================================= load errors

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.decode.take_load_errors() if self.decode is not None else set()

    def shutdown(self) -> None:
        if self.decode is not None:
            self.decode.close()
        if self.prefill is not None:
            self.prefill.close()
        if self._region is not None:
            self._region.close()
            self._region = None
        if self.scheduler is not None:
            self.scheduler.shutdown()
