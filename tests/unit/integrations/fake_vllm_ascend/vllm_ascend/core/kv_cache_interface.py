"""Fake of ``vllm_ascend/core/kv_cache_interface.py`` (vllm-ascend main 182b75ea, 2026-08-22).

Kept: the two SFA cache spec classes and the fields the registration reads.
``AscendMLAAttentionSpec`` describes only the main MLA cache (``head_size`` =
``kv_lora_rank + qk_rope_head_dim``; ``scale_dim`` / ``cache_sparse_sfa_c8`` for the
packed C8 main cache); ``AscendSFAIndexerCacheSpec`` the indexer K (and scale)
cache, which shares the main layers' group and block ids. Published, both derive
from vLLM's ``MLAAttentionSpec``; here from a small frozen base (``_MLASpec``, standing
in for it) with the fields vLLM's group code and the registration read. The fields each
class declares itself are the published ones (``vllm_ascend_api/snapshot.json``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class _MLASpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    dcp_sharded: bool = False  # a field of vLLM's KVCacheSpec base
    cache_dtype_str: str | None = None  # vLLM's MLAAttentionSpec
    compress_ratio: int = 1  # vLLM's MLAAttentionSpec of the vLLM vllm-ascend targets

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize


@dataclass(frozen=True, kw_only=True)
class AscendMLAAttentionSpec(_MLASpec):
    scale_dim: int = 0
    scale_dtype: torch.dtype = torch.int8
    cache_sparse_sfa_c8: bool = False
    store_on_host: bool = False


@dataclass(frozen=True, kw_only=True)
class AscendSFAIndexerCacheSpec(_MLASpec):
    scale_dim: int = 0
    scale_dtype: torch.dtype = torch.int8
    cache_sparse_li_c8: bool = False
    cache_dtype_str: str | None = None
    sfa_dcp_replicated_indexer_size: int = 1
