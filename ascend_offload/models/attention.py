"""vLLM plumbing of the sparse-MLA model: two KV-cache layers per decoder layer,
an attention backend whose metadata is plain per-request slot lists, and the
per-layer op that runs inside vLLM's KV-connector hooks.

* :class:`SparseMLACache` (``model.layers.N.self_attn.attn``) owns the main KV:
  one row of ``kv_lora_rank + qk_rope_head_dim`` values per token
  (``MLAAttentionSpec``, role SPARSE).
* :class:`IndexerCache` (``model.layers.N.self_attn.indexer.k_cache``) owns the
  indexer keys: one row of ``index_head_dim`` values per token (role INDEXER).
  Same block size, so vLLM puts both in one cache group: one block table.
* :func:`sparse_mla_attention` is wrapped by vLLM's ``maybe_transfer_kv_layer``:
  ``wait_for_layer_load(attn)`` runs before the layer touches either cache and
  ``save_kv_layer(attn, ...)`` after both were written and attended. The indexer
  has no hooks of its own: it follows its main layer, so a layerwise connector
  moving both caches of layer N in the main layer's hooks sees them consistent.

Why not vLLM's own MLA/sparse classes: vLLM refuses sparse MLA on CPU and its
CPU MLA kernel is dense, fixed to head 576 and block 16 (see docs/models.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, cast

import torch
from torch import nn
from vllm.config import CacheConfig, VllmConfig, get_current_vllm_config
from vllm.model_executor.layers.attention.attention import get_attention_context
from vllm.model_executor.layers.attention.kv_transfer_utils import maybe_transfer_kv_layer
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import KVCacheSpec, MLAAttentionSpec, SparseCacheRole

from ascend_offload.models.sparse_attention import (
    causal_positions,
    indexer_scores,
    positions_to_slots,
    select_topk,
    sparse_attention,
)
from ascend_offload.sparse.adapter import BatchRow, SparseDecodeAdapter, SparseStepPlan
from ascend_offload.sparse.hybrid import resident_slots, write_resident

_UNSET = object()


def find_sparse_adapter() -> SparseDecodeAdapter | None:
    """The active KV connector when it implements the sparse decode adapter, else None.

    Why the KV connector: it is the one object vLLM builds per worker that both sees
    the scheduler's per-step facts (which request is which) and is reachable from a
    layer (``get_kv_transfer_group()``), without patching the model runner.
    """
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    conn = get_kv_transfer_group()
    return conn if isinstance(conn, SparseDecodeAdapter) else None


@dataclasses.dataclass
class RequestSlots:
    """One request of the step: its query tokens and the cache row of every position."""

    start: int  # first query token in the batch
    end: int
    q_pos: torch.Tensor  # [end - start] positions of the query tokens
    slots: torch.Tensor  # [seq_len] cache row of positions 0..seq_len-1
    row: BatchRow  # how sparse decode offload names this request (key block, lengths)


@dataclasses.dataclass
class SparseMLAMetadata(AttentionMetadata):
    num_actual_tokens: int
    slot_mapping: torch.Tensor  # [num_actual_tokens] row of each new token, -1 = skip
    requests: list[RequestSlots]
    # sparse decode offload: the step's new-row batch indices (or their count when they
    # are the batch's first tokens in order) and (batch entry, position) pairs, the same
    # for every layer of the step (the first offloaded layer makes them)
    offload_new_rows: tuple[torch.Tensor | int, torch.Tensor | None] | None = None
    offload_plan: SparseStepPlan | None = None  # the step's plan (the first layer asks once)


class SparseMLAMetadataBuilder(AttentionMetadataBuilder[SparseMLAMetadata]):
    """Per-request slot lists from the block table: the model reads any position's
    row directly, whatever the step is (prefill chunk, prefix-cache hit, decode)."""

    def __init__(self, kv_cache_spec: KVCacheSpec, layer_names: list[str],
                 vllm_config: VllmConfig, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> SparseMLAMetadata:
        cm = common_attn_metadata
        n = cm.num_actual_tokens
        starts = cm.query_start_loc_cpu.tolist()
        seq_lens = cm.seq_lens.cpu().tolist()
        table = cm.block_table_tensor.cpu().long()
        bs = self.block_size
        requests = []
        for r in range(cm.num_reqs):
            start, end, seq = starts[r], starts[r + 1], seq_lens[r]
            if end <= start:
                continue
            pos = torch.arange(seq)
            slots = table[r, pos // bs] * bs + pos % bs
            row = BatchRow(int(table[r, (seq - 1) // bs]), seq, end - start)
            requests.append(RequestSlots(start, end, torch.arange(seq - (end - start), seq), slots,
                                         row))
        return SparseMLAMetadata(n, cm.slot_mapping[:n].long(), requests)


class SparseMLABackend(AttentionBackend):
    """Backend of both cache layers; it only describes caches and metadata (the
    arithmetic is in :mod:`ascend_offload.models.sparse_attention`)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "ASCEND_OFFLOAD_SPARSE_MLA"

    @staticmethod
    def get_impl_cls() -> type[Any]:
        raise NotImplementedError("the sparse-MLA layers compute attention themselves")

    @staticmethod
    def get_builder_cls() -> type[SparseMLAMetadataBuilder]:
        return SparseMLAMetadataBuilder

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return True


