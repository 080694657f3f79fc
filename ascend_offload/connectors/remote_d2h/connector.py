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
from ascend_offload.connectors.remote_d2h.decode_worker import DecodeWorker, sparse_hook_from_env
from ascend_offload.connectors.remote_d2h.kv_region import KVRegion, device_layers, open_region
from ascend_offload.connectors.remote_d2h.metadata import RemoteD2HMetadata
from ascend_offload.connectors.remote_d2h.prefill_worker import PrefillWorker
from ascend_offload.connectors.remote_d2h.scheduler import RemoteD2HScheduler
from ascend_offload.connectors.remote_d2h.settings import NAME, build_settings, parse_config
from ascend_offload.kv_layout import layer_order
from ascend_offload.pd.slot_sharing import SlotSharing

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class SfaRemoteD2HConnector(ConnectorMetrics, KVConnectorBase_V1):
    """P/D pull connector; see the package docstring."""

    STATS = RD2HConnectorStats
    PROM = RD2HPromMetrics

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        wire_logging()
        self.cfg: RemoteD2HConfig = parse_config(vllm_config)
        # Checked in every role: a decode without the hook fails at startup, scheduler included.
        sparse_hook = sparse_hook_from_env() if self.cfg.sparse_offload.enabled else None
        self.settings = build_settings(vllm_config, self.cfg)
        self.is_producer = self.settings.is_producer
        self.is_consumer = self.settings.is_consumer
        self.scheduler: RemoteD2HScheduler | None = None
        self.decode: DecodeWorker | None = None
        self.prefill: PrefillWorker | None = None
        self._region: KVRegion | None = None
        self._prepared: KVConnectorMetadata | None = None
        self._deltas = CounterDeltas(RD2HConnectorStats)
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = RemoteD2HScheduler(self.settings)
            return
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        tp_rank = get_tensor_model_parallel_rank()
        if self.is_consumer:
            self.decode = DecodeWorker(self.settings, tp_rank, sparse_hook=sparse_hook, vllm_config=vllm_config)
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

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().update_connector_output(connector_output)

    # ======================================================================= worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self._kv_cache_config.num_blocks
        names = layer_order(kv_caches)
        if self.decode is not None and self.settings.sparse:
            layers = self.decode.pool_layers(kv_caches, names, num_blocks)
        else:
            layers = device_layers(kv_caches, names, num_blocks, connector=NAME)
        first = next(iter(kv_caches.values()), None)
        self._region = open_region(layers, self.cfg, self.settings.host, is_producer=self.settings.is_producer,
                                   device_id=(first.device.index or 0) if first is not None else 0)
        if self.decode is not None:
            self.decode.start(self._region)
        if self.prefill is not None:
            self.prefill.start(self._region, names)

    def attach_reuse_gate(self, pipeline: SlotSharing) -> None:
        """Layer sharing on this prefill: decode's reads hold each layer's buffer
        (see :meth:`PrefillWorker.attach_reuse_gate`). Called by ``AscendMultiConnector``."""
        assert self.prefill is not None, f"{NAME}: attach_reuse_gate needs a kv_producer worker"
        self.prefill.attach_reuse_gate(pipeline)

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

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self._prepare()
        if self.prefill is not None:
            self.prefill.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self._prepare()
        if self.prefill is not None:
            self.prefill.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending: set[str] = set()
        recving: set[str] = set()
        if self.decode is not None:
            sending, recving = self.decode.get_finished(finished_req_ids)
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
        out = self._deltas.take(totals, gauges) if totals or gauges else None
        assert out is None or isinstance(out, RD2HConnectorStats)
        return out


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
