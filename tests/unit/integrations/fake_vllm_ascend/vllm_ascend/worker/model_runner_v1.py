"""Fake of ``vllm_ascend/worker/model_runner_v1.py`` (vllm-ascend main 182b75ea).

Kept: the module-level ``apply_layerwise_kv_cache_plan(kv_cache_config, vllm_config)``
(vllm-ascend's own, from ``kv_pool/ascend_store/layerwise_cache_layout.py``; here a
recorder, since it acts only for vllm-ascend's memcache store) and
``NPUModelRunner.initialize_kv_cache`` -> ``initialize_kv_cache_tensors`` ->
``_allocate_kv_cache_tensors`` with the published allocation rule: one buffer per
``KVCacheTensor``, given to every layer in its ``shared_by``; a main MLA layer gets
``(k_cache, v_cache)`` split by ``_get_attention_kv_cache_dims`` (``kv_lora_rank :
qk_rope_head_dim``, read here from the model config instead of the attention layer),
an indexer layer ``(k_cache,)``.
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any

import torch

ORIGINAL_PLAN_CALLS: list[Any] = []


def apply_layerwise_kv_cache_plan(kv_cache_config: Any, vllm_config: Any) -> None:
    ORIGINAL_PLAN_CALLS.append(kv_cache_config)


class NPUModelRunner:
    def __init__(self, vllm_config: Any, device: torch.device) -> None:
        self.vllm_config = vllm_config
        self.device = device
        self.kv_caches: dict[str, tuple[torch.Tensor, ...]] = {}

    def initialize_kv_cache(self, kv_cache_config: Any) -> None:
        kv_cache_config = deepcopy(kv_cache_config)
        self.kv_cache_config = kv_cache_config
        apply_layerwise_kv_cache_plan(kv_cache_config, self.vllm_config)
        self.kv_caches = self.initialize_kv_cache_tensors(kv_cache_config)

    def initialize_kv_cache_tensors(self, kv_cache_config: Any) -> dict[str, Any]:
        return self._allocate_kv_cache_tensors(kv_cache_config)

    def _get_attention_kv_cache_dims(self, layer_name: str, kv_cache_spec: Any) -> tuple[int, int]:
        hf = self.vllm_config.model_config.hf_text_config
        return hf.kv_lora_rank, hf.qk_rope_head_dim

    def _allocate_kv_cache_tensors(self, kv_cache_config: Any) -> dict[str, Any]:
        raw: dict[str, tuple[torch.Tensor, ...]] = {}
        for kv_cache_tensor in kv_cache_config.kv_cache_tensors:
            for layer_name in kv_cache_tensor.shared_by:
                if layer_name in raw:
                    continue
                if "indexer" in layer_name:
                    tensors: tuple[torch.Tensor, ...] = (
                        torch.zeros(kv_cache_tensor.size, dtype=torch.int8, device=self.device),)
                else:
                    k_dim, v_dim = self._get_attention_kv_cache_dims(layer_name, None)
                    k_size = kv_cache_tensor.size * k_dim // (k_dim + v_dim)
                    tensors = (torch.zeros(k_size, dtype=torch.int8, device=self.device),
                               torch.zeros(kv_cache_tensor.size - k_size, dtype=torch.int8,
                                           device=self.device))
                for inner in kv_cache_tensor.shared_by:
                    raw[inner] = tensors
        names = {n for g in kv_cache_config.kv_cache_groups for n in g.layer_names}
        assert names == set(raw), "Some layers are not correctly initialized"
        return raw
