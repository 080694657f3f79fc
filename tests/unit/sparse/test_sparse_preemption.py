"""Preemption of sparse-decode requests (vLLM-free halves): the scheduler's state
machine and stash budget, the worker's bounded indexer stash, and the request
bookkeeping that keeps pool rows and drops the hot row of a preempted request."""

from __future__ import annotations

import pytest
import torch

from ascend_offload.config import SparseOffloadConfig
from ascend_offload.sparse.adapter import BatchRow
from ascend_offload.sparse.colocated import ColocatedSparseDecode
from ascend_offload.sparse.manager import SparseOffloadManager
from ascend_offload.sparse.pools import PoolCapacityError
from ascend_offload.sparse.preemption import (
    IndexerStash,
    PreemptionBook,
    PreemptState,
    ResumeOrder,
    StashOrder,
)

BS = 4
S = PreemptState

# ----------------------------------------------------------------- scheduler state machine


def test_running_stashing_stashed_resuming_running() -> None:
    book = PreemptionBook(capacity_tokens=10 * BS, block_size=BS)
    book.scheduled("a", 9, ([5, 6, 7, 8],))  # after this step: positions 0..8 in blocks 5, 6, 7
    assert book.state("a") is S.RUNNING and book.offer("a", 11) == 0
    order = book.preempt("a")
    assert order == StashOrder(9, ((5, 6, 7),))  # the blocks holding positions 0..8 only
    assert book.state("a") is S.STASHING and book.used_tokens == 3 * BS
    assert book.offer("a", 11) == 0  # not offered before the workers got the order
    book.step_built()
    assert book.state("a") is S.STASHED
    assert book.offer("a", 11) == 9
    assert book.offer("a", 9) == 8  # vLLM computes at least one token
    assert book.offer("a", 11) == 9  # asking again (allocation failed) changes nothing
    assert book.after_alloc("a", 9) is True and book.state("a") is S.RESUMING
    order = book.resumed("a", ([1, 2, 3, 4],))
    assert order == ResumeOrder(9, ((1, 2, 3),))
    assert book.state("a") is S.RUNNING and book.used_tokens == 0 and len(book) == 0
    assert (book.stashed_requests, book.lost_requests) == (1, 0)


def test_budget_refuses_what_it_cannot_hold_and_those_requests_are_recomputed() -> None:
    book = PreemptionBook(capacity_tokens=5 * BS, block_size=BS)
    book.scheduled("a", 12, ([0, 1, 2, 3],))  # 3 blocks
    book.scheduled("b", 9, ([4, 5, 6],))  # 3 blocks: 6 > 5 with a
    book.scheduled("c", 8, ([7, 8],))  # 2 blocks: fits after a
    assert book.preempt("a").tokens == 12
    assert book.preempt("b") == StashOrder(0, ())
    assert book.state("b") is S.LOST
    assert book.preempt("c").tokens == 8
    assert book.used_tokens == 5 * BS  # never above the capacity
    book.step_built()
    assert book.offer("b", 10) == 0
    assert book.after_alloc("b", 0) is False
    assert book.resumed("b", ([9, 10, 11],)) == ResumeOrder(0, ())
    assert book.state("b") is S.RUNNING
    book.finish("a")  # aborted while stashed: its budget is free again
    assert book.used_tokens == 2 * BS and book.state("a") is S.RUNNING
    book.scheduled("d", 12, ([12, 13, 14],))
    assert book.preempt("d").tokens == 12
    assert (book.stashed_requests, book.lost_requests) == (3, 1)


def test_unknown_or_empty_requests_are_lost_and_a_zero_budget_stashes_nothing() -> None:
    book = PreemptionBook(capacity_tokens=0, block_size=BS)
    book.scheduled("a", 3, ([0],))
    assert book.preempt("a") == StashOrder(0, ()) and book.state("a") is S.LOST
    assert book.preempt("never-scheduled").tokens == 0
    book = PreemptionBook(capacity_tokens=8, block_size=BS)
    assert book.preempt("never-scheduled").tokens == 0
    with pytest.raises(ValueError):
        PreemptionBook(capacity_tokens=-1, block_size=BS)


