from __future__ import annotations

import pytest
import torch

from ascend_offload.transfer.base import (
    LoopbackEngine,
    ReadOp,
    TransferError,
    coalesce,
    create_engine,
)


def test_coalesce_merges_runs_on_both_sides():
    ops = [ReadOp(100, 1000, 10), ReadOp(110, 1010, 10), ReadOp(120, 2000, 5), ReadOp(0, 0, 0),
           ReadOp(50, 500, 10), ReadOp(60, 510, 40)]
    assert coalesce(ops) == [ReadOp(50, 500, 50), ReadOp(100, 1000, 20), ReadOp(120, 2000, 5)]


def test_coalesce_rejects_overlap_and_negative():
    with pytest.raises(ValueError, match="overlapping"):
        coalesce([ReadOp(0, 0, 10), ReadOp(5, 100, 10)])
    with pytest.raises(ValueError, match="length=-1"):
        coalesce([ReadOp(0, 0, -1)])


def test_loopback_reads_registered_memory_only():
    a, b = LoopbackEngine(), LoopbackEngine()
    src = torch.arange(64, dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)
    a.register(src.data_ptr(), 64)
    b.register(dst.data_ptr(), 64)
    n = b.read(a.endpoint, [ReadOp(dst.data_ptr() + i * 8, src.data_ptr() + i * 8, 8) for i in range(4)]
               + [ReadOp(dst.data_ptr() + 40, src.data_ptr() + 8, 8)])
    assert n == 2
    assert dst[:32].tolist() == list(range(32))
    assert dst[40:48].tolist() == list(range(8, 16))
    with pytest.raises(TransferError, match="not registered"):
        b.read(a.endpoint, [ReadOp(dst.data_ptr(), src.data_ptr() + 60, 8)])
    with pytest.raises(TransferError, match="does not exist"):
        b.read("loopback:nope", [ReadOp(dst.data_ptr(), src.data_ptr(), 8)])
    a.close()
    b.close()


def test_factory_names():
    with pytest.raises(ValueError, match="transfer_backend='x'"):
        create_engine("x")
    with pytest.raises(ValueError, match="memfabric_transfer_protocol='tcp'"):
        create_engine("memfabric", protocol="tcp")
    assert create_engine("loopback").name == "loopback"
