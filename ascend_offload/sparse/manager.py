"""Sparse decode offload manager: the per-layer seam an attention backend calls.

Per decode step::

    mgr.begin_step([StepEntry(req_id, num_tokens, stable_tokens), ...])
    for layer in layers:
        ...compute this layer's new main-KV rows (one per scheduled token)...
        mgr.offload_new_kv(layer, new_kv, new_positions)   # device -> host pool
        ...indexer -> top-k logical positions [B, K] (-1 = padding)...
        slots = mgr.onload_topk(layer, topk)                # misses host -> hot buffer
        ...sparse attention over mgr.hot_buffer(layer)[slots] ...
    mgr.end_step()

Ordering (I4): new rows are copied D2H on the offload stream after an event
recorded on the compute stream; miss rows are copied H2D on the same stream
(so a new row is in the pool before it can be onloaded), and the compute stream
waits on an event recorded after the H2D copies before attention reads the
hot buffer. On CPU every one of these is an ordered no-op.

Requests whose main KV stays in device rows (hybrid residency) write and attend there
instead: :class:`~ascend_offload.sparse.resident_path.ResidentPath`, which the manager
owns and calls once per step and layer.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence
from typing import cast

import torch

from ascend_offload import device as dev
from ascend_offload import native
from ascend_offload.config import ConfigError, SparseOffloadConfig
from ascend_offload.sparse.adapter import ResidentStep
from ascend_offload.sparse.device_residency import (
    DeviceResidency,
    scatter_new_rows,
)
from ascend_offload.sparse.hybrid import ResidentArea
from ascend_offload.sparse.pools import (
    HostKVPool,
    HotBuffers,
    PoolCapacityError,
    pool_rows_from_config,
)
from ascend_offload.sparse.residency import Residency, make_residency
from ascend_offload.sparse.resident_path import ResidentPath

logger = logging.getLogger(__name__)


# New-KV writes of at most this many tokens map positions to host rows in Python.
_SMALL_WRITE = 64


@dataclasses.dataclass(frozen=True)
class StepEntry:
    """One scheduled request of a decode step, in batch order."""

    req_id: str
    num_tokens: int  # tokens whose KV exists after this step's offload (positions < num_tokens)
    stable_tokens: int  # tokens that can no longer be rolled back (<= num_tokens)


@dataclasses.dataclass
class SparseStats:
    steps: int = 0
    resolved_positions: int = 0
    miss_rows: int = 0
    onload_bytes: int = 0
    offload_rows: int = 0
    offload_bytes: int = 0
    # host time in the calls (perf_counter_ns, ~0.1 us each): what metrics report
    offload_ns: int = 0  # offload_new_kv: D2H + scatter into the pool
    resolve_ns: int = 0  # onload_topk: residency resolve
    copy_ns: int = 0  # onload_topk: miss rows H2D (issue time off CPU)
    context_rows: int = 0  # rows copied H2D for multi-token rows (0 when the pool is host-addressable)
    pool_query_tokens: int = 0  # query tokens attended over the pool (context_rows calls)
    # hybrid residency: rows written to / query tokens attended over resident device rows,
    # and bytes of resident rows moved to the pool
    resident_rows: int = 0
    resident_query_tokens: int = 0
    moved_bytes: int = 0

    @property
    def hits(self) -> int:
        return self.resolved_positions - self.miss_rows

    @property
    def hit_rate(self) -> float:
        return 1.0 - self.miss_rows / self.resolved_positions if self.resolved_positions else 0.0


class SparseOffloadManager:
    """Owns the host pool, the hot buffers and the residency table of one worker."""

    def __init__(self, cfg: SparseOffloadConfig, *, num_layers: int, row_shape: Sequence[int],
                 dtype: torch.dtype, block_size: int, max_requests: int,
                 index_topk: int | None = None, pool: HostKVPool | None = None,
                 pool_rows: int | None = None, device: torch.device | None = None,
                 tp_rank: int = 0, fence_timeout_s: float = 30.0, nthreads: int = 1,
                 residency: Residency | DeviceResidency | None = None,
                 hot_buffers: Sequence[torch.Tensor] | None = None,
                 max_positions: int | None = None, area: ResidentArea | None = None) -> None:
        """``max_positions``: the most positions one request reaches (the engine's
        ``max_model_len``; default the pool's rows): the width of the device residency's
        position map. ``residency``: a table to use instead of the config's. ``area``:
        hybrid residency's device rows (requests it holds write and attend there)."""
        if not cfg.enabled:
            raise ConfigError("key 'enabled'=False: sparse offload is off (the default); "
                              "set it to true to build the offload manager")
        cfg.check_against(block_size=block_size, index_topk=index_topk)
        self.cfg = cfg
        self.index_topk = index_topk if index_topk is not None else cfg.index_topk
        self.num_layers = num_layers
        self.block_size = block_size
        self.hot_size = cfg.topk_buffer_size
        self.max_requests = max_requests
        self.tp_rank = tp_rank
        self.fence_timeout_s = fence_timeout_s
        if pool is None:
            rows = pool_rows if pool_rows is not None else pool_rows_from_config(
                cfg, num_layers=num_layers, row_shape=row_shape, dtype=dtype,
                block_size=block_size)
            pool = HostKVPool(num_layers, rows, row_shape, dtype, block_size)
        if pool.num_layers != num_layers or pool.block_size != block_size:
            raise ValueError("host pool layout does not match the manager (layers/block_size)")
        self.pool = pool
        if pool.shared_name is not None and tp_rank != 0:
            pool.attach_reader(tp_rank)
        self.hot = HotBuffers(num_layers, max_requests, self.hot_size, pool.row_shape, dtype,
                              device, buffers=hot_buffers)
        # The device resolver needs the pool reachable from device kernels (on CPU: itself).
        self._pool_dev: torch.Tensor | None = None
        backend = cfg.residency_backend if residency is None else (
            "device" if residency.kind == "device" else "host")
        if backend == "device":
            why = self._no_device_path()
            if why and residency is not None:
                raise ValueError(f"a device residency table was given, but {why}")
            if why:
                logger.warning("sparse decode: residency_backend 'device': %s; the host resolver "
                               "runs instead (the top-k crosses to the host every layer)", why)
                backend = "host"
        self.residency = residency if residency is not None else make_residency(
            num_layers, max_requests, self.hot_size, use_native=cfg.use_native, nthreads=nthreads,
            policy=cfg.residency_policy, backend=backend,
            max_positions=max_positions or pool.num_rows, device=self.hot.device,
            device_compile=cfg.device_compile)
        self._device = self.residency.kind == "device"
        self._new_dst: tuple[list[int], torch.Tensor] | None = None  # this step's new-row rows
        # (positions tensor, its pool rows) of this step: every layer passes the same one
        self._new_rows: tuple[torch.Tensor, torch.Tensor] | None = None
        self._new_dst_buf: torch.Tensor | None = None  # persistent: a captured graph reads it
        self._new_dst_of: torch.Tensor | None = None  # the dst tensor _new_dst was made from
        self._hot_on_host = dev.is_host(self.hot.layer(0))  # the resolver's slots are host tensors
        self._native_copy = self._hot_on_host and native.available()
        self._stream = dev.new_stream()
        self._tag_counter = itertools.count(1)
        self._rows: dict[str, tuple[int, int]] = {}  # req_id -> (row, tag)
        self._free_rows = list(range(max_requests))
        self._step: list[StepEntry] = []
        self._step_no = 0
        self._batch: dict[str, torch.Tensor] = {}
        self._step_lens: list[int] = []
        self._step_blocks: list[list[int]] = []
        self._bound = False  # this step bound the residency (some entry is not resident)
        self.stats = SparseStats()
        self.area = area
        # hybrid residency's rows: resident entries write and attend there, not the pool
        self._resident = None if area is None else ResidentPath(
            area, pool, self.stats, num_layers=num_layers, block_size=block_size,
            tp_rank=tp_rank, device=self.hot.device)

    def _no_device_path(self) -> str | None:
        """Why the device resolver cannot run here (None: it can; the pool's device view
        is kept). Its miss gather and new-row scatter are device kernels over a device
        view of the host pool; a pool shared by TP ranks needs a host-side publish fence
        per layer (rank 0's writes must be complete), i.e. a synchronization."""
        if self.pool.shared_name is not None and dev.platform() != "cpu":
            return ("the host pool is shared by TP ranks, whose per-layer publish fence "
                    "needs the host to see rank 0's writes finish")
        view = dev.device_view_of_host(self.pool.kv)
        if view is None:
            return f"no device view of the host pool on this platform ({dev.platform()})"
        self._pool_dev = view
        return None

    # ------------------------------------------------------------------ requests

    def admit(self, req_id: str, max_tokens: int, shared: Sequence[int] = ()) -> int:
        """Reserve host rows for ``max_tokens`` and a hot-buffer row; returns the row.
        ``shared``: pool blocks of a cached prefix that lead the request's table."""
        if req_id in self._rows:
            raise PoolCapacityError(f"request {req_id!r} is already admitted")
        self._check_positions(req_id, max_tokens)
        if not self._free_rows:
            raise PoolCapacityError(
                f"no hot-buffer row free for request {req_id!r}: all {self.max_requests} in use")
        self.pool.admit(req_id, max_tokens, shared)
        row = self._free_rows.pop(0)
        self._rows[req_id] = (row, next(self._tag_counter))
        return row

    def _check_positions(self, req_id: str, max_tokens: int) -> None:
        """Refuse at admission what the residency table could not index later."""
        limit = self.residency.max_positions
        if max_tokens > limit:
            raise PoolCapacityError(
                f"request {req_id!r}: max_tokens={max_tokens} exceeds the {limit} positions the "
                f"{self.residency.kind} residency table holds at topk_buffer_size={self.hot_size}")

    def attach(self, req_id: str, max_tokens: int) -> int:
        """Take a hot-buffer row for a request already admitted to the pool.

        The remote-D2H consumer admits a request to the host pool (and fills
        its prompt rows) before decode runs it; the attention backend then
        attaches it here instead of calling :meth:`admit`. ``max_tokens`` must
        fit the rows reserved then. :meth:`finish` frees both.
        """
        if req_id in self._rows:
            raise PoolCapacityError(f"request {req_id!r} is already admitted")
        try:
            cap = self.pool.capacity(req_id)
        except KeyError:
            raise KeyError(f"request {req_id!r} has no host pool rows: admit it to the pool "
                           "(remote-D2H consumer) first") from None
        if max_tokens > cap:
            raise PoolCapacityError(f"request {req_id!r}: max_tokens={max_tokens} exceeds the "
                                    f"{cap} host rows reserved at admission")
        self._check_positions(req_id, max_tokens)
        if not self._free_rows:
            raise PoolCapacityError(
                f"no hot-buffer row free for request {req_id!r}: all {self.max_requests} in use")
        row = self._free_rows.pop(0)
        self._rows[req_id] = (row, next(self._tag_counter))
        return row

    def unshare(self, req_id: str, n: int) -> int:
        """The request's first ``n`` pool blocks become its own (rows copied from the shared
        ones by the writing rank), before it recomputes them; returns how many changed."""
        pairs = self.pool.unshare(req_id, n)
        if pairs and self.tp_rank == 0:
            bs = self.block_size
            old = torch.tensor([b * bs + o for b, _ in pairs for o in range(bs)])
            new = torch.tensor([b * bs + o for _, b in pairs for o in range(bs)])
            for layer in range(self.num_layers):
                rows = self.pool.layer(layer)
                rows[new] = rows[old]
        return len(pairs)

    def finish(self, req_id: str) -> None:
        """Free the request's host blocks, hot-buffer row and residency state (idempotent)."""
        if self.detach(req_id):
            self.pool.release(req_id)

    def detach(self, req_id: str) -> bool:
        """Free the request's hot-buffer row and residency state but keep its host rows
        (a preempted request: :meth:`attach` takes a row again, whose contents start
        invalid). ``False`` if it held no hot row."""
        entry = self._rows.pop(req_id, None)
        if entry is None:
            return False
        row, _ = entry
        self.residency.release(row)
        self._free_rows.append(row)
        self._free_rows.sort()
        return True

    def holds_row(self, req_id: str) -> bool:
        return req_id in self._rows

    @property
    def pool_rows_used(self) -> int:
        """Host rows reserved by admitted requests (per layer)."""
        return (self.pool.num_blocks - self.pool.free_blocks) * self.block_size

    def row_of(self, req_id: str) -> int:
        return self._rows[req_id][0]

    @property
    def active_requests(self) -> list[str]:
        return list(self._rows)

    # ------------------------------------------------------------------ per step

    def begin_step(self, entries: Sequence[StepEntry]) -> None:
        """Fix the batch of this step (batch order = order of ``entries``). A step whose
        entries are all resident (hybrid residency) resolves nothing: the residency is not
        bound and no block table is built."""
        admitted, capacity = self._rows, self.pool.capacity
        for e in entries:
            if e.req_id not in admitted:
                raise KeyError(f"request {e.req_id!r} is not admitted")
            cap = capacity(e.req_id)
            if not 0 <= e.stable_tokens <= e.num_tokens <= cap:
                raise ValueError(
                    f"request {e.req_id!r}: need 0 <= stable_tokens={e.stable_tokens} <= "
                    f"num_tokens={e.num_tokens} <= reserved capacity {cap}")
        self._step = list(entries)
        self._step_lens = [e.num_tokens for e in entries]
        self._step_no += 1
        self._new_dst = None
        self._new_rows = None
        resident = self._resident
        self._bound = not (resident is not None and resident.begin(self._step))
        if not self._bound:
            self._step_blocks = []
            self._batch = {}
            return
        rows = [admitted[e.req_id][0] for e in entries]
        tags = [admitted[e.req_id][1] for e in entries]
        lens = self._step_lens
        stable = [e.stable_tokens for e in entries]
        tables = [self.pool.block_table(e.req_id) for e in entries]
        width = max((t.numel() for t in tables), default=1)
        bt = torch.zeros((len(entries), width), dtype=torch.int32)
        for i, t in enumerate(tables):
            bt[i, : t.numel()] = t
        self._step_blocks = [self.pool.block_list(e.req_id) for e in entries]
        self._batch = {
            "rows": torch.tensor(rows, dtype=torch.int32),
            "tags": torch.tensor(tags, dtype=torch.int64),
            "lens": torch.tensor(lens, dtype=torch.int32),
            "stable": torch.tensor(stable, dtype=torch.int32),
            "block_table": bt,
        }
        b = self._batch
        # Bound once per step: each layer's onload_topk then passes only its top-k.
        self.residency.bind_step(b["rows"], b["tags"], b["stable"], b["lens"], bt, self.block_size)
        self.stats.steps += 1

    def resident_step(self, new_tokens: Sequence[int]) -> ResidentStep | None:
        """After :meth:`begin_step`: when every entry of the step is resident, where its
        new rows go and what it attends over (``new_tokens``: each entry's tokens computed
        this step, its last positions), for the layers to use with tensor ops only; the
        step's resident rows and query tokens are counted here for every layer at once.
        ``None`` when any entry is not resident (the layers then call the adapter)."""
        if self._bound or self._resident is None or not self._step:
            return None
        return self._resident.plan(new_tokens)

    def end_step(self) -> None:
        """Make the host pool writes of this step visible before the next one (CPU: no-op).

        Shared pool (TP): a reader records that it finished this step's reads; rank 0
        waits for that before it frees, reassigns or rewrites any row.

        Device resolver: its per-layer reports are read here, once (input errors raise
        :class:`~ascend_offload.sparse.residency.ResidencyError`; the totals feed the stats)."""
        if self._device and self._bound:
            valid, misses = cast(DeviceResidency, self.residency).check()
            self.stats.resolved_positions += valid
            self.stats.miss_rows += misses
            self.stats.onload_bytes += misses * self.pool.row_bytes
        self._stream.synchronize()
        if self.pool.shared_name is not None:
            if self.tp_rank == 0:
                self.pool.wait_readers(self._step_no, self.fence_timeout_s)
            else:
                self.pool.mark_read(self.tp_rank, self._step_no)

    def offload_new_kv(self, layer: int, new_kv: torch.Tensor, positions: torch.Tensor) -> None:
        """Copy this step's new main-KV rows of ``layer`` device -> host pool.

        ``new_kv`` is ``[N, *row_shape]`` (N scheduled tokens, batch order);
        ``positions`` is ``[N, 2]`` int (batch index, logical position). With
        TP only rank 0 writes; it publishes the layer for the other ranks. Rows of
        resident requests (hybrid residency) go to their device rows instead, on every
        rank (each holds its own).
        """
        resident = self._resident
        if resident is not None and resident.any_resident:
            rest = resident.write(layer, new_kv, positions)
            if rest is None:
                return
            new_kv, positions = rest
        if self.tp_rank != 0:
            return
        t0 = time.perf_counter_ns()
        dst = self._step_rows(positions)
        if new_kv.shape[0] != dst.numel():
            raise ValueError(f"layer {layer}: {new_kv.shape[0]} new rows for {dst.numel()} positions")
        if self._device and self._pool_dev is not None:
            # a device kernel writes the pool through its device view, on the compute
            # stream after the rows were made: no host wait
            scatter_new_rows(self._pool_dev[layer], new_kv, self._bind_new_dst(dst))
        else:
            ready = dev.record_after_compute()
            with dev.stream_context(self._stream):
                self._stream.wait_event(ready)
                # A blocking D2H on the offload stream: the host scatter below must
                # not read a buffer whose asynchronous copy is still in flight.
                rows = dev.host_read(new_kv, reason=dev.NEW_ROWS_READ)
                dev.scatter_rows(rows, dst, self.pool.layer(layer))
        if self.pool.shared_name is not None:
            self._stream.synchronize()  # published rows must really be there
            self.pool.publish(layer, self._step_no)
        self.stats.offload_rows += int(dst.numel())
        self.stats.offload_bytes += int(dst.numel()) * self.pool.row_bytes
        self.stats.offload_ns += time.perf_counter_ns() - t0

    def move_to_pool(self, req_id: str, tokens: int) -> int:
        """Hybrid residency: move a resident request's first ``tokens`` rows to its host
        pool rows (:meth:`ResidentPath.move_to_pool`); returns the bytes moved per rank."""
        assert self._resident is not None
        return self._resident.move_to_pool(req_id, tokens)

    def copy_to_pool(self, req_id: str, positions: torch.Tensor) -> int:
        """Copy a resident request's rows of ``positions`` (every layer) to its host pool
        rows; rank 0 only (the pool's writer). Returns the bytes copied."""
        assert self._resident is not None
        return self._resident.copy_to_pool(req_id, positions)

    def onload_topk(self, layer: int, topk: torch.Tensor) -> torch.Tensor:
        """Resolve ``topk`` ``[B, K]`` logical positions (-1 padding) of ``layer``:
        copy the misses host -> hot buffer and return ``[B, K]`` int32 indices
        into :meth:`hot_buffer` (``-1`` where top-k had padding). The result may
        be reused by the next resolve of the same layer (the next step)."""
        if topk.dim() != 2 or topk.shape[0] != len(self._step):
            raise ValueError(f"layer {layer}: top-k shape {tuple(topk.shape)} does not match the "
                             f"step batch of {len(self._step)} requests")
        if self.tp_rank != 0 and self.pool.shared_name is not None:
            self.pool.wait_published(layer, self._step_no, self.fence_timeout_s)
        if self._device:
            return self._onload_device(layer, topk)
        t0 = time.perf_counter_ns()
        # not self._device: the table is a host one (the flag is set from its kind)
        res = cast(Residency, self.residency).resolve_layer(
            layer, dev.host_read(topk, reason=dev.TOPK_READ))
        t1 = time.perf_counter_ns()
        self.stats.resolve_ns += t1 - t0
        n = res.num_misses
        if n:
            src = self.pool.layer(layer)
            dst = self.hot.layer(layer)
            with dev.stream_context(self._stream):
                if self._native_copy:
                    native.copy_rows(src, res.src_rows, dst, res.dst_rows, count=n)
                else:
                    dev.copy_rows(src, res.miss_src, dst, res.miss_dst)
            done = dev.new_event()
            done.record(self._stream)
            dev.current_stream().wait_event(done)
            self.stats.copy_ns += time.perf_counter_ns() - t1
        self.stats.resolved_positions += res.num_valid
        self.stats.miss_rows += n
        self.stats.onload_bytes += n * self.pool.row_bytes
        slots = res.slots
        return slots if self._hot_on_host else slots.to(self.hot.device, non_blocking=True)

    def _onload_device(self, layer: int, topk: torch.Tensor) -> torch.Tensor:
        """The device resolver's layer: resolve, then gather the misses from the pool's
        device view into the hot buffer, both queued on the compute stream; nothing is
        read back (the counts reach the stats at :meth:`end_step`)."""
        assert self._pool_dev is not None
        t0 = time.perf_counter_ns()
        table = cast(DeviceResidency, self.residency)
        res = table.resolve_layer(layer, topk)
        t1 = time.perf_counter_ns()
        table.gather_misses(self._pool_dev[layer], self.hot.layer(layer), res)
        self.stats.resolve_ns += t1 - t0
        self.stats.copy_ns += time.perf_counter_ns() - t1
        return res.slots

    def bind_new_rows(self, positions: torch.Tensor) -> None:
        """Device resolver: copy the pool rows of this step's new tokens (``positions``
        ``[N, 2]``, as :meth:`offload_new_kv` takes them) into a persistent device buffer.
        :meth:`offload_new_kv` does it itself on a step's first call; a captured decode
        graph replays without that Python, so its runner calls this once per step
        before the replay (like :meth:`begin_step`)."""
        self._bind_new_dst(self._step_rows(positions))

    def _step_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """:meth:`_host_rows` of this step's new-row ``positions``, computed once: every
        layer (and :meth:`bind_new_rows`) passes the same tensor."""
        if self._new_rows is None or self._new_rows[0] is not positions:
            self._new_rows = (positions, self._host_rows(positions))
        return self._new_rows[1]

    def _bind_new_dst(self, dst: torch.Tensor) -> torch.Tensor:
        """The step's new-row pool rows in the persistent buffer: every layer writes the
        same positions, so they cross host -> device once per step."""
        if self._new_dst is not None and self._new_dst_of is dst:
            return self._new_dst[1]
        key = dst.tolist()
        self._new_dst_of = dst
        if self._new_dst is None or self._new_dst[0] != key:
            n = len(key)
            buf = self._new_dst_buf
            if buf is None or buf.numel() < n:  # grows for prefill-sized steps (not captured)
                buf = torch.empty(max(n, self.max_requests), dtype=torch.int64,
                                  device=self.hot.device)
                self._new_dst_buf = buf
            view = buf[:n]
            view.copy_(dst, non_blocking=True)
            self._new_dst = (key, view)
        return self._new_dst[1]

    def _host_rows_small(self, pos: list[list[int]]) -> list[int]:
        """:meth:`_host_rows` for a decode step's few new tokens, in Python: the
        vectorised path costs ~130 us of small torch ops per layer here."""
        lens, blocks, bs = self._step_lens, self._step_blocks, self.block_size
        rows = []
        for b, p in pos:
            if not 0 <= b < len(lens):
                raise IndexError("new-KV batch index outside the step batch")
            if not 0 <= p < lens[b]:
                raise IndexError(f"new-KV position {p} of batch entry {b} is outside "
                                 f"[0, num_tokens={lens[b]})")
            rows.append(blocks[b][p // bs] * bs + p % bs)
        return rows

    def hot_buffer(self, layer: int) -> torch.Tensor:
        return self.hot.layer(layer)

    def context_rows(self, layer: int, batch_index: int, positions: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """A row store and row indices holding the main KV of ``positions`` ``[T, K]``
        (``-1`` padded) of step entry ``batch_index``: what a multi-token row (a prefill
        chunk on the decode node) attends over, since the device has no main KV.

        With the hot buffers in host memory (CPU) the pool itself is the row store;
        on an accelerator the distinct selected rows are gathered on the host and
        copied to the device once (what crosses: those rows, per layer and chunk).
        """
        if not 0 <= batch_index < len(self._step):
            raise IndexError(f"batch index {batch_index} outside the step batch of "
                             f"{len(self._step)}")
        resident = self._resident
        if resident is not None and (table := resident.tables[batch_index]) is not None:
            return resident.context_rows(layer, table, positions)  # its device rows
        if self.tp_rank != 0 and self.pool.shared_name is not None:
            self.pool.wait_published(layer, self._step_no, self.fence_timeout_s)
        self.stats.pool_query_tokens += int(positions.shape[0])
        blocks = self._batch["block_table"][batch_index].to(torch.int64)
        pos = positions.to("cpu", torch.int64)
        valid = pos >= 0
        if bool((pos >= self._step_lens[batch_index]).any()):
            raise IndexError(f"context positions beyond num_tokens={self._step_lens[batch_index]}")
        p = pos.clamp(min=0)
        host = torch.where(valid, blocks[p // self.block_size] * self.block_size
                           + p % self.block_size, -1)
        src = self.pool.layer(layer)
        if self._hot_on_host:
            return src, host
        if self._device:  # this step's new rows went in by a device kernel: let it finish
            dev.current_stream().synchronize()
        uniq, inverse = torch.unique(host[valid], return_inverse=True)
        rows = torch.full_like(host, -1)
        rows[valid] = inverse
        gathered = src.index_select(0, uniq).to(self.hot.device)
        self.stats.context_rows += int(uniq.numel())
        return gathered, rows.to(self.hot.device)

    def _host_rows(self, positions: torch.Tensor) -> torch.Tensor:
        if positions.dim() != 2 or positions.shape[1] != 2:
            raise ValueError(f"positions must be [N, 2] (batch index, position), "
                             f"got {tuple(positions.shape)}")
        if positions.shape[0] <= _SMALL_WRITE:
            return torch.tensor(self._host_rows_small(positions.tolist()), dtype=torch.int64)
        pos = positions.to("cpu", torch.int64)
        bidx, p = pos[:, 0], pos[:, 1]
        lens = self._batch["lens"].to(torch.int64)
        if pos.numel() and (int(bidx.min()) < 0 or int(bidx.max()) >= lens.numel()):
            raise IndexError("new-KV batch index outside the step batch")
        if pos.numel() and bool(((p < 0) | (p >= lens[bidx])).any()):
            bad = int(((p < 0) | (p >= lens[bidx])).nonzero()[0, 0])
            raise IndexError(f"new-KV position {int(p[bad])} of batch entry {int(bidx[bad])} is "
                             f"outside [0, num_tokens={int(lens[bidx[bad]])})")
        bt = self._batch["block_table"].to(torch.int64)
        return bt[bidx, p // self.block_size] * self.block_size + p % self.block_size
