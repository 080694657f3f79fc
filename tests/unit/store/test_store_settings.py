"""Store object size on models whose cache group mixes page sizes (the sparse model)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
)

from ascend_offload.connectors.store.settings import object_bytes

BLOCK = 32


def _config(group: KVCacheGroupSpec) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[group])


def test_a_sparse_group_counts_each_cache_with_its_own_page_size() -> None:
    """2 layers x (main row 80 floats + indexer row 64 floats) per token: one object
    holds both caches of every layer, 2 * 32 * (80 + 64) * 4 bytes."""
    specs = {}
    for i in range(2):
        specs[f"model.layers.{i}.self_attn.attn"] = MLAAttentionSpec(
            block_size=BLOCK, num_kv_heads=1, head_size=80, dtype=torch.float32, cache_role=SparseCacheRole.SPARSE)
        specs[f"model.layers.{i}.self_attn.indexer.k_cache"] = MLAAttentionSpec(
            block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float32, cache_role=SparseCacheRole.INDEXER)
    group = KVCacheGroupSpec(list(specs), UniformTypeKVCacheSpecs(block_size=BLOCK, kv_cache_specs=specs))
    assert object_bytes(_config(group)) == 2 * BLOCK * (80 + 64) * 4
    # vLLM's page size of such a group is already the sum over its layers
    assert group.kv_cache_spec.page_size_bytes == object_bytes(_config(group))


def test_a_uniform_group_is_page_size_times_layers() -> None:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float32)
    group = KVCacheGroupSpec(["a.0", "a.1", "a.2"], spec)
    assert object_bytes(_config(group)) == 3 * spec.page_size_bytes == 3 * 2 * BLOCK * 2 * 8 * 4
