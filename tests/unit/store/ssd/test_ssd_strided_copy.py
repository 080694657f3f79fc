"""The O_DIRECT promote's copy out of whole slots (``native.copy_strided_rows``): each
layer's rows sit at the slot pitch in the staging buffer; one native call moves a
chunk's rows of every layer into the page planes, checking every index first."""

from __future__ import annotations

import pytest
import torch

from ascend_offload import native

pytestmark = pytest.mark.skipif(not native.has_strided_copy(), reason="the native library is not available here")

PITCH = 4096 + 160  # a record: header, then each layer's row, then padding
WIDTHS = (1024, 2048, 64, 1000)  # 1000: not a multiple of 16 bytes (the unaligned copy)
HEAD = 64


def records(n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n * PITCH,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))


def offsets() -> list[int]:
    out, off = [], HEAD
    for w in WIDTHS:
        out.append(off)
        off += w
    return out


def test_rows_of_every_layer_land_in_their_pages() -> None:
    buf = records(6)
    planes = [torch.zeros(9, w, dtype=torch.uint8) for w in WIDTHS]
    table = native.strided_table([(buf, a, PITCH, p) for a, p in zip(offsets(), planes, strict=True)])
    sidx, didx = native.int32_array([4, 0, 5, 2]), native.int32_array([8, 3, 0, 7])
    assert native.copy_strided_rows(table, len(planes), sidx.buffer_info()[0], didx.buffer_info()[0], 4) == 0
    for a, w, plane in zip(offsets(), WIDTHS, planes, strict=True):
        for s, d in zip(sidx, didx, strict=True):
            assert torch.equal(plane[d], buf[s * PITCH + a:s * PITCH + a + w])
        untouched = [r for r in range(9) if r not in set(didx)]
        assert not plane[untouched].any()


@pytest.mark.parametrize(("src", "dst", "bad"), [([0, 6], [0, 1], 2), ([0, 1], [1, 9], 2), ([-1, 0], [0, 1], 1)])
def test_an_index_out_of_range_of_any_layer_copies_nothing(src: list[int], dst: list[int], bad: int) -> None:
    buf = records(6)
    planes = [torch.zeros(9, w, dtype=torch.uint8) for w in WIDTHS]
    table = native.strided_table([(buf, a, PITCH, p) for a, p in zip(offsets(), planes, strict=True)])
    sidx, didx = native.int32_array(src), native.int32_array(dst)
    assert native.copy_strided_rows(table, len(planes), sidx.buffer_info()[0], didx.buffer_info()[0], 2) == -bad
    assert not any(p.any() for p in planes)


def test_a_row_wider_than_its_pitch_is_refused() -> None:
    with pytest.raises(ValueError, match="at pitch"):
        native.strided_table([(records(2), 0, 512, torch.zeros(2, 1024, dtype=torch.uint8))])
