"""Decode-side prefix caching with sparse offload, without vLLM: the pool's reference
counts, the ledger's shared blocks, the scheduler's index (pins, LRU, capacity, reset)
and the worker's entries driven through the real colocated decode (rows shared, not
copied; indexer rows back bit for bit; hot-buffer state not shared)."""

from __future__ import annotations

import pytest
import torch

from ascend_offload.config import SparseOffloadConfig
from ascend_offload.sparse.adapter import BatchRow
from ascend_offload.sparse.admission import PoolLedger
from ascend_offload.sparse.colocated import ColocatedSparseDecode
from ascend_offload.sparse.manager import SparseOffloadManager
from ascend_offload.sparse.pools import HostKVPool, PoolCapacityError
from ascend_offload.sparse.prefix_cache import (
    EvictOrder,
    KeepOrder,
    PrefixBlocks,
    PrefixHit,
    PrefixIndex,
)

BS = 4
ROW = 3
TOPK = 4
HOT = 8


def _h(*ids: int) -> list[bytes]:
    return [bytes([i]) * 4 for i in ids]


# --------------------------------------------------------------------------- pool, ledger


def test_pool_blocks_are_shared_by_reference_and_freed_by_their_last_holder() -> None:
    pool = HostKVPool(1, 8 * BS, (ROW,), torch.float32, BS)
    pool.admit("a", 3 * BS)
    a = list(pool.block_list("a"))
    pool.retain(a[0])
    pool.retain(a[1])
    pool.release("a")
    assert pool.free_blocks == 6 and pool.refs(a[0]) == 1 and pool.refs(a[2]) == 0
    table = pool.admit("b", 4 * BS, shared=a[:2]).tolist()
    assert table[:2] == a[:2] and pool.free_blocks == 4  # only two blocks taken
    assert pool.rows_for("b", torch.tensor([0, 5])).tolist() == [a[0] * BS, a[1] * BS + 1]
    pool.drop(a[0])  # the cache lets go; b still holds it
    assert pool.refs(a[0]) == 1 and pool.free_blocks == 4
    pool.release("b")
    pool.drop(a[1])
    assert pool.free_blocks == 8
    with pytest.raises(KeyError, match="held by nobody"):
        pool.admit("c", 2 * BS, shared=[a[0]])
    with pytest.raises(KeyError, match="held by nobody"):
        pool.retain(a[0])
    pool.admit("big", 7 * BS)
    pool.retain(pool.block_list("big")[0])
    with pytest.raises(PoolCapacityError, match="2 blocks"):
        pool.admit("d", 3 * BS, shared=[pool.block_list("big")[0]])


def test_ledger_counts_shared_blocks_once() -> None:
    led = PoolLedger(10, BS)
    assert led.reserve("a", 4 * BS)
    led.to_cache("a", 3)
    led.release("a")
    assert led.cached == 3 and led.free_blocks == 7
    assert led.reserve("b", 9 * BS, shared=2)  # 7 own + 2 of the cache's
    assert led.free_blocks == 0 and not led.reserve("c", BS)
    led.uncache(1)  # an unpinned entry evicted
    assert led.free_blocks == 1
    with pytest.raises(ValueError, match="to cache"):
        led.to_cache("b", 8)


# --------------------------------------------------------------------------- scheduler index


def test_match_keeps_one_token_to_compute_and_stops_at_the_first_miss() -> None:
    idx = PrefixIndex(8, BS)
    idx.keep("a", _h(1, 2, 3), [10, 11, 12])
    assert idx.match(_h(1, 2, 3, 4), 4 * BS) == tuple(_h(1, 2, 3))
    assert idx.match(_h(1, 2, 3), 3 * BS) == tuple(_h(1, 2))  # prompt of exactly 3 blocks
    assert idx.match(_h(1, 9, 3), 4 * BS) == tuple(_h(1))
    assert idx.match(_h(9, 2), 4 * BS) == ()
    ops = idx.take_ops()
    assert ops == (KeepOrder("a", ((0, _h(1)[0]), (1, _h(2)[0]), (2, _h(3)[0])), (10, 11, 12)),)
    assert idx.take_ops() == ()


