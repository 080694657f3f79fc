"""Fake of ``vllm_ascend/attention/sfa_kv_offload.py`` (vllm-ascend main 182b75ea): the SFA impl
that routes decode through vllm-ascend's own ``SparseKVOffloadManager``. Only its calls
into the manager are kept (``exec_kv`` -> ``offload_new_kv``; the attention ->
``onload_topk_kv``), so a test sees whether vllm-ascend's own path ran."""

from __future__ import annotations

from typing import Any

import torch

from vllm_ascend.attention.sfa_v1 import AscendSFAImpl, PreprocessType
from vllm_ascend.distributed.kv_transfer.sparse_kv_offload.sparse_kv_offload_manager import (
    get_sparse_kv_offload_manager,
)


class AscendSFAKVOffloadImpl(AscendSFAImpl):
    def _resolve_preprocess_type(self, act_dtype: torch.dtype) -> PreprocessType:
        return PreprocessType.NATIVE

    def exec_kv(self, kv_no_split, cos, sin, kv_cache, slots, attn_metadata) -> Any:
        result = super().exec_kv(kv_no_split, cos, sin, kv_cache, slots, attn_metadata)
        get_sparse_kv_offload_manager().offload_new_kv(
            slot_mapping=slots, k_cache_cpu=None, v_cache_cpu=None, k_cache_npu=kv_cache[0],
            v_cache_npu=kv_cache[1], k=None, v=None, has_prefill=True, capturing=False)
        return result

    def _execute_sparse_flash_attention_process(self, ql_nope, q_pe, kv_cache, topk_indices,
                                                attn_metadata, actual_seq_lengths_query,
                                                actual_seq_lengths_key, block_table=None):
        get_sparse_kv_offload_manager().onload_topk_kv(
            self.layer_name, ql_nope.shape[0], attn_metadata.seq_lens_cpu.numel(),
            attn_metadata.block_table, topk_indices, None, None, None)
        return super()._execute_sparse_flash_attention_process(
            ql_nope, q_pe, kv_cache, topk_indices, attn_metadata, actual_seq_lengths_query,
            actual_seq_lengths_key, block_table=block_table)
