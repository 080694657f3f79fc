"""Host pool allocation, shared TP pool + fence, manager bookkeeping and errors."""

from __future__ import annotations

import os
import uuid

import pytest
import torch

from ascend_offload import native
from ascend_offload.config import ConfigError, SparseOffloadConfig
from ascend_offload.sparse.manager import SparseOffloadManager, StepEntry
from ascend_offload.sparse.pools import (
    HostKVPool,
    PoolCapacityError,
    PoolFenceTimeout,
    pool_rows_from_config,
)


def test_pool_reserves_at_admission_and_never_overwrites() -> None:
    pool = HostKVPool(2, 64, (4,), torch.float32, 16)
    pool.kv.zero_()  # host memory is uninitialised until written
    a = pool.admit("a", 20)  # 2 blocks
    b = pool.admit("b", 32)  # 2 blocks
    assert a.tolist() == [0, 1] and b.tolist() == [2, 3] and pool.free_blocks == 0
    with pytest.raises(PoolCapacityError, match=r"'c' needs 1 blocks.*0 of 4 free"):
        pool.admit("c", 1)
    pool.write_rows(1, "a", 0, torch.ones(20, 4))
    pool.write_rows(1, "b", 0, torch.full((32, 4), 2.0))
    assert pool.layer(1)[:20].eq(1).all() and pool.layer(1)[32:64].eq(2).all()
    assert pool.layer(0).abs().sum() == 0  # layer-first: other layers untouched
    with pytest.raises(IndexError, match="'a'"):
        pool.rows_for("a", torch.tensor([32]))
    pool.release("a")
    assert pool.admit("c", 17).tolist() == [0, 1]  # lowest blocks first, deterministic


