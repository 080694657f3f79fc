"""Hybrid residency's data path: resident requests' main-KV rows in a decode step.

A resident request (:mod:`ascend_offload.sparse.hybrid`) keeps its main KV in device
rows of a :class:`~ascend_offload.sparse.hybrid.ResidentArea` instead of the host pool:
its new rows are written there, its attention reads them there, and under pressure
its rows move to its pool rows once. :class:`ResidentPath` is that path for one
worker, owned by :class:`~ascend_offload.sparse.manager.SparseOffloadManager`, which
calls it once per step and layer and keeps the pool path (bind, resolve, onload).

Counting: a step whose entries are all resident is counted once, for every layer, when
its :class:`~ascend_offload.sparse.adapter.ResidentStep` is built; the per-layer calls
then count nothing, so a layer that still calls them (the adapter path of a mixed
step, tests) does not count the rows twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch

from ascend_offload import device as dev
from ascend_offload.sparse.adapter import ResidentStep
from ascend_offload.sparse.hybrid import ResidentArea, resident_slots, write_resident
from ascend_offload.sparse.pools import HostKVPool

if TYPE_CHECKING:  # the manager imports this module
    from ascend_offload.sparse.manager import SparseStats, StepEntry

# A step's new rows split between the area and the pool: (resident indices or None when
# every new row is resident, their device rows, pool indices, their positions).
_Split = tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


class ResidentPath:
    """Resident requests' rows of one worker: this step's row tables, the new rows'
    writes and the attention's gathers over them, and moves to the host pool."""

    def __init__(self, area: ResidentArea, pool: HostKVPool, stats: SparseStats, *,
                 num_layers: int, block_size: int, tp_rank: int, device: torch.device) -> None:
        """``stats``: the manager's (the resident counters are its fields). ``device``:
        the hot buffers', where the split's index tensors go."""
        self.area = area
        self._pool = pool
        self._stats = stats
        self._num_layers = num_layers
        self._block_size = block_size
        self._tp_rank = tp_rank
        self._device = device
        # this step: per entry its row table (None: not resident), fixed for the step
        # (growth is applied before it)
        self.tables: list[torch.Tensor | None] = []
        self.any_resident = False  # some entry of this step is resident
        self._entries: list[StepEntry] = []
        self._split: _Split | None = None
        self._split_of: torch.Tensor | None = None  # the positions _split was made from
        # every entry of this step resident: where the layers write and read (plan)
        self._step: ResidentStep | None = None

    def begin(self, entries: list[StepEntry]) -> bool:
        """Fix the step's row tables (``entries``, validated, in batch order); whether
        every entry is resident."""
        tables = self.area.tables_of(e.req_id for e in entries)
        self.tables = tables
        resident = sum(t is not None for t in tables)
        self.any_resident = resident > 0
        self._entries = entries
        self._split = None
        self._split_of = None
        self._step = None
        return bool(entries) and resident == len(tables)

    def plan(self, new_tokens: Sequence[int]) -> ResidentStep:
        """The all-resident step's :class:`ResidentStep` (``new_tokens``: each entry's
        tokens computed this step, its last positions); the step's resident rows and
        query tokens are counted here for every layer at once."""
        area = self.area
        tables = cast(list[torch.Tensor], self.tables)
        # the new tokens' rows are a slice of each entry's row table, already on the
        # device: no host list, no host-to-device copy per step
        parts: list[torch.Tensor] = []
        for e, n, table in zip(self._entries, new_tokens, tables, strict=True):
            cap = area.capacity(e.req_id)
            if not 0 <= n <= e.num_tokens <= cap:
                raise IndexError(f"request {e.req_id!r}: {n} new of {e.num_tokens} tokens, "
                                 f"{cap} resident rows")
            parts.append(table[e.num_tokens - n:e.num_tokens])
        layers = len(area.views)
        new = sum(new_tokens)
        self._stats.resident_rows += new * layers
        self._stats.resident_query_tokens += new * layers
        self._step = ResidentStep(
            area.views, parts[0] if len(parts) == 1 else torch.cat(parts), tables)
        return self._step

    def write(self, layer: int, new_kv: torch.Tensor, positions: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Write resident entries' new rows to their device rows; returns the rest (rows
        and positions, the same tensors every layer) for the pool, ``None`` if none."""
        if self._split is None or self._split_of is not positions:
            self._split = self._split_rows(positions)
            self._split_of = positions
        area_sel, area_dst, pool_sel, pool_pos = self._split
        n = area_dst.numel()
        if n:
            rows = new_kv if area_sel is None else new_kv.index_select(0, area_sel)
            write_resident(self.area.view(layer), area_dst, rows)
            if self._step is None:  # else counted for every layer at once
                self._stats.resident_rows += n
        if pool_sel is None:
            return None
        assert pool_pos is not None
        return new_kv.index_select(0, pool_sel), pool_pos

    def _split_rows(self, positions: torch.Tensor) -> _Split:
        """This step's new rows split: (resident indices, their device rows, pool indices,
        their positions). Every new row resident (the usual hybrid step): the resident
        indices and both pool parts are None, and the step's rows go over whole."""
        area_sel: list[int] = []
        area_dst: list[int] = []
        pool_sel: list[int] = []
        tables: dict[int, list[int]] = {}
        pos = positions.tolist()
        for i, (b, p) in enumerate(pos):
            if not 0 <= b < len(self._entries):
                raise IndexError("new-KV batch index outside the step batch")
            if self.tables[b] is None:
                pool_sel.append(i)
                continue
            if not 0 <= p < (n := self._entries[b].num_tokens):
                raise IndexError(f"new-KV position {p} of batch entry {b} is outside "
                                 f"[0, num_tokens={n})")
            rows = tables.get(b)
            if rows is None:
                rows = tables[b] = self.area.row_list(self._entries[b].req_id)
            if p >= len(rows):
                raise IndexError(f"request {self._entries[b].req_id!r}: position {p} beyond "
                                 f"its {len(rows)} resident rows")
            area_sel.append(i)
            area_dst.append(rows[p])
        dev_ = self._device
        dst = torch.tensor(area_dst, dtype=torch.int64, device=dev_)
        if not pool_sel:  # every new row is resident (the usual hybrid step)
            return None, dst, None, None
        sel = torch.tensor(pool_sel, dtype=torch.int64)
        return (torch.tensor(area_sel, dtype=torch.int64, device=dev_), dst,
                sel.to(dev_), positions[sel])

    def context_rows(self, layer: int, table: torch.Tensor, positions: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """A resident entry's rows of ``positions`` in the layer's device rows, given its
        row table: tensor ops only, no check per layer (the rows cover the entry's tokens,
        checked when the step was planned; positions are the attention's, below its
        length)."""
        if self._step is None:  # else counted for every layer at once
            self._stats.resident_query_tokens += positions.shape[0]
        return self.area.view(layer), resident_slots(table, positions)

    def move_to_pool(self, req_id: str, tokens: int) -> int:
        """Copy a resident request's first ``tokens`` rows of every layer from its device
        rows to its host pool rows (rank 0 writes the pool) and forget its device rows;
        returns the bytes moved per rank. The request keeps its hot row and decodes from
        the pool from now on (its hot rows start empty)."""
        if not self.area.holds(req_id):
            return 0
        moved = self.copy_to_pool(req_id, torch.arange(tokens))
        self._stats.moved_bytes += moved
        self.area.drop(req_id)
        return moved

    def copy_to_pool(self, req_id: str, positions: torch.Tensor) -> int:
        """Copy a resident request's rows of ``positions`` (every layer) to its host pool
        rows; rank 0 only (the pool's writer). Returns the bytes copied."""
        if self._tp_rank != 0 or not positions.numel():
            return 0
        rows = self.area.rows(req_id)
        if int(positions.max()) >= rows.numel():
            raise IndexError(f"request {req_id!r}: position {int(positions.max())} to copy, "
                             f"{rows.numel()} resident rows")
        src = rows[positions.to(rows.device)]
        pool = self._pool
        blocks = torch.tensor(pool.block_list(req_id), dtype=torch.int64)
        bs = self._block_size
        dst = blocks[positions // bs] * bs + positions % bs
        for layer in range(self._num_layers):
            got = dev.host_read(self.area.view(layer).index_select(0, src), reason=dev.MOVE_READ)
            dev.scatter_rows(got, dst, pool.layer(layer))
        return int(positions.numel()) * self._num_layers * pool.row_bytes


__all__: Sequence[str] = ["ResidentPath"]
