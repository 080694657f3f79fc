"""Fake of ``vllm_ascend/distributed/kv_transfer/sparse_kv_offload/sparse_kv_offload_manager.py``
(vllm-ascend main 182b75ea): vllm-ascend's own offload manager, reduced to a recorder of
the two calls its SFA offload impl makes (same names and keyword signatures)."""

from __future__ import annotations

from typing import Any


class SparseKVOffloadManager:
    def __init__(self, vllm_config: Any, kv_cache_config: Any,
                 sparse_kv_offload_config: Any) -> None:
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.sparse_kv_offload_config = sparse_kv_offload_config
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def offload_new_kv(self, slot_mapping: Any, k_cache_cpu: Any, v_cache_cpu: Any,
                       k_cache_npu: Any, v_cache_npu: Any, k: Any, v: Any,
                       has_prefill: bool = False, capturing: bool = False) -> None:
        self.calls.append(("offload_new_kv", {"slot_mapping": slot_mapping, "has_prefill": has_prefill}))

    def onload_topk_kv(self, layer_name: str, num_tokens: int, num_reqs: int, block_table: Any,
                       topk_indices_npu: Any, current_slots_npu: Any, req_ids_npu: Any,
                       stable_prefix_lens_npu: Any, token_to_req_npu: Any = None,
                       capturing: bool = False, skip_topk: bool = False) -> None:
        self.calls.append(("onload_topk_kv", {"layer_name": layer_name, "num_tokens": num_tokens}))


# published: created by init_sparse_kv_offload_manager in NPUModelRunner.initialize_kv_cache
_SPARSE_KV_OFFLOAD_MANAGER = SparseKVOffloadManager(None, None, None)


def get_sparse_kv_offload_manager() -> SparseKVOffloadManager:
    return _SPARSE_KV_OFFLOAD_MANAGER
