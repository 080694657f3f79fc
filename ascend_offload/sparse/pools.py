"""Host KV pool (full main-KV history) and per-layer device hot buffers.

Host pool layout is layer-first: ``kv[layer, row, *row_shape]``, one row per
logical token slot, main KV only (the indexer cache stays on the device).
Rows are handed out in blocks of ``block_size`` tokens; a request reserves
every block it may ever need at admission, so running out of host memory is an
explicit :class:`PoolCapacityError` there and never an overwrite later.
Blocks are reference counted: a decode-side prefix cache entry keeps a finished
request's full blocks (:meth:`HostKVPool.retain`) and a later request with the
same prefix takes them as the first blocks of its table (``admit(shared=...)``),
so a shared row is stored, and counted, once.
Allocation is deterministic (lowest free blocks first): TP ranks that replay
the same admissions compute the same block tables for one shared pool.

With TP, one pool is shared by all ranks of a DP group: rank 0 creates it as a
file under ``/dev/shm`` and writes new rows; other ranks attach and only read.
A small header in the same mapping carries, per layer, the last decode step
whose new rows rank 0 has completely written (:meth:`HostKVPool.publish` /
:meth:`HostKVPool.wait_published`), so a reader never copies a row before its
writer finished (I4). The other direction has its fence too: each reader
records the last step whose reads it completed (:meth:`HostKVPool.mark_read`),
and rank 0 ends a step only once every attached reader finished it
(:meth:`HostKVPool.wait_readers`), so rows freed at a step boundary are never
rewritten while a lagging rank still reads them.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence

import torch

from ascend_offload import device as dev
from ascend_offload.config import ConfigError, SparseOffloadConfig
from ascend_offload.errors import AscendOffloadError

GiB = 1 << 30
_MAGIC = 0x414F_5350_4F4F_4C32  # "AOSPOOL2"
MAX_TP = 16  # reader slots in the shared header (TP ranks 1..MAX_TP-1)


class PoolCapacityError(AscendOffloadError, RuntimeError):
    """Admission refused: the host pool or the hot-buffer rows are exhausted."""


class PoolFenceTimeout(AscendOffloadError, TimeoutError):
    """A reader waited past its deadline for rank 0 to publish a layer's new rows."""