def test_keep_skips_cached_blocks_and_evicts_unpinned_chains_from_their_tail() -> None:
    idx = PrefixIndex(4, BS)
    assert idx.keep("a", _h(1, 2, 3), [0, 1, 2]) == (3, 0)
    assert idx.keep("b", _h(1, 2, 5), [7, 8, 9]) == (1, 0)  # only block 2 is new
    assert idx.take_ops()[1] == KeepOrder("b", ((2, _h(5)[0]),), (9,))
    idx.pin("r", _h(1, 2))
    # full: the new entry evicts the least recently used unpinned one, a chain's tail first
    assert idx.keep("c", _h(7), [4]) == (1, 1)
    assert idx.take_ops()[0] == EvictOrder(tuple(_h(3)))
    # pinned entries are never evicted: with every other entry pinned, nothing is kept
    idx.pin("s", _h(1, 2, 5))
    idx.pin("t", _h(7))
    assert idx.keep("d", _h(8), [5]) == (0, 0) and idx.full_skips == 1
    assert idx.evictable_except() == 0 and idx.evict(3) == 0
    idx.unpin("s")
    assert idx.evictable_except() == 1 and idx.evictable_except(_h(5)) == 0
    assert idx.evict(3, protect=_h(5)) == 0 and idx.evict(3) == 1
    with pytest.raises(KeyError, match="not cached"):
        idx.pin("u", _h(5))


def test_reset_forgets_every_entry_and_drops_pinned_ones_when_unused() -> None:
    idx = PrefixIndex(8, BS)
    idx.keep("a", _h(1, 2), [0, 1])
    idx.pin("r", _h(1))
    idx.take_ops()
    assert idx.reset() == 1  # block 2 now; block 1 is in use
    assert idx.match(_h(1, 2), 9 * BS) == () and len(idx) == 1
    assert idx.take_ops() == (EvictOrder(tuple(_h(2))),)
    # a request finishing with the doomed block does not cache it again
    assert idx.keep("r", _h(1), [3]) == (0, 0)
    assert idx.unpin("r") == 1 and len(idx) == 0
    assert idx.take_ops() == (EvictOrder(tuple(_h(1))),)


def test_unpin_can_keep_the_blocks_vllm_took() -> None:
    idx = PrefixIndex(8, BS)
    idx.keep("a", _h(1, 2, 3), [0, 1, 2])
    idx.pin("r", _h(1, 2, 3))
    idx.unpin("r", keep=1)
    assert idx.pinned("r") == tuple(_h(1)) and idx.evictable_except() == 2


# --------------------------------------------------------------------------- worker, end to end


class _Engine:
    """A colocated decode with one indexer cache of 16 device blocks, the prefix cache on."""

    def __init__(self, capacity: int = 4, pool_rows: int = 16 * BS) -> None:
        cfg = SparseOffloadConfig(enabled=True, topk_buffer_size=HOT, index_topk=TOPK)
        mgr = SparseOffloadManager(cfg, num_layers=2, row_shape=(ROW,), dtype=torch.float32,
                                   block_size=BS, max_requests=2, index_topk=TOPK,
                                   pool_rows=pool_rows)
        self.indexer = torch.zeros(16, BS, 2)
        self.prefix = PrefixBlocks(mgr.pool, [self.indexer], capacity)
        self.d = ColocatedSparseDecode(mgr, ["l0", "l1"], prefix=self.prefix)
        self.step = 0

    def prefill(self, rid: str, kv: torch.Tensor, start: int, key: int) -> None:
        """Compute positions ``start..len(kv)`` of ``rid`` (all of them a prefill chunk)."""
        self.step += 1
        self.d.begin(self.step, {key: rid})
        n = kv.shape[0]
        self.d.plan_step([BatchRow(key, n, n - start)])
        pos = torch.tensor([[0, p] for p in range(start, n)])
        for layer in range(2):
            self.d.offload_new_kv(layer, kv[start:] + layer, pos)
        self.d.end_step()