def test_a_stashed_request_resumed_without_the_offer_is_recomputed_and_frees_its_budget() -> None:
    book = PreemptionBook(capacity_tokens=8 * BS, block_size=BS)
    book.scheduled("a", 6, ([0, 1],))
    book.preempt("a")
    book.step_built()
    # vLLM took fewer tokens than offered: only those are loaded
    assert book.after_alloc("a", 4) is True
    assert book.resumed("a", ([3, 4],)) == ResumeOrder(4, ((3,),))
    book.scheduled("b", 6, ([0, 1],))
    book.preempt("b")
    book.step_built()
    assert book.after_alloc("b", 0) is False and book.state("b") is S.LOST
    assert book.used_tokens == 0
    book.scheduled("c", 6, ([0, 1],))
    book.preempt("c")
    book.step_built()
    assert book.resumed("c", ([5, 6],)) == ResumeOrder(0, ())  # resumed without after_alloc
    assert book.used_tokens == 0 and book.lost_requests == 2


def test_a_request_preempted_again_stashes_its_new_progress() -> None:
    book = PreemptionBook(capacity_tokens=8 * BS, block_size=BS)
    book.scheduled("a", 5, ([0, 1],))
    book.preempt("a")
    book.step_built()
    book.after_alloc("a", 5)
    book.resumed("a", ([6, 7],))
    book.scheduled("a", 6, ([6, 7],))
    assert book.preempt("a") == StashOrder(6, ((6, 7),))
    assert book.used_tokens == 2 * BS


# ----------------------------------------------------------------- worker stash


def _caches(num_blocks: int = 12) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(num_blocks, BS, 5, generator=g), torch.randn(num_blocks, BS, 2, generator=g)]


def test_stash_round_trip_into_other_blocks_is_exact() -> None:
    caches = _caches()
    before = [c.clone() for c in caches]
    stash = IndexerStash(caches, [0, 0], BS, capacity_tokens=8 * BS)
    assert stash.block_bytes == BS * (5 + 2) * 4
    assert stash.save("a", StashOrder(7, ((3, 9),)))
    assert stash.bytes_held == 2 * stash.block_bytes and stash.holds("a")
    for c in caches:  # the freed blocks are reused by someone else
        c[[3, 9]] = -1.0
    assert stash.load("a", ResumeOrder(7, ((0, 5),))) == []
    for c, b in zip(caches, before, strict=True):
        assert torch.equal(c[0], b[3]) and torch.equal(c[5], b[9])
    assert stash.bytes_held == 0 and not stash.holds("a")
    c = stash.counters
    assert (c.preempted_requests, c.stashed_tokens, c.resumed_tokens, c.stash_failures) == (1, 7, 7, 0)
    assert c.stash_ns > 0


def test_stash_budget_is_bounded_and_a_refused_request_is_counted() -> None:
    caches = _caches()
    stash = IndexerStash(caches, [0, 0], BS, capacity_tokens=3 * BS)
    assert stash.capacity_bytes == 3 * stash.block_bytes
    assert stash.save("a", StashOrder(8, ((1, 2),)))
    assert not stash.save("b", StashOrder(5, ((4, 5),)))  # 2 more blocks: over the budget
    assert stash.bytes_held == 2 * stash.block_bytes <= stash.capacity_bytes
    assert stash.counters.stash_failures == 1 and not stash.holds("b")
    assert stash.save("c", StashOrder(3, ((6,),)))
    assert stash.bytes_held == stash.capacity_bytes
    stash.drop("a")
    assert stash.bytes_held == stash.block_bytes
    assert not stash.save("d", StashOrder(9, ((1, 2),)))  # the order names too few blocks
    assert stash.counters.stash_failures == 2


def test_a_stash_without_indexer_caches_refuses_and_counts() -> None:
    stash = IndexerStash([], [], BS, capacity_tokens=0)
    assert not stash.save("a", StashOrder(0, ()))  # nothing to stash: not a failure
    assert not stash.save("b", StashOrder(5, ((1, 2),)))
    assert stash.counters.stash_failures == 1 and stash.counters.preempted_requests == 2


def test_load_without_a_stash_reports_the_blocks_to_recompute() -> None:
    stash = IndexerStash(_caches(), [0, 0], BS, capacity_tokens=8 * BS)
    assert stash.load("x", ResumeOrder(6, ((4, 7),))) == [4, 7]
    stash.save("y", StashOrder(3, ((1,),)))
    assert stash.load("y", ResumeOrder(6, ((4, 7),))) == [4, 7]  # fewer stashed than to load
    assert stash.bytes_held == 0 and stash.counters.resumed_tokens == 0


