"""Hybrid residency: where resident rows sit in borrowed indexer blocks, the scheduler's
placement / growth / pressure decisions over vLLM's real block pool, and the worker's
data path (resident rows written and attended in place, moved to the pool bit for bit,
nothing outside the borrowed blocks touched)."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.core.block_pool import BlockPool

from ascend_offload.config import SparseOffloadConfig
from ascend_offload.connectors.sparse_decode.scheduler import PoolBlocks
from ascend_offload.sparse.adapter import BatchRow
from ascend_offload.sparse.colocated import ColocatedSparseDecode
from ascend_offload.sparse.hybrid import (
    AreaGeometry,
    GrowOp,
    MoveOp,
    ResidentArea,
    ResidentBook,
    area_views,
)
from ascend_offload.sparse.manager import SparseOffloadManager

ROW = 5  # main-KV row: 20 B in float32
IDX = 8  # indexer row: 32 B; page of BS = 4 tokens: 128 B -> 5 or 6 main rows
BS = 4
NB = 16
GEO = AreaGeometry(block_stride=BS * IDX * 4, page=BS * IDX * 4, row_bytes=ROW * 4)


def test_rows_lie_wholly_inside_their_block_and_never_overlap() -> None:
    seen: set[int] = set()
    for b in range(NB):
        rows = GEO.rows_of(b)
        assert len(rows) in (GEO.min_rows, GEO.min_rows + 1)
        for r in rows:
            lo, hi = r * GEO.row_bytes, (r + 1) * GEO.row_bytes
            assert b * GEO.block_stride <= lo and hi <= b * GEO.block_stride + GEO.page
        assert not seen & set(rows)
        seen |= set(rows)
    # a page with a gap to the next block (block-outermost layouts): rows stay in the page
    gap = AreaGeometry(block_stride=200, page=128, row_bytes=20)
    assert all(b * 200 <= r * 20 and (r + 1) * 20 <= b * 200 + 128
               for b in range(8) for r in gap.rows_of(b))
    with pytest.raises(ValueError, match="cannot hold two main-KV rows"):
        ResidentBook(AreaGeometry(64, 64, 40), PoolBlocks(BlockPool(8, False, BS)), keep_free=0)


def _book(blocks: int = NB, keep_free: int = 2, max_resident: int = 0
          ) -> tuple[ResidentBook, BlockPool]:
    pool = BlockPool(blocks, False, BS)
    return ResidentBook(GEO, PoolBlocks(pool), keep_free=keep_free,
                        max_resident=max_resident), pool


def test_placement_borrows_only_spare_blocks_and_returns_them() -> None:
    book, pool = _book()
    free0 = pool.get_num_free_blocks()  # 15: block 0 is vLLM's null block
    assert book.place("a", 12)  # 12 rows: 3 blocks of 5-6 rows
    ops = book.take_ops()
    assert [type(o) for o in ops] == [GrowOp] and ops[0].req_id == "a"
    assert sum(len(GEO.rows_of(b)) for b in ops[0].blocks) >= 12
    assert pool.get_num_free_blocks() == free0 - len(ops[0].blocks) == free0 - book.borrowed
    assert all(pool.blocks[b].ref_cnt == 1 for b in ops[0].blocks)  # vLLM will not hand them out
    # what is left after keep_free cannot hold 60 rows: not resident, nothing moved
    assert not book.place("b", 60)
    assert book.take_ops() == () and not book.holds("b")
    book.release("a")
    assert pool.get_num_free_blocks() == free0 and book.borrowed == 0 and len(book) == 0
    limited, _ = _book(max_resident=1)
    assert limited.place("a", 4) and not limited.place("b", 4)  # hybrid_max_resident


def test_growth_moves_the_longest_running_resident_first_then_itself() -> None:
    book, pool = _book(keep_free=0)  # 15 free blocks, ~5.5 rows each
    assert book.place("old", 30) and book.place("new", 30)
    book.take_ops()
    # "new" grows past what is spare: "old" (placed first) moves, its blocks go to "new"
    assert book.grow("new", 60)
    ops = book.take_ops()
    assert MoveOp("old") in ops and not book.holds("old") and book.holds("new")
    grown = [o for o in ops if isinstance(o, GrowOp)]
    assert sum(len(GEO.rows_of(b)) for o in grown for b in o.blocks) > 0
    # the move precedes the growth that reuses its blocks (workers replay in order)
    assert ops.index(MoveOp("old")) < ops.index(grown[-1])
    # no one older left: growing beyond every block moves the request itself
    assert not book.grow("new", 200)
    assert book.take_ops()[-1] == MoveOp("new")
    assert pool.get_num_free_blocks() == 15 and book.counters.moved_requests == 2


def test_pressure_moves_residents_until_vllm_has_what_it_asked_for() -> None:
    book, pool = _book(keep_free=2)
    assert not book.want(4)  # nothing resident: vLLM preempts or waits as usual
    for rid in ("a", "b", "c"):
        assert book.place(rid, 16)
    book.take_ops()
    free = pool.get_num_free_blocks()
    assert book.want(free - 2 + 1)  # one block more than is free beyond keep_free
    book.relieve()
    assert book.take_ops() == (MoveOp("a"),)  # the longest-running one, and only it
    assert pool.get_num_free_blocks() >= 2 + free - 2 + 1
    assert book.counters.pressure_events == 1
    book.relieve()  # no demand: nothing moves
    assert book.take_ops() == ()


ITEM = 4  # float32


def _colocated(hybrid: bool = True) -> tuple[ColocatedSparseDecode, torch.Tensor]:
    """Two layers; the indexer caches are one real tensor ``[layers, NB, BS, IDX]``."""
    idx = torch.full((2, NB, BS, IDX), -7.0)
    area = ResidentArea(area_views([idx[0], idx[1]], GEO, NB, torch.float32, ROW), GEO) \
        if hybrid else None
    cfg = SparseOffloadConfig(enabled=True, topk_buffer_size=8, index_topk=4)
    mgr = SparseOffloadManager(cfg, num_layers=2, row_shape=(ROW,), dtype=torch.float32,
                               block_size=BS, max_requests=2, index_topk=4, pool_rows=64, area=area)
    return ColocatedSparseDecode(mgr, ["l.0", "l.1"]), idx


def _kv(layer: int, positions: range, req: int) -> torch.Tensor:
    return torch.stack([torch.full((ROW,), 1000.0 * req + 100 * layer + p) for p in positions])


def test_resident_rows_are_written_and_attended_in_place_then_moved_bit_for_bit() -> None:
    d, idx = _colocated()
    before = idx.clone()
    assert d.admit("r", 16) and d.admit("o", 16)
    d.apply_hybrid([GrowOp("r", (3, 9))])  # two borrowed blocks: 11 rows
    assert d.resident("r") and not d.resident("o")
    area = d.manager.area
    assert area is not None and area.capacity("r") == len(GEO.rows_of(3)) + len(GEO.rows_of(9))
    # step 1: both prefill 6 tokens
    d.begin(1, {11: "r", 12: "o"})
    plan = d.plan_step([BatchRow(11, 6, 6), BatchRow(12, 6, 6)])
    assert plan.decode == (False, False)
    pos = torch.tensor([[b, p] for b in (0, 1) for p in range(6)])
    for layer in (0, 1):
        kv = torch.cat([_kv(layer, range(6), 1), _kv(layer, range(6), 2)])
        d.offload_new_kv(layer, kv, pos)
        store, rows = d.context_rows(layer, 0, torch.tensor([[0, 5, -1]]))
        assert store.data_ptr() == area.view(layer).data_ptr()  # the device rows, not the pool
        assert torch.equal(store[rows[0, :2]], _kv(layer, range(0, 6, 5), 1))
        assert int(rows[0, 2]) == -1
        store, rows = d.context_rows(layer, 1, torch.tensor([[0, 5]]))
        assert torch.equal(store[rows[0]], _kv(layer, range(0, 6, 5), 2))  # the pool's rows
    d.end_step()
    st = d.manager.stats
    assert st.resident_rows == 12 and st.offload_rows == 12
    assert st.resident_query_tokens == 2 and st.pool_query_tokens == 2
    # step 2: one decode token each; the resident row attends over its device rows, only
    # the offloaded one goes through the hot buffer
    d.begin(2, {11: "r", 12: "o"})
    plan = d.plan_step([BatchRow(11, 7, 1), BatchRow(12, 7, 1)])
    assert plan.decode == (False, True)
    pos = torch.tensor([[0, 6], [1, 6]])
    for layer in (0, 1):
        d.offload_new_kv(layer, torch.cat([_kv(layer, range(6, 7), 1), _kv(layer, range(6, 7), 2)]),
                         pos)
        topk = torch.tensor([[-1, -1, -1, -1], [0, 3, 6, -1]], dtype=torch.int32)
        slots = d.onload_topk(layer, topk)
        assert torch.equal(d.hot_buffer(layer)[slots[1, :3].long()],
                           _kv(layer, range(0, 7, 3), 2))
        assert (slots[0] == -1).all()
    d.end_step()
    assert d.manager.stats.miss_rows == 6  # the offloaded request's 3 positions x 2 layers
    # only the borrowed blocks' rows changed in the indexer caches
    mask = torch.zeros(NB, dtype=torch.bool)
    mask[[3, 9]] = True
    assert torch.equal(idx[:, ~mask], before[:, ~mask])
    # the move: the pool gets the 7 resident rows of every layer, bit for bit
    d.apply_hybrid([MoveOp("r")])
    assert not d.resident("r") and d.moved_requests == 1
    assert d.manager.stats.moved_bytes == 7 * 2 * ROW * ITEM
    for layer in (0, 1):
        table = d.manager.pool.block_list("r")
        rows = [table[p // BS] * BS + p % BS for p in range(7)]
        assert torch.equal(d.manager.pool.layer(layer)[rows], _kv(layer, range(7), 1))
    # from now on it decodes from the pool through the hot buffer
    d.begin(3, {11: "r"})
    assert d.plan_step([BatchRow(11, 8, 1)]).decode == (True,)
    d.end_step()
    d.finish("r")
    d.finish("o")
    assert d.gauges()["resident_requests"] == 0 and d.manager.pool_rows_used == 0


def test_a_resident_row_beyond_its_rows_is_an_error_naming_the_request() -> None:
    d, _ = _colocated()
    assert d.admit("r", 16)
    d.apply_hybrid([GrowOp("r", (2,))])
    d.begin(1, {5: "r"})
    with pytest.raises(RuntimeError, match=r"request 'r' is resident with \d+ device rows"):
        d.plan_step([BatchRow(5, 12, 12)])
    d.finish("r")
    assert len(d.manager.area or ()) == 0


def test_hybrid_orders_without_an_area_are_logged_not_applied(caplog: pytest.LogCaptureFixture) -> None:
    d, _ = _colocated(hybrid=False)
    d.apply_hybrid([GrowOp("r", (1,))])
    assert "hybrid residency is off" in caplog.text and not d.resident("r")


def test_area_views_refuse_a_layout_the_scheduler_did_not_plan() -> None:
    idx = torch.zeros(NB, BS, IDX)
    with pytest.raises(ValueError, match="the scheduler planned 256 B every"):
        area_views([idx], AreaGeometry(GEO.block_stride, 256, GEO.row_bytes), NB, torch.float32, ROW)
    with pytest.raises(ValueError, match="main-KV rows of 24 B"):
        area_views([idx], GEO, NB, torch.float32, 6)
    (view,) = area_views([idx], GEO, NB, torch.float32, ROW)
    assert view.untyped_storage().data_ptr() == idx.untyped_storage().data_ptr()
    assert view.shape == (GEO.span_rows(NB), ROW)


def test_the_resident_layer_path_compiles_as_one_graph() -> None:
    """What a resident request does per layer (new rows in, selected rows out, attention
    input gathered) is tensor ops only: ``fullgraph=True`` raises on any graph break."""
    from ascend_offload.sparse.hybrid import resident_slots, write_resident

    def layer(view: torch.Tensor, rows: torch.Tensor, dst: torch.Tensor, new: torch.Tensor,
              topk: torch.Tensor) -> torch.Tensor:
        write_resident(view, dst, new)
        slots = resident_slots(rows, topk)
        return view.index_select(0, slots.clamp(min=0).flatten()).view(*slots.shape, -1)

    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    idx = torch.zeros(NB, BS, IDX)
    (view,) = area_views([idx], GEO, NB, torch.float32, ROW)
    area = ResidentArea([view], GEO)
    area.grow("a", [2, 7])
    rows, table = area.rows("a"), area.table("a")
    assert rows.tolist() == [r for b in (2, 7) for r in GEO.rows_of(b)]
    new = torch.randn(2, ROW)
    topk = torch.tensor([[0, 3, 9, -1]])
    assert resident_slots(table, topk).tolist() == [[int(rows[0]), int(rows[3]), int(rows[9]), -1]]
    out = compiled(view, table, rows[[8, 9]], new, topk)
    assert torch.equal(out[0, 2], new[1]) and torch.equal(view[rows[8]], new[0])
    eager_view = torch.zeros_like(view)
    eager_view.copy_(view)
    assert torch.equal(out, layer(eager_view, table, rows[[8, 9]], new, topk))


def test_a_resident_table_ends_in_minus_one_at_every_size() -> None:
    """The table grows in place (doubling) and every entry past the request's rows is
    -1, the last one included, so a -1 padded position gathers -1 at any size."""
    from ascend_offload.sparse.hybrid import resident_slots

    idx = torch.zeros(NB, BS, IDX)
    area = ResidentArea(area_views([idx], GEO, NB, torch.float32, ROW), GEO)
    want: list[int] = []
    for b in range(NB):
        area.grow("a", [b])
        want.extend(GEO.rows_of(b))
        table = area.table("a")
        assert table.numel() > len(want) and table[: len(want)].tolist() == want
        assert bool((table[len(want):] == -1).all())
        pos = torch.tensor([len(want) - 1, -1, 0])
        assert resident_slots(table, pos).tolist() == [want[-1], -1, want[0]]


def test_a_pinned_pull_is_never_moved_and_an_unplaced_one_never_placed() -> None:
    """Remote-D2H: a request placed for its pull stays (a read may write its rows) until
    the workers attached it; one that did not fit lands in the pool for good."""
    book, pool = _book(keep_free=2)
    assert book.place("pulled", 16, pinned=True) and book.pinned == {"pulled"}
    assert not book.want(4)  # only pinned residents: vLLM preempts or waits as usual
    assert book.place("local", 8)
    book.take_ops()
    assert book.want(pool.get_num_free_blocks())
    book.relieve()
    assert book.take_ops() == (MoveOp("local"),) and book.holds("pulled")  # not the pinned one
    book.move("pulled")
    assert book.holds("pulled") and book.take_ops() == ()
    book.unpin("pulled")
    book.move("pulled")
    assert not book.holds("pulled") and book.take_ops() == (MoveOp("pulled"),)
    assert not book.place("big", 10**4, pinned=True) and not book.placeable("big")
    assert not book.place("big", 4)  # its prompt landed in the pool
    book.forgo("cached")
    assert not book.place("cached", 4)
    book.release("big")
    assert book.placeable("big")