def test_a_new_request_shares_cached_rows_and_gets_the_indexer_rows_back() -> None:
    e = _Engine()
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(11, ROW, generator=g)
    assert e.d.admit("a", 16)
    e.prefill("a", kv, 0, key=2)
    e.indexer[[5, 6]] = torch.randn(2, BS, 2, generator=g)  # a's indexer rows, blocks 5, 6
    want_indexer = e.indexer[[5, 6]].clone()
    a_blocks = list(e.d.manager.pool.block_list("a"))
    used = e.d.manager.pool_rows_used
    # a finishes: its two full blocks are kept (pool rows retained, not copied)
    e.d.apply_prefix([KeepOrder("a", ((0, b"x"), (1, b"y")), (5, 6))])
    e.d.finish("a")
    assert e.d.manager.pool_rows_used == 2 * BS and len(e.prefix) == 2 and used == 4 * BS
    e.indexer.zero_()  # vLLM reuses a's device blocks
    # b starts from both blocks: its table shares them, its new blocks get the indexer rows
    assert e.d.admit("b", 16, PrefixHit((b"x", b"y"), (9, 3)))
    assert e.d.manager.pool.block_list("b")[:2] == a_blocks[:2]
    assert e.d.manager.pool_rows_used == 4 * BS  # 2 shared + 2 own: shared rows count once
    assert torch.equal(e.indexer[[9, 3]], want_indexer) and e.d.pooled("b") == 2 * BS
    assert e.prefix.counters.loaded_blocks == 2 and not e.d.load_errors
    kv_b = torch.cat((kv[:8], torch.randn(3, ROW, generator=g)))
    e.prefill("b", kv_b, 8, key=7)  # computes only positions 8..10
    assert e.d.manager.stats.offload_rows == 2 * (11 + 3)
    # b's decode reads the shared rows from its own, empty hot buffer: all misses
    e.step += 1
    e.d.begin(e.step, {7: "b"})
    e.d.plan_step([BatchRow(7, 12, 1)])
    topk = torch.tensor([[0, 5, 7, 10]], dtype=torch.int32)
    misses = e.d.manager.stats.miss_rows
    for layer in range(2):
        e.d.offload_new_kv(layer, torch.zeros(1, ROW) + layer, torch.tensor([[0, 11]]))
        slots = e.d.onload_topk(layer, topk)
        got = e.d.hot_buffer(layer)[slots[0].long()]
        assert torch.equal(got, kv_b[[0, 5, 7, 10]] + layer)
    e.d.end_step()
    assert e.d.manager.stats.miss_rows - misses == 8
    # evicting the entries while b runs keeps b's rows; b's finish frees them
    e.d.apply_prefix([EvictOrder((b"x", b"y"))])
    assert e.d.manager.pool_rows_used == 4 * BS and len(e.prefix) == 0
    e.d.finish("b")
    assert e.d.manager.pool_rows_used == 0 and e.d.manager.pool.admitted() == []
    counters = e.d.counters()
    assert counters["prefix_kept_blocks"] == 2 and counters["prefix_evicted_blocks"] == 2


def test_a_hit_the_worker_cannot_serve_is_a_load_error_on_own_rows() -> None:
    e = _Engine()
    assert e.d.admit("a", 8)
    e.prefill("a", torch.ones(8, ROW), 0, key=1)
    e.d.apply_prefix([KeepOrder("a", ((0, b"x"),), (1,))])
    e.d.finish("a")
    # the second block was never kept here: it is recomputed into b's own rows
    assert e.d.admit("b", 16, PrefixHit((b"x", b"z"), (4, 8)))
    assert e.d.load_errors == {8} and e.d.pooled("b") == BS
    assert e.d.manager.pool.refs(e.d.manager.pool.block_list("b")[1]) == 1
    # a keep order for a request this worker does not hold is logged and left out
    e.d.apply_prefix([KeepOrder("ghost", ((0, b"g"),), (2,))])
    assert len(e.prefix) == 1
