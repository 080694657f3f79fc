"""KV-tensor layout helpers the P/D connector uses (``ascend_offload.kv_layout``, vLLM-free):
KV tensor -> per-block views, block dim, layer order; and wire-layout compatibility."""

from __future__ import annotations

import pytest
import torch

from ascend_offload.kv_layout import block_dim, block_views, layer_order
from ascend_offload.pd.layout import incompatibility, layer_desc


def test_kv_stack_gives_k_and_v_views():
    kv = torch.arange(2 * 5 * 3 * 4, dtype=torch.float32).reshape(2, 5, 3, 4)
    d = block_dim(kv, 5)
    assert d == 1
    views = block_views(kv, d)
    assert len(views) == 2 and all(v.shape == (5, 3, 4) for v in views)
    desc = layer_desc(views)
    assert [t.block_bytes for t in desc.main] == [48, 48]
    assert desc.main[1].base_addr == kv.data_ptr() + 5 * 48
    assert desc.main[0].block_addr(2) == kv.data_ptr() + 2 * 48


def test_block_major_with_inner_kv_split_when_not_contiguous():
    base = torch.zeros(6, 2, 3, 4)  # (blocks, 2, ...) is contiguous per block: one view
    assert len(block_views(base, block_dim(base, 6))) == 1
    strided = torch.zeros(2, 6, 3, 4).permute(1, 0, 2, 3)  # (blocks, 2, ...) but K/V far apart
    views = block_views(strided, 0)
    assert len(views) == 2 and all(v[0].is_contiguous() for v in views)


def test_block_dim_ambiguity_and_absence():
    assert block_dim(torch.zeros(2, 2, 4), 2) == 1  # K/V stack of 2 blocks
    with pytest.raises(ValueError, match="num_blocks=7"):
        block_dim(torch.zeros(2, 5, 4), 7)


def test_kv_stack_of_two_blocks_splits_into_k_and_v():
    """num_blocks == 2: dim 0 and dim 1 both have size 2; the K/V stack reading (dim 1) wins,
    so the views are K and V (each indexed by block), not block 0 and block 1."""
    kv = torch.arange(2 * 2 * 3 * 4, dtype=torch.float32).reshape(2, 2, 3, 4)
    assert block_dim(kv, 2) == 1
    k, v = block_views(kv, block_dim(kv, 2))
    assert k.shape == (2, 3, 4) and torch.equal(k[1], kv[0, 1]) and torch.equal(v[0], kv[1, 0])
    assert block_dim(torch.zeros(2, 3, 4), 2) == 0  # no K/V stack of 2: dim 0 is the block dim


def test_layer_order_is_model_order():
    names = ["model.layers.10.self_attn.attn", "model.layers.2.self_attn.attn", "model.layers.0.self_attn.attn"]
    assert layer_order(names) == [names[2], names[1], names[0]]


def test_incompatibility_messages():
    a = layer_desc([torch.zeros(4, 8), torch.zeros(4, 8)], torch.zeros(4, 2))
    assert incompatibility(a, a) is None
    assert "main tensor count" in incompatibility(a, layer_desc([torch.zeros(4, 8)], torch.zeros(4, 2)))
    assert "indexer present only on prefill" in incompatibility(a, layer_desc([torch.zeros(4, 8)] * 2))
    assert "indexer block_bytes" in incompatibility(a, layer_desc([torch.zeros(4, 8)] * 2, torch.zeros(4, 3)))
