"""First checks an Ascend user runs: skipped unless torch_npu imports and a device exists."""

from __future__ import annotations

import pytest
import torch

torch_npu = pytest.importorskip("torch_npu")

from ascend_offload import device  # noqa: E402
from ascend_offload.store.pages.worker_pool import WorkerPagePool  # noqa: E402

pytestmark = pytest.mark.npu


@pytest.fixture(autouse=True)
def _need_device() -> None:
    if not torch.npu.is_available():  # type: ignore[attr-defined]
        pytest.skip("no NPU visible")


def test_platform_is_npu() -> None:
    assert device.platform() == "npu"
    ev = device.new_event()
    ev.record(device.current_stream())
    ev.synchronize()


def test_worker_pool_round_trip_on_npu() -> None:
    kv = {f"l{i}": torch.randn(64, 2, 128, 576, device="npu") for i in range(3)}
    pool = WorkerPagePool(kv, num_blocks=64, num_pages=16)
    before = {k: v.cpu() for k, v in kv.items()}
    pool.save([5, 9, 33], [0, 1, 2])
    pool.load([0, 1, 2], [40, 41, 42])
    device.synchronize()
    for k, v in kv.items():
        assert torch.equal(v[[40, 41, 42]].cpu(), before[k][[5, 9, 33]])
