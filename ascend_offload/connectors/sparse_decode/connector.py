"""``AscendSparseDecodeConnector``: sparse decode offload inside one engine.

Colocated (debug) mode of sparse decode offload: the engine prefills as usual
and every sparse layer's main-KV rows also go to a host pool; one-token
(decode) rows then attend over per-layer hot buffers that
:class:`~ascend_offload.sparse.manager.SparseOffloadManager` fills with the
indexer's top-k misses. The attention finds this connector through
``get_kv_transfer_group()`` and calls it as a
:class:`~ascend_offload.sparse.adapter.SparseDecodeAdapter`.

Scheduler side: per step it tells the workers which requests are new (with
the rows to reserve: prompt + ``max_tokens``), which finished, and how to name
each scheduled request from the attention's batch (the block holding its
newest position -> request id). Worker side: one
:class:`~ascend_offload.sparse.colocated.ColocatedSparseDecode` per rank.

Off by default: without ``sparse_offload.enabled`` the connector does nothing
and the model attends exactly as without it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ascend_offload.config import ConfigError, SparseDecodeConfig, parse_extra_config
from ascend_offload.connectors.logging_setup import wire_logging
from ascend_offload.connectors.metrics import ConnectorMetrics
from ascend_offload.connectors.sparse_decode.metrics import (
    SparseDecodeStats,
    SparsePromMetrics,
    StatsReporter,
)
from ascend_offload.kv_layout import layer_order
from ascend_offload.sparse.adapter import BatchRow, SparseStepPlan
from ascend_offload.sparse.colocated import ColocatedSparseDecode

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

NAME = "AscendSparseDecodeConnector"


@dataclasses.dataclass
class SparseDecodeMetadata(KVConnectorMetadata):
    """Scheduler -> workers, one per step."""

    new: dict[str, int]  # newly scheduled request -> positions to reserve
    keys: dict[int, str]  # block holding a scheduled request's newest position -> request
    finished: tuple[str, ...]  # finished or aborted since the last step


def model_index_topk(vllm_config: VllmConfig) -> int:
    """The model's indexer top-k; startup error naming the key if it has no sparse attention."""
    hf = vllm_config.model_config.hf_config
    topk = getattr(hf, "index_topk", None)
    if topk is None or not getattr(hf, "use_sparse_attention", True):
        raise ConfigError(
            f"key 'sparse_offload.enabled'=True: model {vllm_config.model_config.model!r} "
            f"({getattr(hf, 'architectures', None)}) has no sparse attention (no 'index_topk', "
            "or 'use_sparse_attention' false), so there is no top-k to decode from a host pool "
            "(accepted: False for this model)")
    return int(topk)


def sparse_main_layers(kv_cache_config: KVCacheConfig) -> tuple[list[str], int]:
    """Main-KV layers (``cache_role`` SPARSE) in model order, and their cache group."""
    from vllm.v1.kv_cache_interface import SparseCacheRole

    found: list[str] = []
    group_of = -1
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        per_layer = getattr(spec, "kv_cache_specs", None) or {n: spec for n in group.layer_names}
        for name in group.layer_names:
            if getattr(per_layer.get(name), "cache_role", None) == SparseCacheRole.SPARSE:
                found.append(name)
                if group_of not in (-1, g):
                    raise ConfigError("key 'sparse_offload.enabled'=True: the sparse main-KV layers "
                                      "are split over several KV cache groups (unsupported)")
                group_of = g
    return layer_order(found), group_of


