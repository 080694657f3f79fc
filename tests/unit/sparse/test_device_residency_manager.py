"""The manager with ``residency_backend: device``: bit-identical logits to the full-KV
run on the reference decoder's schedule, exactly the misses an exact-LRU model
predicts, and no host read of top-k or rows per layer (the host resolver reads both
every layer: the negative control), through ``device.py``'s counter."""

from __future__ import annotations

import uuid

import pytest
import torch

from ascend_offload import device as dev
from ascend_offload.config import SparseOffloadConfig
from ascend_offload.sparse.manager import SparseOffloadManager, StepEntry
from ascend_offload.sparse.pools import HostKVPool
from ascend_offload.sparse.residency import ResidencyError, make_residency
from tests.support.sparse_reference import FullKV, OffloadKV, RefConfig
from tests.unit.sparse.test_reference_parity import (
    BLOCK,
    SCHEDULE,
    STEPS,
    _Replayed,
    _run,
    _TwoRankOffloadKV,
)

READS = (dev.TOPK_READ, dev.NEW_ROWS_READ, dev.STEP_READ)


def _reads() -> dict[str, int]:
    r = dev.host_reads()
    return {k: r.get(k, 0) for k in READS}


def _manager(topk: int, backend: str, **kw) -> SparseOffloadManager:
    cfg = RefConfig(topk=topk)
    scfg = SparseOffloadConfig(enabled=True, topk_buffer_size=2 * topk, index_topk=topk,
                               dram_size_per_dp_GB=0.01, residency_backend=backend)
    return SparseOffloadManager(scfg, num_layers=cfg.num_layers, row_shape=(cfg.latent,),
                                dtype=torch.float32, block_size=BLOCK, max_requests=4,
                                max_positions=8192, **kw)


@pytest.mark.parametrize(("topk", "use_native", "batch_sizes"), [
    (64, "auto", None), (256, "auto", None),
    # the tensor ops with steps padded to powers of two, as a compiled table pads them
    (64, "off", [1, 2, 4])])
def test_device_backend_logits_bit_identical_and_no_layer_reads(
        topk: int, use_native: str, batch_sizes: list[int] | None) -> None:
    cfg = RefConfig(topk=topk)
    full_logits, full_out = _run(cfg, FullKV(cfg.num_layers, cfg.latent))
    table = _Replayed(make_residency(cfg.num_layers, 4, 2 * topk, backend="device",
                                     max_positions=8192, use_native=use_native,
                                     batch_sizes=batch_sizes), 2 * topk)
    mgr = _manager(topk, "device", residency=table)
    assert mgr.residency.kind == "device"
    before = _reads()
    off_logits, off_out = _run(cfg, OffloadKV(mgr))
    reads = {k: v - before[k] for k, v in _reads().items()}
    for step, (a, b) in enumerate(zip(full_logits, off_logits, strict=True)):
        assert torch.equal(a, b), f"logits differ at step {step}"
    assert full_out == off_out
    st = mgr.stats
    assert st.miss_rows == table.expected_misses and 0 < st.miss_rows < st.resolved_positions
    assert st.offload_rows == sum(len(x) for x in full_logits) * cfg.num_layers
    assert mgr.active_requests == [] and mgr.pool.free_blocks == mgr.pool.num_blocks
    # per layer nothing is read back; per step the reports once
    assert reads == {dev.TOPK_READ: 0, dev.NEW_ROWS_READ: 0, dev.STEP_READ: STEPS}, reads


def test_host_backend_reads_every_layer() -> None:
    """The negative control: the same schedule through the host resolver."""
    cfg = RefConfig(topk=64)
    mgr = _manager(64, "host")
    assert mgr.residency.kind in ("native", "torch")
    before = _reads()
    _run(cfg, OffloadKV(mgr))
    reads = {k: v - before[k] for k, v in _reads().items()}
    assert reads[dev.TOPK_READ] == STEPS * cfg.num_layers
    assert reads[dev.NEW_ROWS_READ] == STEPS * cfg.num_layers
    assert reads[dev.STEP_READ] == 0


def test_config_backend_builds_the_device_table_and_its_errors_raise_at_end_step() -> None:
    mgr = _manager(64, "device")
    assert mgr.residency.kind == "device" and mgr.residency.max_positions == 8192
    mgr.admit("a", 200)
    mgr.begin_step([StepEntry("a", 100, 100)])
    slots = mgr.onload_topk(0, torch.tensor([[5] + [-1] * 63], dtype=torch.int32))
    assert slots[0, 0] >= 0
    mgr.end_step()
    mgr.begin_step([StepEntry("a", 100, 100)])
    mgr.onload_topk(0, torch.tensor([[100] + [-1] * 63], dtype=torch.int32))  # past len
    with pytest.raises(ResidencyError, match=r"layer 0, batch entry 0 \(row 0\): top-k\[0\]=100"):
        mgr.end_step()


def test_tp2_shared_pool_with_the_device_backend_bit_identical() -> None:
    """On CPU the device path also runs over a pool shared by two ranks (rank 0 writes
    through the pool's device view, rank 1 waits for its publish)."""
    cfg = RefConfig(topk=64)
    full_logits, _ = _run(cfg, FullKV(cfg.num_layers, cfg.latent))
    name = f"dparity_{uuid.uuid4().hex[:8]}"
    rows = 32 * 1024
    p0 = HostKVPool(cfg.num_layers, rows, (cfg.latent,), torch.float32, BLOCK, shared_name=name)
    try:
        p1 = HostKVPool(cfg.num_layers, rows, (cfg.latent,), torch.float32, BLOCK,
                        shared_name=name, create=False)
        m0 = _manager(64, "device", pool=p0, tp_rank=0)
        m1 = _manager(64, "device", pool=p1, tp_rank=1, fence_timeout_s=5.0)
        assert m0.residency.kind == m1.residency.kind == "device"
        tp_logits, _ = _run(cfg, _TwoRankOffloadKV(m0, m1))
    finally:
        p0.unlink()
    for step, (a, b) in enumerate(zip(full_logits, tp_logits, strict=True)):
        assert torch.equal(a, b), f"logits differ at step {step}"
    assert m1.stats.offload_rows == 0 and m0.stats.offload_rows > 0
    assert max(n for _, n, _, _ in SCHEDULE) < 8192