def as_rows(cache: torch.Tensor) -> torch.Tensor:
    """A paged cache ``[num_blocks, (1,) block, D]`` as rows ``[num_blocks * block, D]``
    without a copy (the model writes through it)."""
    try:
        return cache.view(-1, cache.shape[-1])
    except RuntimeError as e:
        raise ValueError(f"KV cache shape={tuple(cache.shape)} stride={cache.stride()} is not "
                         "row-addressable; use a layer-outermost KV cache layout") from e


class _CacheLayer(nn.Module, AttentionLayerBase):
    """A layer vLLM allocates a one-row-per-token cache for (bound to ``kv_cache``)."""

    role: ClassVar[SparseCacheRole]

    def __init__(self, prefix: str, head_size: int, dtype: torch.dtype,
                 cache_config: CacheConfig) -> None:
        super().__init__()
        if cache_config.cache_dtype != "auto":
            raise ValueError(f"{prefix}: kv_cache_dtype={cache_config.cache_dtype!r} is not "
                             "supported by the sparse-MLA model (use 'auto')")
        self.layer_name = prefix
        self.head_size = head_size
        self.dtype = dtype
        self.block_size = cache_config.block_size
        self.kv_cache = torch.tensor([])
        ctx = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in ctx:
            raise ValueError(f"Duplicate layer name: {prefix}")
        ctx[prefix] = self

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return MLAAttentionSpec(block_size=self.block_size, num_kv_heads=1, max_tp_shards=1,
                                head_size=self.head_size, dtype=self.dtype, cache_role=self.role)

    def get_attn_backend(self) -> type[AttentionBackend]:
        return SparseMLABackend


class IndexerCache(_CacheLayer):
    """The lightning indexer's key cache of one layer (``index_head_dim`` per token)."""

    role = SparseCacheRole.INDEXER