class AscendSparseDecodeConnector(ConnectorMetrics, KVConnectorBase_V1):
    """Colocated sparse decode offload; see the module docstring."""

    STATS = SparseDecodeStats
    PROM = SparsePromMetrics

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        wire_logging()
        tc = vllm_config.kv_transfer_config
        self.cfg: SparseDecodeConfig = parse_extra_config(NAME, tc.kv_connector_extra_config)
        self.enabled = self.cfg.sparse_offload.enabled
        self.block_size = vllm_config.cache_config.block_size
        self.max_model_len = vllm_config.model_config.max_model_len
        self.index_topk = 0
        if self.enabled:  # every role checks, so a bad config fails at startup everywhere
            self.index_topk = model_index_topk(vllm_config)
            self.cfg.sparse_offload.check_against(block_size=self.block_size,
                                                  index_topk=self.index_topk)
            if vllm_config.speculative_config is not None:
                raise ConfigError("key 'sparse_offload.enabled'=True with speculative decoding: "
                                  "decode rows of more than one token are not supported "
                                  "(accepted: False, or no speculative_config)")
        self._group = 0
        if kv_cache_config is not None and self.enabled:
            self._group = sparse_main_layers(kv_cache_config)[1]
        self.decode: ColocatedSparseDecode | None = None
        self._applied: KVConnectorMetadata | None = None
        self._reporter = StatsReporter()

    # ======================================================================= scheduler

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        finished = tuple(sorted(scheduler_output.finished_req_ids))
        if not self.enabled:
            return SparseDecodeMetadata({}, {}, ())
        new: dict[str, int] = {}
        computed: dict[str, int] = {}
        for r in scheduler_output.scheduled_new_reqs:
            computed[r.req_id] = r.num_computed_tokens
            sp = r.sampling_params
            if r.prompt_token_ids is None or sp is None or sp.max_tokens is None:
                new[r.req_id] = self.max_model_len
            else:
                new[r.req_id] = min(len(r.prompt_token_ids) + sp.max_tokens, self.max_model_len)
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        keys: dict[int, str] = {}
        assert self._kv_cache_manager is not None, f"{NAME}: vLLM did not bind the KV cache manager"
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            blocks = self._kv_cache_manager.get_block_ids(req_id)[self._group]
            last = (computed[req_id] + n - 1) // self.block_size
            if last < len(blocks):
                keys[blocks[last]] = req_id
        return SparseDecodeMetadata(new, keys, finished)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    # ======================================================================= worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if not self.enabled:
            return
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        from ascend_offload.sparse.manager import SparseOffloadManager

        assert self._kv_cache_config is not None
        names, _ = sparse_main_layers(self._kv_cache_config)
        names = [n for n in names if n in kv_caches]
        if not names:
            raise ConfigError("key 'sparse_offload.enabled'=True: the model registered no sparse "
                              "main-KV cache layer (cache_role SPARSE); accepted: False")
        first = kv_caches[names[0]]
        row, dtype = first.shape[-1], first.dtype
        for n in names:
            if kv_caches[n].shape[-1] != row or kv_caches[n].dtype != dtype:
                raise ConfigError(f"key 'sparse_offload.enabled'=True: main-KV layer {n} has rows "
                                  f"of {kv_caches[n].shape[-1]} x {kv_caches[n].dtype}, "
                                  f"{names[0]} of {row} x {dtype}: one host pool needs one row shape")
        mgr = SparseOffloadManager(
            self.cfg.sparse_offload, num_layers=len(names), row_shape=(row,), dtype=dtype,
            block_size=self.block_size, max_requests=self._vllm_config.scheduler_config.max_num_seqs,
            index_topk=self.index_topk, device=first.device,
            tp_rank=get_tensor_model_parallel_rank())
        self.decode = ColocatedSparseDecode(mgr, names)
        kv = mgr.pool.kv
        log.info("%s: sparse decode offload of %d layers: host pool %d rows x %d x %s (%.3f GiB), "
                 "hot buffers %d rows per request x %d requests (%s, %.1f MiB), residency %s",
                 NAME, len(names), kv.shape[1], row, dtype, kv.numel() * kv.element_size() / 2**30,
                 mgr.hot_size, mgr.max_requests, mgr.residency.kind, mgr.hot.nbytes / 2**20,
                 self.cfg.sparse_offload.residency_policy)

    def _prepare(self) -> ColocatedSparseDecode | None:
        """Apply this step's metadata once (finish, admit, request names)."""
        if self.decode is None or not self.has_connector_metadata():
            return self.decode
        meta = self._get_connector_metadata()
        if meta is self._applied:
            return self.decode
        assert isinstance(meta, SparseDecodeMetadata)
        self._applied = meta
        for rid in meta.finished:
            self.decode.finish(rid)
        for rid, max_tokens in meta.new.items():
            self.decode.admit(rid, max_tokens)
        self.decode.begin(meta, meta.keys)
        return self.decode

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._prepare()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._prepare()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        if self.decode is not None:
            self._prepare()  # a step without a forward still finishes and admits
            self.decode.end_step()

    def get_kv_connector_stats(self) -> SparseDecodeStats | None:
        if self.decode is None:
            return None
        return self._reporter.take(self.decode.counters(), self.decode.gauges())


    # ======================================================================= adapter

    def sparse_layer_index(self, layer_name: str) -> int | None:
        return None if self.decode is None else self.decode.sparse_layer_index(layer_name)

    def plan_step(self, rows: Sequence[BatchRow]) -> SparseStepPlan:
        decode = self._prepare()
        assert decode is not None, f"{NAME}: plan_step without an offloaded layer"
        return decode.plan_step(rows)

    def offload_new_kv(self, layer: int, new_kv: torch.Tensor, positions: torch.Tensor) -> None:
        assert self.decode is not None
        self.decode.offload_new_kv(layer, new_kv, positions)

    def onload_topk(self, layer: int, topk: torch.Tensor) -> torch.Tensor:
        assert self.decode is not None
        return self.decode.onload_topk(layer, topk)

    def hot_buffer(self, layer: int) -> torch.Tensor:
        assert self.decode is not None
        return self.decode.hot_buffer(layer)
