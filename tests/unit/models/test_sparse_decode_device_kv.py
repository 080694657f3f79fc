"""SparseDecodeWorker.device_kv_gauges: the device KV split read from the engine's backing."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ascend_offload.connectors.sparse_decode.worker import SparseDecodeWorker


def _worker(hot: list[torch.Tensor]) -> SparseDecodeWorker:
    w = SparseDecodeWorker.__new__(SparseDecodeWorker)
    w.manager = SimpleNamespace(hot=SimpleNamespace(buffers=hot))  # type: ignore[assignment]
    w._kv_gauges = None  # read once, on the first call
    return w


def test_hot_regions_at_the_end_of_one_backing_are_the_main_kv() -> None:
    base, region, rows, row = 3 * 4096, 2 * 4096, 24, 80  # 24 x 80 float32 = 7680 B < region
    backing = torch.zeros(base + 3 * region, dtype=torch.int8).view(torch.float32)
    hot = [torch.as_strided(backing, (rows, row), (row, 1), (base + i * region) // 4)
           for i in range(3)]
    assert _worker(hot).device_kv_gauges() == {
        "device_kv_bytes": base + 3 * region, "device_main_kv_bytes": 3 * region,
        "device_indexer_kv_bytes": base}


def test_buffers_of_their_own_count_whole() -> None:
    hot = [torch.zeros(16, 8) for _ in range(2)]
    assert _worker(hot).device_kv_gauges() == {
        "device_kv_bytes": 1024, "device_main_kv_bytes": 1024, "device_indexer_kv_bytes": 0}
