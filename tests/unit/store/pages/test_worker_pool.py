from __future__ import annotations

import pytest
import torch

from ascend_offload.store.pages.worker_pool import WorkerPagePool


def _caches(num_blocks: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        # vLLM CPU layout: block-first
        "l0": torch.randn(num_blocks, 2, 32, 8, generator=g),
        # GPU flash-attn style: (K/V, blocks, ...)
        "l1": torch.randn(2, num_blocks, 32, 8, generator=g),
    }


def test_save_then_load_restores_bytes_into_other_blocks() -> None:
    kv = _caches(10)
    pool = WorkerPagePool(kv, num_blocks=10, num_pages=4)
    assert pool.page_bytes == 2 * (2 * 32 * 8 * 4)
    pool.save([3, 7], [2, 0])
    before0, before1 = kv["l0"].clone(), kv["l1"].clone()
    pool.load([2, 0], [5, 9])
    assert torch.equal(kv["l0"][5], before0[3]) and torch.equal(kv["l0"][9], before0[7])
    assert torch.equal(kv["l1"][:, 5], before1[:, 3]) and torch.equal(kv["l1"][:, 9], before1[:, 7])
    # untouched blocks stay untouched
    assert torch.equal(kv["l0"][4], before0[4])


def test_page_size_mismatch_is_explained() -> None:
    with pytest.raises(ValueError, match="sized store pages at 123"):
        WorkerPagePool(_caches(10), num_blocks=10, num_pages=4, expected_page_bytes=123)


def test_kv_stack_with_two_blocks_copies_blocks_not_k_and_v() -> None:
    """(2, num_blocks=2, ...): dim 0 is the K/V stack; copying along it would swap K and V."""
    g = torch.Generator().manual_seed(1)
    kv = {"l0": torch.randn(2, 2, 32, 8, generator=g)}
    before = kv["l0"].clone()
    pool = WorkerPagePool(kv, num_blocks=2, num_pages=1)
    pool.save([1], [0])
    pool.load([0], [0])
    assert torch.equal(kv["l0"][:, 0], before[:, 1])  # K and V of block 1 -> block 0
    assert torch.equal(kv["l0"][:, 1], before[:, 1])
