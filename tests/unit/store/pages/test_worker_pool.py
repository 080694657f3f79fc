from __future__ import annotations

import itertools

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


def _block_first(num_blocks: int, row_floats: list[int], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"l{i}": torch.randn(num_blocks, n, generator=g) for i, n in enumerate(row_floats)}


@pytest.mark.parametrize("native_layers", [True, False], ids=["one-native-call", "per-layer"])
@pytest.mark.parametrize("as_tensor", [False, True], ids=["lists", "tensors"])
def test_block_first_host_layers_round_trip(native_layers: bool, as_tensor: bool, monkeypatch) -> None:
    """Block-first host KV (vLLM's CPU layout) saves and loads every layer in one native
    call when the library has it, else a call per layer: both move exactly the rows asked,
    for short rows, long rows read behind the prefetch stream (several 4 KiB pages each:
    the page-head prefetch two rows ahead) and rows of a size that takes 16-byte stores."""
    from ascend_offload import native

    if native_layers and not native.has_layer_copy():
        pytest.skip("native layer row copy unavailable")
    if not native_layers:
        monkeypatch.setattr(native, "has_layer_copy", lambda: False)
    kv = _block_first(40, [256, 5 * 1024, 4 * 1024 + 4, 36 * 1024], seed=3)
    before = {k: t.clone() for k, t in kv.items()}
    pool = WorkerPagePool(kv, num_blocks=40, num_pages=24)
    assert (pool._tables is not None) == native_layers
    g = torch.Generator().manual_seed(4)
    ids = torch.randperm(40, generator=g)[:20].tolist()
    pages = torch.randperm(24, generator=g)[:20].tolist()
    targets = [b for b in range(40) if b not in ids][:20]

    def arg(v: list[int]) -> list[int] | torch.Tensor:
        return torch.tensor(v) if as_tensor else v

    pool.save(arg(ids), arg(pages))
    for name, plane in pool.planes.items():
        want = before[name][ids].view(torch.uint8).view(20, -1)
        assert torch.equal(plane[pages], want), name
    pool.load(arg(pages), arg(targets))
    for name, t in kv.items():
        assert torch.equal(t[targets], before[name][ids]), name
        untouched = [b for b in range(40) if b not in targets]
        assert torch.equal(t[untouched], before[name][untouched]), name


def test_one_native_call_checks_every_index_before_copying() -> None:
    """An out-of-range block or page raises IndexError naming the pair, and no layer's
    bytes moved (the native call checks all pairs first)."""
    from ascend_offload import native

    if not native.has_layer_copy():
        pytest.skip("native layer row copy unavailable")
    kv = _block_first(10, [64, 2048], seed=5)
    pool = WorkerPagePool(kv, num_blocks=10, num_pages=4)
    planes = {k: p.clone() for k, p in pool.planes.items()}
    with pytest.raises(IndexError, match="row pair 1 out of range: 10 -> 1"):
        pool.save([3, 10], [0, 1])
    with pytest.raises(IndexError, match="row pair 0 out of range: 4 -> 2"):
        pool.load([4], [2])
    with pytest.raises(IndexError, match="row pair 0 out of range: -1 -> 0"):
        pool.save([-1], [0])
    for k, p in pool.planes.items():
        assert torch.equal(p, planes[k])
    pool.save([], [])  # nothing to move


def test_host_planes_share_one_aligned_buffer_on_cpu() -> None:
    """Without an accelerator the planes are disjoint 4 KiB-aligned views of one buffer
    (the pool's size decides huge pages); every plane still reads back what was saved."""
    from ascend_offload import device

    if device.platform() != "cpu":
        pytest.skip("planes are pinned, one allocation each, with an accelerator")
    kv = _block_first(12, [8, 1000, 24], seed=6)  # 32 B, 4000 B, 96 B rows
    pool = WorkerPagePool(kv, num_blocks=12, num_pages=5)
    planes = list(pool.planes.values())
    assert [tuple(p.shape) for p in planes] == [(5, 32), (5, 4000), (5, 96)]
    base = planes[0].untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == base and p.data_ptr() % 4096 == 0 for p in planes)
    spans = sorted((p.data_ptr(), p.data_ptr() + p.nbytes) for p in planes)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    pool.save([11, 0, 5], [4, 0, 2])
    for name, plane in pool.planes.items():
        assert torch.equal(plane[[4, 0, 2]], kv[name][[11, 0, 5]].view(torch.uint8).view(3, -1))