class SparseMLACache(_CacheLayer):
    """The main-KV cache of one layer and the sparse attention over it."""

    role = SparseCacheRole.SPARSE

    def __init__(self, prefix: str, *, num_heads: int, kv_lora_rank: int, rope_dim: int,
                 scale: float, index_topk: int | None, indexer: IndexerCache,
                 dtype: torch.dtype, cache_config: CacheConfig) -> None:
        super().__init__(prefix, kv_lora_rank + rope_dim, dtype, cache_config)
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.scale = scale
        self.index_topk = index_topk  # None: dense attention over every position
        self.indexer = indexer
        self._offload: Any = _UNSET  # (adapter, pool layer) or None, found on the first real step

    def forward(self, q: torch.Tensor, new_kv: torch.Tensor, index_q: torch.Tensor,
                index_k: torch.Tensor, index_w: torch.Tensor) -> torch.Tensor:
        """``q`` ``[T, H, r + rope]`` (absorbed), ``new_kv`` ``[T, r + rope]``,
        indexer ``q`` ``[T, H_idx, D_idx]``, ``k`` ``[T, D_idx]``, ``w`` ``[T, H_idx]``;
        returns the latent output ``[T, H, r]``."""
        out = torch.zeros(q.shape[0], q.shape[1], self.kv_lora_rank, dtype=q.dtype, device=q.device)
        sparse_mla_attention(q, new_kv, index_q, index_k, index_w, out, self.layer_name)
        return out

    def run(self, meta: SparseMLAMetadata | None, q: torch.Tensor, new_kv: torch.Tensor,
            index_q: torch.Tensor, index_k: torch.Tensor, index_w: torch.Tensor,
            out: torch.Tensor) -> None:
        if meta is None:  # profiling / dummy run: no caches, no work
            return
        if self._offload is _UNSET:
            self._offload = self._find_offload()
        if self._offload is not None:
            self._run_offloaded(meta, q, new_kv, index_q, index_k, index_w, out)
            return
        kv_rows, key_rows = self._write_new_rows(meta, new_kv, index_k)
        assert kv_rows is not None
        for req in meta.requests:
            sl = slice(req.start, req.end)
            positions = self._positions(req, index_q, index_w, key_rows)
            rows = positions_to_slots(positions, req.slots)
            out[sl] = sparse_attention(q[sl], kv_rows, rows, scale=self.scale,
                                       v_dim=self.kv_lora_rank)

    def _find_offload(self) -> tuple[SparseDecodeAdapter, int] | None:
        adapter = find_sparse_adapter()
        if adapter is None or self.index_topk is None:
            return None
        layer = adapter.sparse_layer_index(self.layer_name)
        return None if layer is None else (adapter, layer)

    def _new_row_positions(self, meta: SparseMLAMetadata, plan: SparseStepPlan
                           ) -> tuple[torch.Tensor | int, torch.Tensor | None]:
        """The step's new tokens (batch indices, or their count when they are the batch's
        first tokens in order, as in every decode step: a slice, no gather) and their
        (batch entry, position) pairs for ``offload_new_kv`` (``None`` for a resident
        step: :attr:`SparseStepPlan.resident` has their rows): built once per step, in
        Python lists (a decode step has one token per request; per-request tensor ops
        cost more than the lists)."""
        src: list[int] = []
        pos: list[tuple[int, int]] | None = [] if plan.resident is None else None
        for i, req in enumerate(meta.requests):
            b, first = plan.batch_index[i], plan.offload_from[i]
            seq, n_new = req.slots.shape[0], req.end - req.start
            if b < 0 or first != seq - n_new:
                raise RuntimeError(
                    f"{self.layer_name}: batch row {i} ({seq} tokens, {n_new} new) "
                    + ("is not offloaded" if b < 0 else
                       f"lacks pool rows {first}..{seq - n_new - 1} this step did not compute")
                    + ": the device has no main KV to attend over instead")
            src.extend(range(req.start, req.end))
            if pos is not None:
                pos.extend((b, p) for p in range(first, seq))
        rows = None if pos is None else torch.tensor(pos, dtype=torch.int64).view(len(pos), 2)
        if src == list(range(len(src))):
            return len(src), rows
        return torch.tensor(src, dtype=torch.int64), rows

    def _decode_topk(self, plan: SparseStepPlan, selected: list[torch.Tensor],
                     device: torch.device) -> torch.Tensor:
        """``[entries, query_tokens * index_topk]`` int32 top-k of the decode rows, ``-1``
        padded: query token ``t`` of a row in columns ``t*K .. t*K + K - 1`` (a
        verification row's top-k sets resolve as one union). One concatenation when every
        entry is a full-width one-token decode row in batch order (a plain decode step),
        else row by row."""
        assert self.index_topk is not None
        k, t_max = self.index_topk, plan.query_tokens
        if (t_max == 1 and all(plan.decode) and plan.batch_index == tuple(range(plan.num_entries))
                and all(p.shape == (1, k) for p in selected)):
            return torch.cat(selected).to(torch.int32)
        topk = torch.full((plan.num_entries, t_max, k), -1, dtype=torch.int32, device=device)
        for i, positions in enumerate(selected):
            if plan.decode[i]:
                topk[plan.batch_index[i], : positions.shape[0], : positions.shape[1]] = positions
        return topk.view(plan.num_entries, t_max * k)

    def _positions(self, req: RequestSlots, index_q: torch.Tensor, index_w: torch.Tensor,
                   key_rows: torch.Tensor) -> torch.Tensor:
        """The request's selected logical positions ``[T, min(topk, seq)]`` (as without offload)."""
        sl = slice(req.start, req.end)
        seq = req.slots.shape[0]
        if self.index_topk is None or self.index_topk >= seq:
            return causal_positions(req.q_pos, seq)
        scores = indexer_scores(index_q[sl], index_w[sl], key_rows[req.slots])
        return select_topk(scores, req.q_pos, self.index_topk)

    def _write_new_rows(self, meta: Any, new_kv: torch.Tensor | None, index_k: torch.Tensor
                        ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Write the step's new indexer rows, and main-KV rows unless ``new_kv`` is None
        (offloaded: the device has no main KV), into the paged caches at their slots;
        returns the caches as ``[slots, row]`` views."""
        n = meta.num_actual_tokens
        key_rows = as_rows(self.indexer.kv_cache)
        slots = meta.slot_mapping
        ok = slots >= 0
        key_rows[slots[ok]] = index_k[:n][ok].to(key_rows.dtype)
        if new_kv is None:
            return None, key_rows
        kv_rows = as_rows(self.kv_cache)
        kv_rows[slots[ok]] = new_kv[:n][ok].to(kv_rows.dtype)
        return kv_rows, key_rows

    def _run_offloaded(self, meta: SparseMLAMetadata, q: torch.Tensor, new_kv: torch.Tensor,
                       index_q: torch.Tensor, index_k: torch.Tensor, index_w: torch.Tensor,
                       out: torch.Tensor) -> None:
        """Sparse decode offload: the device holds the indexer cache and the hot buffers,
        the host pool every main-KV row. The step's new main-KV rows go to the pool;
        decode rows (one token, or 1 + k of a speculative verification) attend over the
        hot buffer the manager fills with the selected positions' misses, longer rows
        (prefill chunks) over the pool's rows of the same positions
        (:meth:`SparseDecodeAdapter.context_rows`)."""
        adapter, layer = self._offload
        assert self.index_topk is not None
        _, key_rows = self._write_new_rows(meta, None, index_k)
        plan = meta.offload_plan
        if plan is None:
            plan = meta.offload_plan = adapter.plan_step([r.row for r in meta.requests])
        if meta.offload_new_rows is None:
            meta.offload_new_rows = self._new_row_positions(meta, plan)
        src, pos = meta.offload_new_rows
        new = new_kv[:src] if isinstance(src, int) else new_kv[src]
        if plan.resident is not None:
            self._run_resident(meta, plan, layer, q, new, index_q, index_w, key_rows, out)
            return
        if new.shape[0]:
            assert pos is not None
            adapter.offload_new_kv(layer, new, pos)
        selected = [self._positions(req, index_q, index_w, key_rows) for req in meta.requests]
        hot_slots = None
        if plan.any_decode:
            # built where the indexer ran: a device resolver takes it as is, the host
            # resolver reads it (counted in device.host_reads)
            topk = self._decode_topk(plan, selected, q.device)
            hot_slots = adapter.onload_topk(layer, topk)
            hot = adapter.hot_buffer(layer)
        for i, (req, positions) in enumerate(zip(meta.requests, selected, strict=True)):
            sl = slice(req.start, req.end)
            b = plan.batch_index[i]
            if hot_slots is not None and plan.decode[i]:
                # the same positions in the same order: the same rows reach attention
                rows = hot_slots[b].view(plan.query_tokens, -1)[: positions.shape[0],
                                                                : positions.shape[1]]
                out[sl] = sparse_attention(q[sl], hot, rows, scale=self.scale,
                                           v_dim=self.kv_lora_rank)
            else:
                store, rows = adapter.context_rows(layer, b, positions)
                out[sl] = sparse_attention(q[sl], store, rows, scale=self.scale,
                                           v_dim=self.kv_lora_rank)

    def _run_resident(self, meta: SparseMLAMetadata, plan: SparseStepPlan, layer: int,
                      q: torch.Tensor, new: torch.Tensor, index_q: torch.Tensor,
                      index_w: torch.Tensor, key_rows: torch.Tensor, out: torch.Tensor) -> None:
        """Every entry resident (hybrid residency): the step as without offload, over the
        device rows borrowed for the main KV (one scatter of the new rows, one gather per
        row), with no adapter call."""
        res = plan.resident
        assert res is not None
        view = res.views[layer]
        if new.shape[0]:
            write_resident(view, res.new_rows, new)
        for req, b in zip(meta.requests, plan.batch_index, strict=True):
            sl = slice(req.start, req.end)
            rows = resident_slots(res.tables[b], self._positions(req, index_q, index_w, key_rows))
            out[sl] = sparse_attention(q[sl], view, rows, scale=self.scale,
                                       v_dim=self.kv_lora_rank)


@maybe_transfer_kv_layer
def sparse_mla_attention(q: torch.Tensor, new_kv: torch.Tensor, index_q: torch.Tensor,
                         index_k: torch.Tensor, index_w: torch.Tensor, output: torch.Tensor,
                         layer_name: str) -> None:
    """One layer's cache writes, indexer top-k and attention, between the
    connector's ``wait_for_layer_load`` and ``save_kv_layer`` for ``layer_name``."""
    meta, layer, _, _ = get_attention_context(layer_name)
    # vLLM types the registered layer as its own attention classes; ours is a SparseMLACache
    cast("SparseMLACache", layer).run(meta, q, new_kv, index_q, index_k, index_w, output)
