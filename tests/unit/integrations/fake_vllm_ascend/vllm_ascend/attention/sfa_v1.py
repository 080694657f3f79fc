"""Fake of ``vllm_ascend/attention/sfa_v1.py`` (vllm-ascend main 182b75ea, 2026-08-22).

Same class and method names and signatures as published (checked against
``vllm_ascend_api/snapshot.json``): ``PreprocessType``,
``AscendSFABackend.get_impl_cls`` (staticmethod; vllm-ascend's own offload impl
when ``sparse_kv_offload_config.enabled``, else ``context_parallel/sfa_cp.resolve_sfa_impl``),
``AscendSFAMetadata`` (all fields), ``AscendSFAImpl.__init__`` / ``_resolve_preprocess_type`` /
``exec_kv`` / ``_execute_sparse_flash_attention_process`` / ``forward``.

``forward`` keeps the published order on a torch reference: a fused preprocess
type writes the caches without ``exec_kv`` (as the PROLOG_V3/MLAPO kernels do);
the native one calls ``exec_kv`` (``npu_kv_rmsnorm_rope_cache``: nope rows into
``kv_cache[0]``, rope rows into ``kv_cache[1]`` at ``slot_mapping``), then the
indexer writes its key cache (``kv_cache[2]``) and selects each token's top-k
logical positions ``[T, 1, K]`` (``-1`` padded), then
``_execute_sparse_flash_attention_process`` runs ``DeviceOperator``'s kernel.
The projections are plain matrices given as ``weights`` (fake-only kwarg).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch

from vllm_ascend.ascend_config import get_ascend_config
from vllm_ascend.device.device_op import DeviceOperator


class PreprocessType(enum.Enum):
    NATIVE = "native"
    PROLOG_V3 = "prolog_v3"
    MLAPO = "mlapo"


class AscendSFABackend:
    accept_output_buffer: bool = True

    @staticmethod
    def get_name() -> str:
        return "ASCEND_SFA"

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_type: str = "") -> tuple[int, ...]:
        return (num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_impl_cls() -> type[AscendSFAImpl]:
        if get_ascend_config().sparse_kv_offload_config.enabled:
            from vllm_ascend.attention.sfa_kv_offload import AscendSFAKVOffloadImpl

            return AscendSFAKVOffloadImpl
        from vllm_ascend.attention.context_parallel.sfa_cp import resolve_sfa_impl

        return resolve_sfa_impl()


@dataclass
class AscendSFAMetadata:
    """All published fields, in order (the constructor's signature); unused ones are ``Any``."""

    num_actual_tokens: int
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    cum_query_lens: torch.Tensor
    block_table: torch.Tensor
    sin: torch.Tensor | None
    cos: torch.Tensor | None
    num_input_tokens: int = 0
    head_dim: int | None = None
    attn_mask: torch.Tensor | None = None
    attn_state: Any = None  # published: AscendAttentionState.ChunkedPrefill
    reshape_cache_event: Any = None
    num_decodes: int = 0
    num_decode_tokens: int = 0
    num_prefills: int = 0
    block_size: int = 0
    group_len: torch.Tensor | None = None
    group_key_idx: torch.Tensor | None = None
    group_key_cache_idx: torch.Tensor | None = None
    req_ids_tensor: torch.Tensor | None = None
    token_to_req: torch.Tensor | None = None


class AscendSFAImpl:
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None,
                 kv_cache_dtype: str, logits_soft_cap: float | None, attn_type: str,
                 kv_sharing_target_layer_name: str | None, **kwargs: Any) -> None:
        self.num_heads = num_heads
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_lora_rank = kwargs["kv_lora_rank"]
        self.qk_rope_head_dim = kwargs["qk_rope_head_dim"]
        self.layer_name = kwargs.get("layer_name")
        self.enable_sparse_sfa_c8 = kwargs.get("enable_sparse_sfa_c8", False)
        self.index_topk = kwargs["index_topk"]  # published: the indexer's topk_tokens
        self.w = kwargs["weights"]  # fake-only
        self.preprocess_type = self._resolve_preprocess_type(torch.float32)

    def _resolve_preprocess_type(self, act_dtype: torch.dtype) -> PreprocessType:
        return PreprocessType.PROLOG_V3  # the fused path a BF16 W8A8 deployment picks

    def exec_kv(self, kv_no_split: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple, slots: torch.Tensor, attn_metadata: Any) -> tuple[None, None]:
        self._write_main(kv_no_split, kv_cache, slots)
        return None, None

    def _write_main(self, kv_no_split: torch.Tensor, kv_cache: tuple, slots: torch.Tensor) -> None:
        nope, rope = kv_no_split.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv_cache[0].view(-1, self.kv_lora_rank)[slots] = nope
        kv_cache[1].view(-1, self.qk_rope_head_dim)[slots] = rope

    def _execute_sparse_flash_attention_process(self, ql_nope, q_pe, kv_cache, topk_indices,
                                                attn_metadata, actual_seq_lengths_query,
                                                actual_seq_lengths_key, block_table=None):
        return DeviceOperator.execute_sparse_flash_attention_process(
            self, ql_nope, q_pe, kv_cache, topk_indices, attn_metadata,
            actual_seq_lengths_query, actual_seq_lengths_key, block_table=block_table)

    def _indexer_topk(self, x: torch.Tensor, kv_cache: tuple, meta: AscendSFAMetadata
                      ) -> torch.Tensor:
        idx_cache = kv_cache[2]
        bs = idx_cache.shape[1]
        idx_cache.view(-1, idx_cache.shape[-1])[meta.slot_mapping] = x @ self.w["ik"]
        q = x @ self.w["iq"]
        seq = meta.seq_lens_cpu.tolist()
        ends = meta.cum_query_lens.tolist()
        out = torch.full((x.shape[0], 1, self.index_topk), -1, dtype=torch.int32)
        for r, end in enumerate(ends):
            start = ends[r - 1] if r else 0
            pos = torch.arange(seq[r])
            keys = idx_cache[meta.block_table[r, pos // bs].long(), pos % bs, 0]
            for i, t in enumerate(range(start, end)):
                q_pos = seq[r] - (end - start) + i
                s = keys[: q_pos + 1] @ q[t]
                top = torch.topk(s, min(self.index_topk, q_pos + 1)).indices
                out[t, 0, : top.numel()] = top.to(torch.int32)
        return out

    def forward(self, layer_name, hidden_states: torch.Tensor, kv_cache: tuple[torch.Tensor, ...],
                attn_metadata: AscendSFAMetadata, output: torch.Tensor | None = None
                ) -> torch.Tensor:
        assert output is not None, "Output tensor must be provided."
        if attn_metadata is None:
            return output.fill_(0)
        x = hidden_states
        kv_no_split = x @ self.w["kv"]
        if self.preprocess_type != PreprocessType.NATIVE:
            self._write_main(kv_no_split, kv_cache, attn_metadata.slot_mapping)  # fused kernels
        else:
            self.exec_kv(kv_no_split, attn_metadata.cos, attn_metadata.sin, kv_cache,
                         attn_metadata.slot_mapping, attn_metadata)
        ql_nope = (x @ self.w["qn"]).view(x.shape[0], self.num_heads, self.kv_lora_rank)
        q_pe = (x @ self.w["qp"]).view(x.shape[0], self.num_heads, self.qk_rope_head_dim)
        topk_indices = self._indexer_topk(x, kv_cache, attn_metadata)
        attn_output = self._execute_sparse_flash_attention_process(
            ql_nope, q_pe, kv_cache, topk_indices, attn_metadata,
            attn_metadata.cum_query_lens, attn_metadata.seq_lens)
        output[: attn_output.shape[0]] = attn_output.flatten(1)
        return output