def test_pool_size_from_config() -> None:
    cfg = SparseOffloadConfig(enabled=True, dram_size_per_dp_GB=1 / 1024)  # 1 MiB
    rows = pool_rows_from_config(cfg, num_layers=4, row_shape=(576,), dtype=torch.bfloat16,
                                 block_size=128)
    assert rows == (2**20 // (4 * 1152)) // 128 * 128
    tiny = SparseOffloadConfig(enabled=True, dram_size_per_dp_GB=1e-9)
    with pytest.raises(ConfigError, match="dram_size_per_dp_GB"):
        pool_rows_from_config(tiny, num_layers=61, row_shape=(576,), dtype=torch.bfloat16,
                              block_size=128)


def test_manager_checks_config() -> None:
    kw = dict(num_layers=1, row_shape=(2,), dtype=torch.float32, block_size=32, max_requests=1,
              pool_rows=64)
    with pytest.raises(ConfigError, match="topk_buffer_size"):
        SparseOffloadManager(SparseOffloadConfig(enabled=True, topk_buffer_size=100,
                                                 index_topk=64), **kw)
    with pytest.raises(ConfigError, match="'enabled'=False"):
        SparseOffloadManager(SparseOffloadConfig(topk_buffer_size=64, index_topk=64), **kw)


def _mgr(**kw) -> SparseOffloadManager:
    cfg = SparseOffloadConfig(enabled=True, topk_buffer_size=8, index_topk=4,
                              use_native=kw.pop("use_native", "auto"))
    return SparseOffloadManager(cfg, num_layers=2, row_shape=(3,), dtype=torch.float32,
                                block_size=4, max_requests=2, **kw)


def test_manager_admission_and_rows() -> None:
    m = _mgr(pool_rows=32)
    assert m.admit("a", 10) == 0 and m.admit("b", 10) == 1
    with pytest.raises(PoolCapacityError, match="hot-buffer row"):
        m.admit("c", 1)
    m.finish("a")
    with pytest.raises(PoolCapacityError, match="host KV pool exhausted"):
        m.admit("c", 40)
    assert m.admit("c", 4) == 0 and m.active_requests == ["b", "c"]
    m.finish("c")
    m.finish("c")  # idempotent


def test_manager_round_trip_and_bad_input() -> None:
    m = _mgr(pool_rows=32)
    m.admit("a", 12)
    m.begin_step([StepEntry("a", 6, 6)])
    kv = torch.arange(6 * 3, dtype=torch.float32).view(6, 3)
    m.offload_new_kv(1, kv, torch.tensor([[0, p] for p in range(6)]))
    slots = m.onload_topk(1, torch.tensor([[5, 0, -1, 2]]))
    hot = m.hot_buffer(1)
    assert torch.equal(hot[slots[0, [0, 1, 3]].long()], kv[[5, 0, 2]])
    assert slots[0, 2] == -1 and m.stats.miss_rows == 3 and m.stats.resolved_positions == 3
    with pytest.raises(IndexError, match="position 6"):
        m.offload_new_kv(1, kv[:1], torch.tensor([[0, 6]]))
    with pytest.raises(ValueError, match="does not match the step batch"):
        m.onload_topk(1, torch.zeros((2, 4), dtype=torch.int64))
    with pytest.raises(ValueError, match="num_tokens=13"):
        m.begin_step([StepEntry("a", 13, 13)])
    with pytest.raises(KeyError, match="'zz'"):
        m.begin_step([StepEntry("zz", 1, 1)])


def test_speculative_rows_are_reloaded_after_rollback() -> None:
    """A draft token's row is rewritten after a rejection: the hot buffer must follow (I4)."""
    m = _mgr(pool_rows=32)
    m.admit("a", 12)
    m.begin_step([StepEntry("a", 6, 5)])  # position 5 is speculative
    m.offload_new_kv(0, torch.full((6, 3), 1.0), torch.tensor([[0, p] for p in range(6)]))
    m.onload_topk(0, torch.tensor([[5, 4, 3, 2]]))
    m.begin_step([StepEntry("a", 6, 5)])  # draft rejected, a new token at position 5
    m.offload_new_kv(0, torch.full((1, 3), 7.0), torch.tensor([[0, 5]]))
    slots = m.onload_topk(0, torch.tensor([[5, 4, 3, 2]]))
    assert m.hot_buffer(0)[int(slots[0, 0])].eq(7.0).all()
    assert m.hot_buffer(0)[int(slots[0, 1])].eq(1.0).all()


def test_shared_pool_tp_rank0_writes_others_read() -> None:
    name = f"test_{uuid.uuid4().hex[:8]}"
    pool0 = HostKVPool(2, 32, (3,), torch.float32, 4, shared_name=name, create=True)
    try:
        pool1 = HostKVPool(2, 32, (3,), torch.float32, 4, shared_name=name, create=False)
        m0 = _mgr(pool=pool0, tp_rank=0)
        m1 = _mgr(pool=pool1, tp_rank=1, fence_timeout_s=0.05)
        for m in (m0, m1):
            m.admit("a", 8)
            m.begin_step([StepEntry("a", 4, 4)])
        kv = torch.randn(4, 3)
        pos = torch.tensor([[0, p] for p in range(4)])
        with pytest.raises(PoolFenceTimeout, match="layer 0"):
            m1.onload_topk(0, torch.tensor([[0, 1, 2, 3]]))  # rank 0 has not written yet
        m1.offload_new_kv(0, torch.zeros(4, 3), pos)  # rank > 0 never writes
        assert pool0.layer(0).abs().sum() == 0
        m0.offload_new_kv(0, kv, pos)
        s0 = m0.onload_topk(0, torch.tensor([[3, 2, 1, 0]]))
        s1 = m1.onload_topk(0, torch.tensor([[3, 2, 1, 0]]))
        assert torch.equal(m1.hot_buffer(0)[s1[0].long()], kv.flip(0))
        assert torch.equal(m0.hot_buffer(0)[s0[0].long()], kv.flip(0))
        with pytest.raises(RuntimeError, match="another layout"):  # same bytes, 3 layers
            HostKVPool(3, 32, (2,), torch.float32, 4, shared_name=name, create=False)
        with pytest.raises(FileNotFoundError, match="another size"):
            HostKVPool(2, 64, (3,), torch.float32, 4, shared_name=name, create=False)
    finally:
        pool0.unlink()
    assert not os.path.exists(f"/dev/shm/ascend_offload_{name}")
    with pytest.raises(FileNotFoundError, match="rank 0"):
        HostKVPool(2, 32, (3,), torch.float32, 4, shared_name=name, create=False)


def test_shared_pool_rank0_ends_a_step_only_after_every_reader() -> None:
    """Rows freed at a step boundary are reused only once a lagging reader finished the step."""
    name = f"test_{uuid.uuid4().hex[:8]}"
    pool0 = HostKVPool(2, 32, (3,), torch.float32, 4, shared_name=name, create=True)
    try:
        pool1 = HostKVPool(2, 32, (3,), torch.float32, 4, shared_name=name, create=False)
        m0 = _mgr(pool=pool0, tp_rank=0, fence_timeout_s=0.05)
        m0.admit("a", 8)
        m0.begin_step([StepEntry("a", 4, 4)])
        m0.end_step()  # no reader attached yet: nothing to wait for
        m1 = _mgr(pool=pool1, tp_rank=1, fence_timeout_s=0.05)
        m1.admit("a", 8)
        for m in (m0, m1):
            m.begin_step([StepEntry("a", 4, 4)])
        m1._step_no = m0._step_no  # the reader replays the same steps (it joined late here)
        with pytest.raises(PoolFenceTimeout, match=r"\(1, 0\)"):
            m0.end_step()  # rank 1 has not finished this step's reads
        m1.end_step()
        m0.end_step()
    finally:
        pool0.unlink()


def test_remote_d2h_runs_coalesce_adjacent_blocks() -> None:
    pool = HostKVPool(3, 64, (2,), torch.float16, 8)
    pool.admit("x", 8)  # block 0
    pool.admit("a", 30)  # blocks 1..4
    pool.release("x")
    pool.admit("b", 8)  # takes block 0 back
    assert pool.runs("a", 0, 30) == [(0, 8, 30)]  # one contiguous range
    assert pool.runs("a", 5, 12) == [(5, 13, 7)]
    pool.release("a")
    pool.admit("c", 20)  # lowest free: 1, 2, 3
    assert pool.runs("c", 0, 20) == [(0, 8, 20)]
    pool.release("b")
    pool.admit("d", 24)  # blocks 0, 4, 5: two runs
    assert pool.runs("d", 0, 24) == [(0, 0, 8), (8, 32, 16)]
    with pytest.raises(IndexError, match="outside"):
        pool.runs("d", 0, 25)
    addr, nbytes = pool.layer_region(2)
    assert nbytes == 64 * 2 * 2 and addr == pool.kv[2].data_ptr()


def test_manager_refuses_requests_beyond_the_residency_positions() -> None:
    """A request longer than the native table can index fails at admission, not mid-decode."""
    if not native.available():
        pytest.skip("native library unavailable")
    cfg = SparseOffloadConfig(enabled=True, topk_buffer_size=65536 - 8, index_topk=64,
                              use_native="on")
    m = SparseOffloadManager(cfg, num_layers=1, row_shape=(1,), dtype=torch.float32,
                             block_size=8, max_requests=1, pool_rows=70000)
    with pytest.raises(PoolCapacityError, match="max_tokens=65537 exceeds the 65536 positions"):
        m.admit("long", 65537)
    assert m.active_requests == [] and m.admit("ok", 65536) == 0


@pytest.mark.parametrize("chunk", [1, 7, 64, 65, 300])
def test_new_kv_rows_same_through_small_and_bulk_paths(chunk: int) -> None:
    """A decode step's few tokens map to host rows in Python, a prefill-sized write
    through torch ops: both must put every row in the same place, and both must
    reject a position outside the step batch naming it."""
    cfg = SparseOffloadConfig(enabled=True, topk_buffer_size=8, index_topk=4)
    m = SparseOffloadManager(cfg, num_layers=1, row_shape=(2,), dtype=torch.float32,
                             block_size=4, max_requests=2, pool_rows=1024)
    m.admit("a", 300)
    m.admit("b", 120)
    m.begin_step([StepEntry("a", 300, 300), StepEntry("b", 120, 120)])
    pos = torch.tensor([[0, p] for p in range(300)] + [[1, p] for p in range(120)])
    kv = torch.arange(pos.shape[0] * 2, dtype=torch.float32).view(-1, 2)
    for i in range(0, pos.shape[0], chunk):
        m.offload_new_kv(0, kv[i:i + chunk], pos[i:i + chunk])
    for (b, p), row in zip(pos.tolist(), kv, strict=True):
        req = ("a", "b")[b]
        host = m.pool.rows_for(req, torch.tensor([p]))
        assert torch.equal(m.pool.layer(0)[host[0]], row), (req, p)
    bad = pos[:chunk].clone()
    bad[-1] = torch.tensor([1, 120])
    with pytest.raises(IndexError, match="position 120 of batch entry 1"):
        m.offload_new_kv(0, kv[: bad.shape[0]], bad)
    bad[-1] = torch.tensor([2, 0])
    with pytest.raises(IndexError, match="batch index outside the step batch"):
        m.offload_new_kv(0, kv[: bad.shape[0]], bad)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_manager_builds_the_configured_policy(policy: str) -> None:
    """``residency_policy`` reaches the residency table the manager resolves with."""
    for use_native in ("auto", "off"):
        cfg = SparseOffloadConfig(enabled=True, topk_buffer_size=8, index_topk=4,
                                  use_native=use_native, residency_policy=policy)
        m = SparseOffloadManager(cfg, num_layers=2, row_shape=(3,), dtype=torch.float32,
                                 block_size=4, max_requests=2, pool_rows=32)
        assert m.residency.policy == policy
