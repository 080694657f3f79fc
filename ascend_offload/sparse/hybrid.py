"""Hybrid residency: a request's main KV stays on the device while memory suffices.

Sparse decode offload keeps every request's main KV in the host pool, so even a
lone request pays the per-layer resolve and miss copies. With ``hybrid`` on, a
request's main-KV rows instead live in device blocks *borrowed from vLLM's own free
KV blocks*, and attention reads them directly (no resolve, no miss copy). When vLLM
needs its blocks back (a waiting request does not fit, a running one cannot grow,
or fewer than ``hybrid_free_fraction`` of the blocks are free), the longest-running
resident requests move to the host pool (their rows copied device -> host once) and
decode from the hot buffers from then on.

Why borrowed blocks and not a region of our own: vLLM's pool is the one budget that
already adapts to the load. A fixed region would take device memory from the indexer
cache even when the batch is large, losing the admission gain of the cut; borrowed
blocks are only the ones nobody uses, and go back as soon as vLLM needs them.

Where the rows sit: a borrowed block id ``b`` owns one page in every indexer layer
(the cut leaves only indexer layers in vLLM's groups). Main-KV layer ``i`` keeps its
rows in indexer layer ``i``'s page of ``b``, as whole rows of ``row_bytes`` at a
fixed row pitch from the start of that layer's blocks (:class:`AreaGeometry`), so
every layer uses the same row numbers and a layer's rows are one 2-D view, like the
hot buffer. A page holds ``page // row_bytes`` rows or one fewer (a row never spans
two blocks).

Two halves, neither imports vLLM: :class:`ResidentBook` (scheduler: decides, borrows
and returns blocks through a :class:`BlockSource`) and :class:`ResidentArea`
(worker: turns the decisions, replayed in order, into row tables and copies).
Requests keep their host pool reservation while resident, so a move never fails for
lack of pool rows and admission stays the pool ledger's.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, KeysView, Sequence
from typing import Protocol

import torch

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class AreaGeometry:
    """How main-KV rows fit into borrowed indexer blocks (same for every layer)."""

    block_stride: int  # bytes from one indexer block of a layer to the next
    page: int  # bytes of a block's indexer page in that layer
    row_bytes: int  # one token's main-KV row

    def rows_of(self, block: int) -> range:
        """The row numbers (in units of ``row_bytes`` from the layer's block 0) lying
        wholly inside ``block``'s page."""
        start = -(-block * self.block_stride // self.row_bytes)
        end = (block * self.block_stride + self.page) // self.row_bytes
        return range(start, max(start, end))

    @property
    def min_rows(self) -> int:
        """The fewest rows any block holds."""
        return max(0, self.page // self.row_bytes - 1)

    def span_rows(self, num_blocks: int) -> int:
        """Rows a layer view must reach to cover every block."""
        return self.rows_of(num_blocks - 1).stop if num_blocks else 0


class BlockSource(Protocol):
    """Free device blocks to borrow (vLLM's block pool, through the connector)."""

    def num_free(self) -> int: ...

    def take(self) -> int:
        """Borrow one free block; its id."""
        ...

    def give(self, blocks: Sequence[int]) -> None:
        """Return borrowed blocks."""
        ...


@dataclasses.dataclass(frozen=True)
class GrowOp:
    """``blocks`` join the request's resident rows (in order)."""

    req_id: str
    blocks: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class MoveOp:
    """The request's resident rows go to its host pool rows; it decodes from the pool."""

    req_id: str


HybridOp = GrowOp | MoveOp


@dataclasses.dataclass
class HybridCounters:
    placed_requests: int = 0  # requests that started resident
    moved_requests: int = 0  # resident requests moved to the host pool
    borrowed_blocks: int = 0  # blocks borrowed over time
    pressure_events: int = 0  # times vLLM needed blocks back


@dataclasses.dataclass
class _Resident:
    blocks: list[int]
    rows: int
    order: int


class ResidentBook:
    """Scheduler side: which requests are resident, with which borrowed blocks."""

    def __init__(self, geometry: AreaGeometry, source: BlockSource, *, keep_free: int,
                 max_resident: int = 0) -> None:
        """``keep_free``: vLLM blocks never borrowed; ``max_resident``: 0 = no limit."""
        if geometry.min_rows < 1:
            raise ValueError(f"an indexer page of {geometry.page} B cannot hold two main-KV rows "
                             f"of {geometry.row_bytes} B")
        self.geometry = geometry
        self.source = source
        self.keep_free = keep_free
        self.max_resident = max_resident
        self.counters = HybridCounters()
        self._res: dict[str, _Resident] = {}
        self._ops: list[HybridOp] = []
        self._order = 0
        self._demand = 0  # blocks vLLM asked for since the last relief
        # placed for a pull still in flight: never moved (a read may write its rows, and
        # the workers cannot copy positions they have not attached yet) until unpinned
        self._pinned: set[str] = set()
        self._never: set[str] = set()  # decided to decode from the pool: never placed

    def __len__(self) -> int:
        return len(self._res)

    def holds(self, req_id: str) -> bool:
        return req_id in self._res

    @property
    def borrowed(self) -> int:
        return sum(len(r.blocks) for r in self._res.values())

    def _spare(self) -> int:
        return self.source.num_free() - self.keep_free

    def _borrow(self, res: _Resident, tokens: int, new: list[int]) -> bool:
        while res.rows < tokens:
            if self._spare() < 1:
                return False
            b = self.source.take()
            res.blocks.append(b)
            new.append(b)
            res.rows += len(self.geometry.rows_of(b))
            self.counters.borrowed_blocks += 1
        return True

    def place(self, req_id: str, tokens: int, *, pinned: bool = False) -> bool:
        """A newly scheduled request: resident when its first ``tokens`` rows fit in
        spare blocks (nothing is moved to make room for it); ``False``: it decodes from
        the host pool. ``pinned``: its rows are about to be pulled (remote-D2H): it is
        not moved until :meth:`unpin`, and if it is not placed now it never is (its
        prompt lands in the pool)."""
        if req_id in self._res:
            return True
        if req_id in self._never:
            return False
        if pinned:
            self._never.add(req_id)  # placed or not, never placed again
        if self.max_resident and len(self._res) >= self.max_resident:
            return False
        need = -(-tokens // self.geometry.min_rows)
        if self._spare() < need:
            return False
        res = _Resident([], 0, self._order)
        new: list[int] = []
        if not self._borrow(res, tokens, new):  # cannot happen after the check; be safe
            self.source.give(new)
            return False
        self._order += 1
        self._res[req_id] = res
        if pinned:
            self._pinned.add(req_id)
        self._ops.append(GrowOp(req_id, tuple(new)))
        self.counters.placed_requests += 1
        return True

    @property
    def pinned(self) -> frozenset[str]:
        return frozenset(self._pinned)

    def placeable(self, req_id: str) -> bool:
        """Whether the request may still be placed (resident ones are)."""
        return req_id not in self._never or req_id in self._res

    def unpin(self, req_id: str) -> None:
        """The pulled request's rows are attached by the workers: it may move from now on."""
        self._pinned.discard(req_id)

    def forgo(self, req_id: str) -> None:
        """The request decodes from the host pool for good (e.g. its prompt starts from
        the pool's cached prefix blocks): never placed."""
        self._never.add(req_id)

    def grow(self, req_id: str, tokens: int) -> bool:
        """A resident request scheduled up to ``tokens`` positions; when spare blocks run
        out the longest-running residents move first (possibly this one). ``False``: it
        is no longer resident."""
        res = self._res.get(req_id)
        if res is None:
            return False
        if res.rows >= tokens:  # the usual decode step: its rows already cover it
            return True
        while True:
            new: list[int] = []
            ok = self._borrow(res, tokens, new)
            if new:
                self._ops.append(GrowOp(req_id, tuple(new)))
            if ok:
                return True
            victim = self._oldest()
            assert victim is not None  # this request is resident
            self.move(victim)
            if victim == req_id:
                return False

    def want(self, blocks: int) -> bool:
        """vLLM needs ``blocks`` more free blocks than it has (a waiting request, a running
        one that cannot grow): ``True`` if moving residents at the next :meth:`relieve` can
        give them (the caller waits a step instead of refusing or preempting)."""
        if all(r in self._pinned for r in self._res):
            return False
        self._demand = max(self._demand, blocks)
        return True

    def relieve(self) -> None:
        """Once per step, after vLLM scheduled: move the longest-running residents until
        vLLM's free blocks cover what it asked for plus ``keep_free``."""
        if self._demand:
            self.counters.pressure_events += 1
        while self.source.num_free() < self.keep_free + self._demand:
            victim = self._oldest()
            if victim is None:  # none left, or only pinned ones
                break
            self.move(victim)
        self._demand = 0

    def move(self, req_id: str) -> None:
        """Move a resident request to the host pool: its blocks go back now (the workers
        copy its rows before the next forward, before vLLM can reuse them). A pinned one
        stays (a read may still write its rows)."""
        if req_id in self._pinned:
            return
        res = self._res.pop(req_id, None)
        if res is None:
            return
        self.source.give(res.blocks)
        self._ops.append(MoveOp(req_id))
        self.counters.moved_requests += 1

    def release(self, req_id: str) -> None:
        """The request finished: its blocks go back, nothing is copied."""
        self._pinned.discard(req_id)
        self._never.discard(req_id)
        res = self._res.pop(req_id, None)
        if res is not None:
            self.source.give(res.blocks)

    def take_ops(self) -> tuple[HybridOp, ...]:
        if not self._ops:
            return ()
        ops, self._ops = tuple(self._ops), []
        return ops

    def _oldest(self) -> str | None:
        """The longest-running resident that may move (not pinned)."""
        return min((r for r in self._res if r not in self._pinned),
                   key=lambda r: self._res[r].order, default=None)


class ResidentArea:
    """Worker side: per-request row tables over the borrowed blocks of every layer."""

    def __init__(self, views: Sequence[torch.Tensor], geometry: AreaGeometry) -> None:
        """``views``: per main-KV layer, a ``[rows, row]`` view from the start of its paired
        indexer layer's blocks, row pitch ``geometry.row_bytes``."""
        self.views = list(views)
        self.geometry = geometry
        self._device = self.views[0].device if self.views else None
        self._rows: dict[str, list[int]] = {}
        # per request: its rows as a tensor with room to grow (doubling), filled as blocks
        # join, so a growing request's table is never rebuilt; every entry past its rows
        # is -1 and there is always at least one (the last), so a -1 padded position
        # indexes -1 (:func:`resident_slots` is then one gather)
        self._tensors: dict[str, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def holds(self, req_id: str) -> bool:
        return req_id in self._rows

    def tables_of(self, req_ids: Iterable[str]) -> list[torch.Tensor | None]:
        """:meth:`table` of each request, ``None`` for one that holds no rows here."""
        get = self._tensors.get
        return [get(r) for r in req_ids]

    def request_ids(self) -> KeysView[str]:
        """The requests holding rows here (a live view)."""
        return self._rows.keys()

    def grow(self, req_id: str, blocks: Sequence[int]) -> None:
        rows = self._rows.setdefault(req_id, [])
        start = len(rows)
        for b in blocks:
            rows.extend(self.geometry.rows_of(b))
        buf = self._tensors.get(req_id)
        if buf is None or buf.numel() <= len(rows):
            grown = torch.full((max(len(rows) + 1, 2 * (0 if buf is None else buf.numel()), 64),),
                               -1, dtype=torch.int64, device=self._device)
            if buf is not None:
                grown[:start] = buf[:start]
            buf = self._tensors[req_id] = grown
        buf[start:len(rows)] = torch.tensor(rows[start:], dtype=torch.int64)

    def capacity(self, req_id: str) -> int:
        return len(self._rows.get(req_id, ()))

    def rows(self, req_id: str) -> torch.Tensor:
        """``[capacity]`` int64: the row of every position (positions in order)."""
        return self._tensors[req_id][:len(self._rows[req_id])]

    def table(self, req_id: str) -> torch.Tensor:
        """The row of every position, then ``-1`` to the end (at least one): what
        :func:`resident_slots` gathers from."""
        return self._tensors[req_id]

    def row_list(self, req_id: str) -> list[int]:
        """The same rows as a list (host-side bookkeeping reads it without a device read)."""
        return self._rows[req_id]

    def drop(self, req_id: str) -> bool:
        self._tensors.pop(req_id, None)
        return self._rows.pop(req_id, None) is not None

    def view(self, layer: int) -> torch.Tensor:
        return self.views[layer]


def resident_slots(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rows of a resident request's ``positions`` (``-1`` padded, any shape, each below
    the request's rows) given its :meth:`ResidentArea.table`: one gather (a ``-1``
    position indexes the table's last entry, ``-1``), static shapes, no host
    synchronization (what a captured decode graph runs instead of the resolve)."""
    return table[positions]


def write_resident(view: torch.Tensor, dst: torch.Tensor, new_rows: torch.Tensor) -> None:
    """A step's new main-KV rows into a layer's resident rows ``dst`` (one device scatter)."""
    # the same dtype in practice: skip the no-op conversion's dispatch (~2 us per layer)
    view.index_copy_(0, dst, new_rows if new_rows.dtype == view.dtype
                     else new_rows.to(view.dtype))


def area_views(caches: Sequence[torch.Tensor], geometry: AreaGeometry, num_blocks: int,
               dtype: torch.dtype, row: int) -> list[torch.Tensor]:
    """Per indexer cache (block dimension first), a ``[rows, row]`` view of ``dtype`` rows
    from its block 0 at pitch ``row``: where its paired main-KV layer keeps resident rows.
    Checked against the geometry the scheduler plans with."""
    out = []
    item = torch.empty(0, dtype=dtype).element_size()
    if row * item != geometry.row_bytes:
        raise ValueError(f"main-KV rows of {row * item} B, the scheduler planned "
                         f"{geometry.row_bytes} B")
    for c in caches:
        stride = c.stride(0) * c.element_size()
        page = c[0].numel() * c.element_size()
        if (stride, page) != (geometry.block_stride, geometry.page):
            raise ValueError(f"indexer cache blocks of {page} B every {stride} B, the scheduler "
                             f"planned {geometry.page} B every {geometry.block_stride} B")
        base = c.storage_offset() * c.element_size()
        if base % item:
            raise ValueError(f"indexer cache at byte {base}: not aligned to {dtype} rows")
        view = torch.empty(0, dtype=dtype, device=c.device)
        view.set_(c.untyped_storage(), base // item, (geometry.span_rows(num_blocks), row),
                  (row, 1))
        out.append(view)
    return out


__all__: Sequence[str] = ["AreaGeometry", "BlockSource", "GrowOp", "HybridCounters", "HybridOp",
                          "MoveOp", "ResidentArea", "ResidentBook", "area_views", "resident_slots",
                          "write_resident"]