def test_caches_in_different_groups_use_their_groups_blocks() -> None:
    caches = _caches()
    before = [c.clone() for c in caches]
    stash = IndexerStash(caches, [0, 1], BS, capacity_tokens=8 * BS)
    assert stash.save("a", StashOrder(4, ((2,), (8,))))
    assert stash.load("a", ResumeOrder(4, ((10,), (11,)))) == []
    assert torch.equal(caches[0][10], before[0][2]) and torch.equal(caches[1][11], before[1][8])


# ----------------------------------------------------------------- request bookkeeping


def _decode(stash: IndexerStash | None = None, max_requests: int = 1) -> ColocatedSparseDecode:
    cfg = SparseOffloadConfig(enabled=True, topk_buffer_size=8, index_topk=4)
    mgr = SparseOffloadManager(cfg, num_layers=1, row_shape=(3,), dtype=torch.float32,
                               block_size=BS, max_requests=max_requests, index_topk=4,
                               pool_rows=64)
    return ColocatedSparseDecode(mgr, ["l.0.attn"], stash)


def test_preempted_request_keeps_pool_rows_frees_its_hot_row_and_resumes_where_it_was() -> None:
    caches = _caches()
    d = _decode(IndexerStash(caches[:1], [0], BS, capacity_tokens=16 * BS))
    assert d.admit("a", 20)
    d.begin("s1", {2: "a"})
    d.plan_step([BatchRow(2, 9, 9)])
    d.end_step()
    rows = d.manager.pool.block_list("a")
    assert d.preempt("a", StashOrder(9, ((0, 1, 2),)))
    # the one hot row is free for another request; a's pool rows are untouched
    assert d.admit("b", 8) and d.manager.pool.block_list("a") == rows and d.pooled("a") == 9
    d.finish("b")
    assert d.resume("a", ResumeOrder(9, ((5, 6, 7),))) == []
    d.begin("s2", {7: "a"})
    plan = d.plan_step([BatchRow(7, 10, 1)])
    assert plan.offload_from == (9,) and plan.decode == (True,)  # no history rewritten
    d.end_step()
    c = d.counters()
    assert (c["preempted_requests"], c["resumed_tokens"], c["recomputed_tokens"]) == (1, 9, 0)
    assert d.gauges()["stash_bytes"] == 0


def test_a_lost_request_is_recomputed_and_counted() -> None:
    d = _decode()
    assert d.admit("a", 20)
    d.begin("s1", {2: "a"})
    d.plan_step([BatchRow(2, 9, 9)])
    d.end_step()
    assert d.preempt("a", StashOrder(0, ())) is False
    with pytest.raises(KeyError, match="not admitted"):  # no hot row until resumed
        d.begin("s2", {2: "a"})
        d.plan_step([BatchRow(2, 6, 6)])
    d.end_step()
    d.resume("a", ResumeOrder(0, ()))
    for step, (n, new) in enumerate([(6, 6), (10, 4)]):  # recompute in two chunks, then beyond
        d.begin(("r", step), {2: "a"})
        assert d.plan_step([BatchRow(2, n, new)]).offload_from == (n - new,)
        d.end_step()
    assert d.counters()["recomputed_tokens"] == 9
    assert d.counters()["preempted_requests"] == 1


def test_finishing_a_preempted_request_frees_its_pool_rows_and_stash() -> None:
    caches = _caches()
    d = _decode(IndexerStash(caches[:1], [0], BS, capacity_tokens=16 * BS))
    free = d.manager.pool.free_blocks
    assert d.admit("a", 20)
    d.begin("s1", {2: "a"})
    d.plan_step([BatchRow(2, 5, 5)])
    d.end_step()
    d.preempt("a", StashOrder(5, ((0, 1),)))
    assert d.stash.bytes_held > 0
    d.finish("a")
    assert d.manager.pool.free_blocks == free and d.stash.bytes_held == 0
    assert d.admitted == [] and d.manager.active_requests == []
    with pytest.raises(PoolCapacityError):  # the hot row count is still one
        d.manager.admit("x", 4)
        d.manager.admit("y", 4)
