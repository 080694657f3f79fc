from __future__ import annotations

import pytest
import torch

from ascend_offload import device


def test_cpu_platform_and_null_sync() -> None:
    assert device.platform() == "cpu"
    s = device.new_stream()
    ev = device.new_event()
    with device.stream_context(s):
        ev.record(s)
    assert ev.query()
    device.record_after_compute().synchronize()
    device.synchronize()


def test_row_copies() -> None:
    src = torch.arange(40, dtype=torch.float32).view(10, 4)
    out = torch.empty(3, 4)
    device.gather_rows(src, [7, 1, 4], out)
    assert torch.equal(out, src[[7, 1, 4]])
    dst = torch.zeros(10, 4)
    device.scatter_rows(out, torch.tensor([0, 5, 9]), dst)
    assert torch.equal(dst[[0, 5, 9]], out) and dst[1].abs().sum() == 0
    dst2 = torch.zeros(6, 4)
    device.copy_rows(src, [2, 3], dst2, [5, 0])
    assert torch.equal(dst2[5], src[2]) and torch.equal(dst2[0], src[3])


@pytest.mark.parametrize("dim", [0, 1])
def test_block_staging_round_trip(dim: int) -> None:
    """Pages of chosen blocks go out to host rows and back into other blocks, along the
    KV tensor's block dimension (a K/V stack puts it at 1)."""
    kv = torch.arange(2 * 6 * 3 * 4, dtype=torch.float32).view(2, 6, 3, 4)
    if dim == 0:
        kv = kv.view(6, 2, 3, 4)
    stream = device.new_stream()
    rows = device.blocks_to_host(kv, dim, [4, 1], stream)
    assert rows.shape == (2, *kv.select(dim, 0).shape) and device.is_host(rows)
    assert torch.equal(rows[0], kv.select(dim, 4)) and torch.equal(rows[1], kv.select(dim, 1))
    before = kv.clone()
    device.blocks_from_host(rows, kv, dim, [0, 5], stream)
    assert torch.equal(kv.select(dim, 0), before.select(dim, 4))
    assert torch.equal(kv.select(dim, 5), before.select(dim, 1))
    for b in (1, 2, 3, 4):
        assert torch.equal(kv.select(dim, b), before.select(dim, b))


def test_host_addressable_pages() -> None:
    """Host pages are addressable in place only when each block's page is contiguous."""
    kv = torch.zeros(2, 6, 3, 4)
    assert device.host_addressable_pages(kv.view(6, 2, 3, 4), 0)  # block-first
    assert not device.host_addressable_pages(kv, 1)  # K/V stack: a block's halves lie apart
    assert not device.host_addressable_pages(kv.permute(1, 0, 2, 3), 0)  # the same, block-first view
    assert device.host_addressable_pages(kv[0], 0)  # one half, blocks first


def test_host_alloc_and_bytes() -> None:
    t = device.empty_host((4, 8), torch.float16)
    t.fill_(1.5)
    mv = device.tensor_bytes(t)
    assert mv.nbytes == 64


def test_empty_host_is_resident_on_cpu() -> None:
    """On CPU the host buffer is faulted in at allocation (zero-filled), like pinned
    memory: no page fault on the first write of the data path. A large one also
    asks for transparent huge pages (best effort, never an error)."""
    small = device.empty_host((3, 5), torch.float32)
    assert small.shape == (3, 5) and bool((small == 0).all())
    big = device.empty_host((40 << 20,), torch.uint8)  # above the huge-page threshold
    assert big.numel() == 40 << 20 and int(big[::4096].count_nonzero()) == 0
    assert device.empty_host((0, 7), torch.uint8).numel() == 0


@pytest.mark.parametrize("use_native", [True, False])
@pytest.mark.parametrize(("src_idx", "dst_idx"), [
    ([0, 1, 2, 3], [4, 5, 6, 7]),            # one run each side (one gather)
    ([7, 3, 5, 1, 0], [2, 3, 4, 9, 10]),     # destination runs (gathers)
    ([2, 3, 4], [9, 0, 5]),                  # one source run, scattered destinations
    ([6, 1, 8, 2], [3, 11, 0, 7]),           # scattered both sides
])
def test_move_rows_native_and_fallback_paths_agree(use_native: bool, src_idx: list[int],
                                                   dst_idx: list[int], monkeypatch) -> None:
    """Every path of move_rows (native row copy, index gathers, memcpy scatters) moves
    exactly rows src[src_idx[i]] -> dst[dst_idx[i]] and nothing else."""
    from ascend_offload import native

    if use_native and not native.available():
        pytest.skip("native library unavailable")
    if not use_native:
        monkeypatch.setattr(native, "available", lambda: False)
    src = torch.randint(0, 1 << 30, (10, 24), dtype=torch.int32)
    dst = torch.zeros((12, 24), dtype=torch.int32)
    device.move_rows(device.as_words(src), device.as_words(dst), device.plan_rows(src_idx, dst_idx))
    want = torch.zeros_like(dst)
    for s, d in zip(src_idx, dst_idx, strict=True):
        want[d] = src[s]
    assert torch.equal(dst, want)