def rows_for_budget(budget_bytes: float, num_layers: int, row_bytes: int, block_size: int) -> int:
    """Token rows per layer that fit ``budget_bytes`` (whole blocks only)."""
    per_row = num_layers * row_bytes
    rows = int(budget_bytes // per_row)
    return (rows // block_size) * block_size


class HostKVPool:
    """Layer-first host KV pool with block-granular, reserve-at-admission allocation."""

    def __init__(self, num_layers: int, num_rows: int, row_shape: Sequence[int], dtype: torch.dtype,
                 block_size: int, *, shared_name: str | None = None, create: bool = True) -> None:
        if num_layers <= 0 or block_size <= 0:
            raise ConfigError(f"num_layers={num_layers}, block_size={block_size}: must be > 0")
        if num_rows < block_size or num_rows % block_size:
            raise ConfigError(
                f"host pool rows={num_rows}: must be a positive multiple of block_size={block_size} "
                f"(raise 'dram_size_per_dp_GB')")
        self.num_layers = num_layers
        self.num_rows = num_rows
        self.row_shape = tuple(int(d) for d in row_shape)
        self.dtype = dtype
        self.block_size = block_size
        self.num_blocks = num_rows // block_size
        self.row_bytes = math.prod(self.row_shape) * torch.empty(0, dtype=dtype).element_size()
        self.shared_name = shared_name
        self._path: str | None = None
        shape = (num_layers, num_rows, *self.row_shape)
        # int64 header: [magic, layers, per-layer published step..., per-rank read step...],
        # padded to 64 bytes. A read slot is -1 until that rank attaches.
        self._header_slots = -(-(2 + num_layers + MAX_TP) // 8) * 8
        if shared_name is None:
            self.kv = dev.empty_host(shape, dtype)
            self._header = torch.zeros(self._header_slots, dtype=torch.int64)
        else:
            self.kv, self._header = self._map_shared(shared_name, shape, create)
        self._layers = list(self.kv.unbind(0))  # per-layer views, made once (indexing is a torch op)
        self._free = list(range(self.num_blocks))  # kept sorted: lowest first
        self._tables: dict[str, list[int]] = {}
        self._refs: dict[int, int] = {}  # held block -> holders (tables naming it + retains)
        self._table_tensors: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ shared mapping

    def _map_shared(self, name: str, shape: tuple[int, ...], create: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        if "/" in name or not name:
            raise ConfigError(f"shared pool name {name!r}: must be a plain file name")
        path = os.path.join("/dev/shm", f"ascend_offload_{name}")
        elem = torch.empty(0, dtype=self.dtype).element_size()
        data_elems = math.prod(shape)
        header_bytes = self._header_slots * 8
        total = header_bytes + data_elems * elem
        if create:
            with open(path, "wb") as f:
                f.truncate(total)
        elif not os.path.exists(path) or os.path.getsize(path) != total:
            raise FileNotFoundError(f"shared host pool {path} missing or of another size "
                                    f"(expected {total} bytes): is rank 0 up with the same config?")
        raw = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
        header = raw[:header_bytes].view(torch.int64)
        kv = raw[header_bytes:].view(self.dtype).view(shape)
        if create:
            header[1] = self.num_layers
            header[2 + self.num_layers:] = -1
            header[0] = _MAGIC  # last: a reader that sees it sees the rest
        elif int(header[0]) != _MAGIC or int(header[1]) != self.num_layers:
            raise RuntimeError(f"shared host pool {path} was created with another layout")
        self._path = path
        return kv, header

    def unlink(self) -> None:
        """Remove the shared file (rank 0, at shutdown); mappings stay valid."""
        if self._path and os.path.exists(self._path):
            os.unlink(self._path)

    # ------------------------------------------------------------------ allocation

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def admit(self, req_id: str, max_tokens: int, shared: Sequence[int] = ()) -> torch.Tensor:
        """Reserve blocks for ``max_tokens`` tokens; returns the block table (int32).

        ``shared``: blocks another holder keeps (a prefix cache entry's rows, see
        :mod:`ascend_offload.sparse.prefix_cache`) that become the table's first blocks,
        by reference: only the rest is taken from the free list."""
        if req_id in self._tables:
            raise PoolCapacityError(f"request {req_id!r} is already admitted")
        if max_tokens <= 0:
            raise ValueError(f"request {req_id!r}: max_tokens={max_tokens} must be > 0")
        need = -(-max_tokens // self.block_size)
        shared = list(shared)
        for b in shared:
            if self._refs.get(b, 0) <= 0:
                raise KeyError(f"request {req_id!r}: shared block {b} is held by nobody")
        if len(shared) > need:
            raise ValueError(f"request {req_id!r}: {len(shared)} shared blocks, {need} needed")
        own = need - len(shared)
        if own > len(self._free):
            raise PoolCapacityError(
                f"host KV pool exhausted: request {req_id!r} needs {own} blocks "
                f"({max_tokens} tokens, {len(shared)} shared), {len(self._free)} of "
                f"{self.num_blocks} free (raise 'dram_size_per_dp_GB' or admit fewer/shorter "
                "requests)")
        fresh, self._free = self._free[:own], self._free[own:]
        blocks = shared + fresh
        for b in blocks:
            self._refs[b] = self._refs.get(b, 0) + 1
        self._tables[req_id] = blocks
        self._table_tensors[req_id] = torch.tensor(blocks, dtype=torch.int32)
        return self._table_tensors[req_id]

    def release(self, req_id: str) -> None:
        blocks = self._tables.pop(req_id, None)
        if blocks is None:
            return
        del self._table_tensors[req_id]
        self._unref(blocks)

    def unshare(self, req_id: str, n: int) -> list[tuple[int, int]]:
        """Give the request blocks of its own for the first ``n`` of its table where it
        shares them (another holder keeps them): about to be recomputed, its rows must not
        be written over the holders'. Returns the ``(old, new)`` block pairs (the caller
        copies the rows); refused naming the request when the free blocks do not suffice."""
        blocks = self._tables[req_id]
        swap = [i for i in range(min(n, len(blocks))) if self._refs.get(blocks[i], 0) > 1]
        if len(swap) > len(self._free):
            raise PoolCapacityError(f"request {req_id!r}: {len(swap)} shared blocks to replace, "
                                    f"{len(self._free)} free")
        pairs = []
        for i in swap:
            new = self._free.pop(0)
            self._refs[new] = 1
            pairs.append((blocks[i], new))
            blocks[i] = new
        self._unref([old for old, _ in pairs])
        if pairs:
            self._table_tensors[req_id] = torch.tensor(blocks, dtype=torch.int32)
        return pairs

    def retain(self, block: int) -> None:
        """One more holder of ``block`` besides the requests whose tables name it (a prefix
        cache entry): it stays out of the free list until :meth:`drop`."""
        if self._refs.get(block, 0) <= 0:
            raise KeyError(f"pool block {block} is held by nobody: nothing to retain")
        self._refs[block] += 1

    def drop(self, block: int) -> None:
        """Undo one :meth:`retain`; the block is free once nobody holds it."""
        self._unref([block])

    def refs(self, block: int) -> int:
        """Holders of ``block`` (request tables and retains; 0: free)."""
        return self._refs.get(block, 0)

    def _unref(self, blocks: Sequence[int]) -> None:
        freed = []
        for b in blocks:
            n = self._refs.get(b, 0) - 1
            if n < 0:
                raise KeyError(f"pool block {b} released more often than held")
            if n == 0:
                del self._refs[b]
                freed.append(b)
            else:
                self._refs[b] = n
        if freed:
            self._free = sorted(self._free + freed)

    def holds(self, req_id: str) -> bool:
        return req_id in self._tables

    def admitted(self) -> list[str]:
        """Requests holding rows (leak checks: the remote-D2H consumer releases on every path)."""
        return sorted(self._tables)

    def block_table(self, req_id: str) -> torch.Tensor:
        """The request's blocks (int32); fixed from admission on, so cached (do not modify)."""
        return self._table_tensors[req_id]

    def block_list(self, req_id: str) -> list[int]:
        """The same blocks as a list (do not modify): per-token lookups in Python
        beat a dozen small torch ops when a decode step writes a token or two."""
        return self._tables[req_id]

    def capacity(self, req_id: str) -> int:
        return len(self._tables[req_id]) * self.block_size

    def rows_for(self, req_id: str, positions: torch.Tensor) -> torch.Tensor:
        """Host rows (int64) of logical ``positions`` of a request."""
        blocks = self._tables[req_id]
        pos = positions.to(torch.int64)
        if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= len(blocks) * self.block_size):
            raise IndexError(f"request {req_id!r}: positions outside its {len(blocks)} blocks")
        table = torch.tensor(blocks, dtype=torch.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def layer(self, layer: int) -> torch.Tensor:
        """``[num_rows, *row_shape]`` view of one layer."""
        return self._layers[layer]

    # ------------------------------------------------------------------ remote-D2H seam

    def runs(self, req_id: str, start: int, end: int) -> list[tuple[int, int, int]]:
        """Positions ``[start, end)`` of a request as coalesced host-row runs
        ``(position, host_row, n_rows)``: what a transfer engine reads prompt KV
        into, one contiguous range per run (adjacent blocks merge)."""
        blocks = self._tables[req_id]
        if not 0 <= start <= end <= len(blocks) * self.block_size:
            raise IndexError(f"request {req_id!r}: positions [{start}, {end}) outside its "
                             f"{len(blocks) * self.block_size} reserved rows")
        out: list[tuple[int, int, int]] = []
        pos = start
        while pos < end:
            blk, off = divmod(pos, self.block_size)
            row = blocks[blk] * self.block_size + off
            n = min(self.block_size - off, end - pos)
            if out and out[-1][1] + out[-1][2] == row:
                p0, r0, n0 = out[-1]
                out[-1] = (p0, r0, n0 + n)
            else:
                out.append((pos, row, n))
            pos += n
        return out

    def layer_region(self, layer: int) -> tuple[int, int]:
        """``(address, nbytes)`` of one layer's rows, for transfer-engine registration."""
        t = self._layers[layer]
        return t.data_ptr(), t.numel() * t.element_size()

    def write_rows(self, layer: int, req_id: str, start: int, rows: torch.Tensor) -> None:
        """Write ``rows`` as positions ``start..`` of a request (prompt KV, tests)."""
        pos = torch.arange(start, start + rows.shape[0])
        dev.scatter_rows(rows.to("cpu"), self.rows_for(req_id, pos), self._layers[layer])

    # ------------------------------------------------------------------ TP fence

    def publish(self, layer: int, step: int) -> None:
        """Writer: every new row of ``step`` for ``layer`` is in the pool."""
        self._header[2 + layer] = step

    def wait_published(self, layer: int, step: int, timeout_s: float) -> None:
        """Reader: block until the writer published ``step`` for ``layer`` or raise."""
        slot = 2 + layer
        if int(self._header[slot]) >= step:
            return
        deadline = time.monotonic() + timeout_s
        delay = 1e-5
        while int(self._header[slot]) < step:
            if time.monotonic() > deadline:
                raise PoolFenceTimeout(
                    f"layer {layer}: rank 0 did not publish new KV rows of step {step} within "
                    f"{timeout_s}s (last published {int(self._header[slot])})")
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)


    def _read_slot(self, rank: int) -> int:
        if not 0 < rank < MAX_TP:
            raise ValueError(f"reader rank {rank}: must be in 1..{MAX_TP - 1}")
        return 2 + self.num_layers + rank

    def attach_reader(self, rank: int) -> None:
        """Reader ``rank`` joins: rank 0's :meth:`wait_readers` waits for it from now on."""
        self._header[self._read_slot(rank)] = 0

    def mark_read(self, rank: int, step: int) -> None:
        """Reader: every read of ``step`` is done (rank 0 may rewrite freed rows)."""
        self._header[self._read_slot(rank)] = step

    def wait_readers(self, step: int, timeout_s: float) -> None:
        """Writer: block until every attached reader finished ``step`` or raise."""
        readers = self._header[2 + self.num_layers + 1: 2 + self.num_layers + MAX_TP]
        deadline = time.monotonic() + timeout_s
        delay = 1e-5
        while True:
            lag = [(r + 1, int(v)) for r, v in enumerate(readers.tolist()) if 0 <= v < step]
            if not lag:
                return
            if time.monotonic() > deadline:
                raise PoolFenceTimeout(f"step {step}: TP readers (rank, last read step) {lag} did not "
                                       f"finish within {timeout_s}s")
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)


class HotBuffers:
    """Per layer, ``max_rows * hot_size`` device rows: request row r owns slots
    ``[r * hot_size, (r + 1) * hot_size)``."""

    def __init__(self, num_layers: int, max_rows: int, hot_size: int, row_shape: Sequence[int],
                 dtype: torch.dtype, device: torch.device | None = None,
                 buffers: Sequence[torch.Tensor] | None = None) -> None:
        """``buffers``: per-layer storage the engine already allocated (its KV cache
        regions for the main-KV layers, see ``connectors/sparse_decode/kv_cut.py``);
        by default the buffers are allocated here."""
        self.num_layers, self.max_rows, self.hot_size = num_layers, max_rows, hot_size
        shape = (max_rows * hot_size, *tuple(row_shape))
        if buffers is None:
            self.device = device if device is not None else dev.device()
            self.buffers = [torch.zeros(shape, dtype=dtype, device=self.device)
                            for _ in range(num_layers)]
            return
        if len(buffers) != num_layers:
            raise ValueError(f"{len(buffers)} hot buffers for {num_layers} layers")
        for i, b in enumerate(buffers):
            if tuple(b.shape) != shape or b.dtype != dtype:
                raise ValueError(f"hot buffer {i}: {tuple(b.shape)} {b.dtype}, expected "
                                 f"{shape} {dtype}")
        self.device = buffers[0].device
        self.buffers = list(buffers)

    def layer(self, layer: int) -> torch.Tensor:
        return self.buffers[layer]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)


def pool_rows_from_config(cfg: SparseOffloadConfig, *, num_layers: int, row_shape: Sequence[int],
                          dtype: torch.dtype, block_size: int) -> int:
    """Rows per layer that ``dram_size_per_dp_GB`` buys; a clear error if it buys none."""
    row_bytes = math.prod(row_shape) * torch.empty(0, dtype=dtype).element_size()
    rows = rows_for_budget(cfg.dram_size_per_dp_GB * GiB, num_layers, row_bytes, block_size)
    if rows <= 0:
        raise ConfigError(
            f"key 'dram_size_per_dp_GB'={cfg.dram_size_per_dp_GB}: too small for one block of "
            f"{block_size} tokens x {num_layers} layers x {row_bytes} bytes")
    return rows
