"""Hot-buffer residency on the device: exact LRU in static-shape tensor ops.

Why: the host table (:mod:`~ascend_offload.sparse.residency`) needs the top-k on
the host, so on an NPU/GPU every layer of every decode step waits for a
device -> host copy, and the decode step cannot run as a captured graph. This
table keeps its state in device tensors next to the hot buffers and resolves a
layer with a fixed sequence of tensor ops over fixed shapes: no host
synchronization, no shape that depends on tensor values, no Python branch on
tensor values. Same semantics as the host table (exact LRU, slot for slot; the
rules are at the top of ``csrc_npu/residency.cpp``); ARC is host-only.

State per (layer, request row), in device tensors (``R`` request rows, ``H``
slots, ``C`` positions a request may reach):

* ``pos_slot`` ``[L, R + 1, C + 1]`` int16 (int32 when ``H`` > 32767): the slot of
  every position, ``-1`` = not resident. Column ``C`` absorbs masked scatters,
  row ``R`` the padded batch entries, so every scatter has a fixed shape;
* ``slot_pos`` ``[L, R + 1, H + 1]`` int32: the position a slot holds, ``-1`` = free;
* ``stamp`` ``[L, R + 1, H + 1]`` int64: last touch (larger = newer, 0 = free);
* ``tag`` / ``clock`` ``[L, R + 1]`` int64: the request the row belongs to (a new
  tag starts the row empty) and the row's touch counter;
* ``report`` ``[L, 8]`` int64: the first input error of each layer since the last
  :meth:`DeviceResidency.check` and the layer's (valid, miss) totals.

Per (layer, row) that is ``2 (C + 1) + 12 (H + 1) + 16`` bytes: 304 KiB at
DeepSeek-V3.2 scale (C = 128K, H = 4096), 11.6 % of that row's hot buffer of
656-byte rows (:func:`state_bytes_per_row`).

One layer's resolve (:func:`resolve_lru`): gather the rows' state; free the
slots of a new request and of positions at or past the stable length; look
the top-k up in ``pos_slot``; a stable sort of each row's top-k marks first
occurrences (a position is touched once, at its first occurrence); distinct
misses get ranks by cumulative sums; one sort of a packed int64 key per slot
(free slots by index, then live slots not hit in this call by last touch, then
the hit slots) gives the slot of miss rank ``j`` as the ``j``-th key; scatters
update ``pos_slot``, ``slot_pos`` and the stamps (hits in top-k order, then the
misses). Input errors (a top-k position outside ``[-1, len)``) cannot raise
there: the call then changes nothing (every entry is routed to the trash row)
and records the first offender in ``report``; :meth:`DeviceResidency.check`,
called once per step outside the per-layer path, raises it.

Kernels (``kernel``): ``ops``, the tensor ops above, portable and graph-capturable: what
an NPU / GPU runs; ``native``, the same resolve and gather as one C++ host function each
(``csrc_npu/device_table.cpp``, same state, same outputs, no ATen dispatch per op): what
a table whose device is the host runs when the library loads, since there ~190 dispatched
ops cost ~0.5 ms a layer and nothing is captured anyway; ``ops_compiled``, the tensor ops
through ``torch.compile(fullgraph=True, dynamic=False)`` (:func:`compiled_resolve_lru`):
~40 fused kernels instead of ~190, what a CUDA table runs by default
(``compile_kernel``, the ``device_compile`` key).

Row movement over the same padded descriptors: :func:`gather_misses` (pool ->
hot buffer) and :func:`scatter_new_rows` (new rows -> pool); the pool argument
is a device-addressable view of the host pool (``device.device_view_of_host``).

Imports torch and the package's torch-only modules, nothing else: the module
runs where vLLM and pydantic are absent (a CUDA-graph check, a kernel bench).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ascend_offload import native
from ascend_offload.device import STEP_READ, compiles_tensor_ops, empty_host, host_read, is_host
from ascend_offload.sparse.residency import (
    MAX_HOT_SIZE,
    PolicyState,
    ResidencyError,
    check_choice,
)

_CLASS_SHIFT = 48  # key = class << 48 | (slot index or stamp): stamps stay below 2^48
_REPORT = 8  # per layer: error flag, entry, index, value, len, row; valid, misses
# Compiled graphs kept for resolve_lru, one per shape (padded batch, top-k width, block
# size, table size). Dynamo's default of 8 per function would make the 9th shape an error
# (with fullgraph=True hitting the limit fails instead of falling back to eager): the full
# sparse-scale bench alone has 8 (2 contexts x 4 batches); an engine's compiled table
# pads its steps to a few sizes (DeviceResidency: powers of two without batch_sizes).
_RECOMPILE_LIMIT = 64


def _map_dtype(hot_size: int) -> torch.dtype:
    return torch.int16 if hot_size <= torch.iinfo(torch.int16).max else torch.int32


def state_bytes_per_row(hot_size: int, max_positions: int) -> int:
    """Device bytes of one (layer, request row): map + slot positions + stamps + tag/clock."""
    map_elem = torch.empty(0, dtype=_map_dtype(hot_size)).element_size()
    return map_elem * (max_positions + 1) + (4 + 8) * (hot_size + 1) + 16


# six tensors: a layer's state, or a step's arguments (what :func:`resolve_lru` takes)
_Six = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def resolve_lru(pos_slot: torch.Tensor, slot_pos: torch.Tensor, stamp: torch.Tensor,
                tag: torch.Tensor, clock: torch.Tensor, report: torch.Tensor,
                rows: torch.Tensor, tags: torch.Tensor, stable: torch.Tensor, lens: torch.Tensor,
                real: torch.Tensor, block_table: torch.Tensor, topk: torch.Tensor,
                block_size: int) -> tuple[torch.Tensor, ...]:
    """One layer's exact-LRU resolve of a padded batch, in place on the layer's state.

    State (one layer): ``pos_slot`` ``[R + 1, C + 1]``, ``slot_pos`` / ``stamp``
    ``[R + 1, H + 1]``, ``tag`` / ``clock`` ``[R + 1]``, ``report`` ``[8]``. Step
    (``Bp`` padded entries): ``rows`` (``R`` for padding), ``tags``, ``stable``, ``lens``
    int64 ``[Bp]``, ``real`` bool ``[Bp]``, ``block_table`` ``[Bp, W]``; ``topk``
    ``[Bp, K]`` (``-1`` padded, ``K <= H``).

    Returns ``slots`` ``[Bp, K]`` int32 (global hot rows ``row * H + slot``, -1 for
    padding), ``miss_src`` / ``miss_dst`` ``[Bp, K]`` int64 (miss ``j`` of entry ``b``
    at ``[b, j]``, host-pool row and hot row, ``-1`` past the entry's misses),
    ``copy_src`` / ``copy_dst`` ``[Bp * K]`` (the same misses; padding descriptors keep
    a hot row's contents: ``copy_src = -1`` with a ``copy_dst`` no miss writes) and
    ``counts`` ``[Bp, 2]`` int32 (valid positions, misses)."""
    trash_row = pos_slot.shape[0] - 1
    cap = pos_slot.shape[1] - 1
    hot = slot_pos.shape[1] - 1
    bp, k = topk.shape
    dev = topk.device
    topk = topk.to(torch.int64)
    ar_k = torch.arange(k, device=dev).expand(bp, k)
    ar_h = torch.arange(hot, device=dev).expand(bp, hot)

    # Input check of the whole call: any bad position and the call changes nothing.
    bad = real[:, None] & ((topk < -1) | (topk >= lens[:, None]))
    any_bad = bad.any()
    ok = real & ~any_bad
    row_eff = torch.where(ok, rows, trash_row)
    valid = (topk >= 0) & ok[:, None]
    pos = torch.where(valid, topk, cap)
    first_bad = bad.flatten().to(torch.int8).argmax().view(1)  # index ops only: no .item()
    fb = first_bad // k
    err = torch.cat((torch.ones_like(fb), fb, first_bad % k, topk.flatten().index_select(0, first_bad),
                     lens.index_select(0, fb), rows.index_select(0, fb)))
    report[:6] = torch.where(any_bad & (report[0] == 0), err, report[:6])

    flat_map = pos_slot.view(-1)
    map_base = row_eff[:, None] * (cap + 1)

    # The rows' state; a new request or positions past the stable length free their slots.
    sp = slot_pos[row_eff].to(torch.int64)[:, :hot]
    st = stamp[row_eff][:, :hot]
    fresh = tag[row_eff] != tags
    clk = torch.where(fresh, 0, clock[row_eff])
    live = sp >= 0
    inval = live & (fresh[:, None] | (sp >= stable[:, None]))
    flat_map.scatter_(0, (map_base + torch.where(inval, sp, cap)).flatten(),
                      torch.full((bp * hot,), -1, dtype=pos_slot.dtype, device=dev))
    sp = torch.where(inval, -1, sp)
    st = torch.where(inval, 0, st)

    # Lookup; first occurrence of each position (stable sort: ties keep top-k order).
    slot = torch.where(valid, flat_map.gather(0, (map_base + pos).flatten()).view(bp, k)
                       .to(torch.int64), -1)
    hit = slot >= 0
    s_pos, s_idx = torch.sort(pos, dim=1, stable=True)
    start = torch.ones_like(hit)
    start[:, 1:] = s_pos[:, 1:] != s_pos[:, :-1]
    run_first = s_idx.gather(1, torch.where(start, ar_k, 0).cummax(dim=1).values)
    first = torch.empty_like(s_idx).scatter_(1, s_idx, run_first)
    is_first = first == ar_k
    dmiss = valid & ~hit & is_first
    dhit = hit & is_first
    mrank = dmiss.cumsum(1) - 1
    hrank = dhit.cumsum(1) - 1
    n_miss = dmiss.sum(1)
    n_hit = dhit.sum(1)

    # Victim order: free slots by index, then live slots not hit here by last touch.
    hit_slot = torch.zeros((bp, hot + 1), dtype=torch.bool, device=dev)
    hit_slot.scatter_(1, torch.where(hit, slot, hot), True)
    cls = torch.where(sp < 0, 0, torch.where(hit_slot[:, :hot], 2, 1))
    key = (cls << _CLASS_SHIFT) | torch.where(cls == 0, ar_h, st)
    order = torch.sort(key, dim=1).indices  # keys are distinct within a row
    chosen = order[:, :k]
    use = ar_k < n_miss[:, None]

    # Evict the victims' positions, install the misses at their first occurrence.
    old = sp.gather(1, chosen)
    evict = use & (old >= 0)
    flat_map.scatter_(0, (map_base + torch.where(evict, old, cap)).flatten(),
                      torch.full((bp * k,), -1, dtype=pos_slot.dtype, device=dev))
    new_first = chosen.gather(1, mrank.clamp(min=0))
    flat_map.scatter_(0, (map_base + torch.where(dmiss, pos, cap)).flatten(),
                      new_first.flatten().to(pos_slot.dtype))
    miss_pos = torch.full((bp, k + 1), -1, dtype=torch.int64, device=dev)
    miss_pos.scatter_(1, torch.where(dmiss, mrank, k), pos)
    miss_pos = miss_pos[:, :k]
    sp_new = torch.cat((sp, sp.new_full((bp, 1), -1)), 1)
    sp_new.scatter_(1, torch.where(use, chosen, hot), miss_pos)

    # Touch order: hits in top-k order, then the misses.
    touch_slot = torch.where(dhit, slot, torch.where(dmiss, new_first, hot))
    touch = clk[:, None] + 1 + torch.where(dhit, hrank, n_hit[:, None] + mrank)
    st_new = torch.cat((st, st.new_zeros((bp, 1))), 1)
    st_new.scatter_(1, touch_slot, touch)

    slot_pos.index_put_((row_eff,), sp_new.to(slot_pos.dtype))
    stamp.index_put_((row_eff,), st_new)
    tag.index_put_((row_eff,), tags)
    clock.index_put_((row_eff,), clk + n_hit + n_miss)

    # Outputs.
    base = torch.where(ok, rows, rows[0]) * hot
    final = torch.where(hit, slot, torch.where(valid, new_first.gather(1, first), -1))
    slots = torch.where(final >= 0, base[:, None] + final, -1).to(torch.int32)
    mp = miss_pos.clamp(min=0)
    blk = block_table.to(torch.int64).gather(1, (mp // block_size).clamp(max=block_table.shape[1] - 1))
    miss_src = torch.where(use, blk * block_size + mp % block_size, -1)
    miss_dst = torch.where(use, base[:, None] + chosen, -1)
    # Padding descriptors rewrite a hot row with its own contents: entry b's slot of
    # largest key, never a victim while the entry has fewer than H misses (with H misses
    # it has no padding); entries that changed nothing repeat entry 0's descriptors.
    keep_dst = torch.where(use, miss_dst, base[:, None] + order[:, hot - 1:hot])
    copy_dst = torch.where(ok[:, None], keep_dst, keep_dst[0:1]).flatten()
    copy_src = torch.where(ok[:, None], miss_src, miss_src[0:1]).flatten()
    counts = torch.stack((valid.sum(1), n_miss), 1).to(torch.int32)
    report[6] += valid.sum()
    report[7] += n_miss.sum()
    return slots, miss_src, miss_dst, copy_src, copy_dst, counts


@functools.cache
def compiled_resolve_lru() -> Callable[..., tuple[torch.Tensor, ...]]:
    """:func:`resolve_lru` through ``torch.compile(fullgraph=True, dynamic=False)``, one
    wrapper for the process. Why one: dynamo caches the compiled graphs on the function's
    code, one per shape (guards on sizes, not on which layer's state views are passed), so
    every table and layer of a shape shares one compile. Compiles lazily, at a shape's
    first call (seconds on CUDA; run it in a warm-up, not inside a graph capture)."""
    limit: dict[str, Any] = {}
    if "recompile_limit" in inspect.signature(torch.compile).parameters:
        limit["recompile_limit"] = _RECOMPILE_LIMIT
    compiled: Callable[..., tuple[torch.Tensor, ...]] = torch.compile(
        resolve_lru, fullgraph=True, dynamic=False, **limit)
    if limit:
        return compiled
    import torch._dynamo.config as dynamo_config  # a torch without the per-function limit

    def call(*args: Any) -> tuple[torch.Tensor, ...]:
        with dynamo_config.patch(recompile_limit=_RECOMPILE_LIMIT):
            return compiled(*args)

    return call


def gather_misses(pool_rows: torch.Tensor, hot_rows: torch.Tensor, copy_src: torch.Tensor,
                  copy_dst: torch.Tensor) -> None:
    """``hot_rows[copy_dst[i]] = pool_rows[copy_src[i]]``; ``copy_src = -1`` keeps the
    hot row's contents. ``pool_rows`` is a device-addressable view of the host pool (on
    CPU the pool itself). Fixed work: every descriptor moves a row; padding reads the
    hot row it rewrites and one pool row a real miss reads too."""
    keep = copy_src < 0
    src = torch.where(keep, copy_src.amax().clamp(min=0), copy_src)
    fetched = pool_rows.index_select(0, src)
    kept = hot_rows.index_select(0, copy_dst)
    shape = (-1,) + (1,) * (hot_rows.dim() - 1)
    hot_rows.index_copy_(0, copy_dst, torch.where(keep.view(shape), kept, fetched))


def scatter_new_rows(pool_rows: torch.Tensor, new_rows: torch.Tensor, dst: torch.Tensor) -> None:
    """``pool_rows[dst[i]] = new_rows[i]`` (distinct ``dst``): the step's new main-KV rows
    into the host pool through its device view, ordered after the compute that made them."""
    pool_rows.index_copy_(0, dst, new_rows.to(pool_rows.dtype))


@dataclasses.dataclass
class DeviceResolved:
    """One layer's result, all device tensors of the bound step's padded batch ``Bp``
    (the first ``B`` entries are the step's). Valid until the layer's next resolve."""

    slots: torch.Tensor  # [B, K] int32 global hot rows, -1 padding
    miss_src: torch.Tensor  # [B, K] int64 host-pool rows of the misses, -1 past each entry's
    miss_dst: torch.Tensor  # [B, K] int64 hot rows they go to
    counts: torch.Tensor  # [B, 2] int32 (valid positions, misses)
    copy_src: torch.Tensor  # [Bp * K] descriptors for gather_misses (-1: keep)
    copy_dst: torch.Tensor  # [Bp * K]


@dataclasses.dataclass
class BoundStep:
    """A step's batch on the device, padded to ``Bp``. Persistent per (Bp, block size):
    a captured graph reads these buffers, :meth:`DeviceResidency.bind_step` refills them."""

    meta: torch.Tensor  # [Bp, 5] int64: row, tag, stable, len, real
    block_table: torch.Tensor  # [Bp, W] int32
    block_size: int
    batch: int = 0  # real entries this step

    @property
    def padded(self) -> int:
        return self.meta.shape[0]

    def args(self) -> _Six:
        """``rows, tags, stable, lens, real, block_table`` for :func:`resolve_lru`."""
        m = self.meta
        return m[:, 0], m[:, 1], m[:, 2], m[:, 3], m[:, 4] != 0, self.block_table


class DeviceResidency:
    """The device table of every (layer, request row); see the module docstring.

    ``max_positions`` bounds the positions one request may reach (the map's width);
    ``batch_sizes``: the padded batch sizes a step may use (a step of ``B`` requests
    runs at the smallest one >= B, so a graph captured per size replays for any
    batch); none: ``Bp = B``. ``use_native`` (the ``use_native`` key): ``auto`` runs the
    C++ kernel where the table's device is the host and the library loads, else the
    tensor ops; ``on`` requires the C++ kernel; ``off`` always runs the tensor ops.
    ``compile_kernel`` (the ``device_compile`` key), for the tensor ops only (the C++
    kernel is not compiled): ``auto`` compiles them where
    :func:`~ascend_offload.device.compiles_tensor_ops` says the device compiles them well
    (CUDA), ``on`` always, ``off`` never. ``kernel`` names the result: ``native``,
    ``ops`` or ``ops_compiled``."""

    kind = "device"
    policy = "lru"

    def __init__(self, num_layers: int, num_rows: int, hot_size: int, *, max_positions: int,
                 device: torch.device | str | None = None,
                 batch_sizes: Sequence[int] | None = None, use_native: str = "auto",
                 compile_kernel: str = "auto") -> None:
        check_choice("device_compile", compile_kernel)
        if num_layers <= 0 or num_rows <= 0:
            raise ResidencyError(f"num_layers={num_layers}, num_rows={num_rows}: must be > 0")
        if not 0 < hot_size <= MAX_HOT_SIZE:
            raise ResidencyError(f"topk_buffer_size={hot_size}: must be in [1, {MAX_HOT_SIZE}]")
        if max_positions <= 0:
            raise ResidencyError(f"max_positions={max_positions}: must be > 0")
        self.num_layers, self.num_rows, self.hot_size = num_layers, num_rows, hot_size
        self.max_positions = max_positions
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.batch_sizes = sorted(set(batch_sizes or ()))
        if self.batch_sizes and self.batch_sizes[0] <= 0:
            raise ResidencyError(f"batch_sizes={batch_sizes}: must be > 0")
        L, R1, H1, C1 = num_layers, num_rows + 1, hot_size + 1, max_positions + 1
        dev = self.device
        self.pos_slot = torch.full((L, R1, C1), -1, dtype=_map_dtype(hot_size), device=dev)
        self.slot_pos = torch.full((L, R1, H1), -1, dtype=torch.int32, device=dev)
        self.stamp = torch.zeros((L, R1, H1), dtype=torch.int64, device=dev)
        self.tag = torch.full((L, R1), -1, dtype=torch.int64, device=dev)
        self.clock = torch.zeros((L, R1), dtype=torch.int64, device=dev)
        self.report = torch.zeros((L, _REPORT), dtype=torch.int64, device=dev)
        self._steps: dict[tuple[int, int], BoundStep] = {}
        self.step: BoundStep | None = None
        self.kernel = _pick_kernel(use_native, self.pos_slot)
        if self.kernel == "ops" and (compile_kernel == "on" or (
                compile_kernel == "auto" and compiles_tensor_ops(self.device))):
            self.kernel = "ops_compiled"
        self._resolve_ops: Callable[..., tuple[torch.Tensor, ...]] = (
            compiled_resolve_lru() if self.kernel == "ops_compiled" else resolve_lru)
        if self.kernel == "ops_compiled" and not self.batch_sizes:
            # The compiled kernel compiles once per batch shape (seconds each) and fails
            # past the recompile limit: steps pad to powers of two, at most
            # log2(num_rows) + 2 shapes however many batch sizes an engine runs.
            self.batch_sizes = sorted({1 << i for i in range(num_rows.bit_length())
                                       if 1 << i < num_rows} | {num_rows})
        if self.kernel == "native":
            self._native_resolve = native.caller3("ao_dres_resolve")
            self._native_gather = native.caller3("ao_dres_gather")
        # native kernel: per (layer, padded batch, block size, K, top-k dtype) the argument
        # block and the persistent outputs; per (pool, hot buffer) the gather's block
        self._calls: dict[tuple[int, int, int, int, int, torch.dtype], _NativeCall] = {}
        self._gathers: dict[tuple[int, int], ctypes.Array] = {}

    @property
    def state_bytes(self) -> int:
        """Device bytes of the whole table (trash row and columns included)."""
        return sum(t.numel() * t.element_size() for t in (
            self.pos_slot, self.slot_pos, self.stamp, self.tag, self.clock, self.report))

    def layer_state(self, layer: int) -> _Six:
        """``pos_slot, slot_pos, stamp, tag, clock, report`` of one layer (views) for
        :func:`resolve_lru`."""
        return (self.pos_slot[layer], self.slot_pos[layer], self.stamp[layer], self.tag[layer],
                self.clock[layer], self.report[layer])

    # ------------------------------------------------------------------ per step

    def padded_size(self, batch: int) -> int:
        for size in self.batch_sizes:
            if size >= batch:
                return size
        if self.batch_sizes:
            raise ResidencyError(f"batch of {batch} requests exceeds the largest padded batch "
                                 f"size {self.batch_sizes[-1]}")
        return batch

    def bind_step(self, rows: torch.Tensor | Sequence[int], tags: torch.Tensor | Sequence[int],
                  stable: torch.Tensor | Sequence[int], lens: torch.Tensor | Sequence[int],
                  block_table: torch.Tensor, block_size: int) -> BoundStep:
        """Validate the step's host-side batch (it comes from the scheduler, not the
        device) and copy it, padded, into the persistent step buffers: one H2D copy
        per step, no device read. Raises :class:`ResidencyError` naming the entry."""
        rows_l, tags_l = _ints(rows), _ints(tags)
        stable_l, lens_l = _ints(stable), _ints(lens)
        B = len(rows_l)
        if not (len(tags_l) == len(stable_l) == len(lens_l) == B) or B == 0:
            raise ResidencyError(f"a step of {B} rows with {len(tags_l)} tags, "
                                 f"{len(stable_l)} stable and {len(lens_l)} lengths")
        if block_size <= 0:
            raise ResidencyError(f"block_size={block_size}: must be > 0")
        bt = block_table.to("cpu", torch.int64)
        if bt.dim() != 2 or bt.shape[0] != B:
            raise ResidencyError(f"block_table shape {tuple(bt.shape)} does not match a batch "
                                 f"of {B} requests")
        seen: set[int] = set()
        for b, r in enumerate(rows_l):
            if not 0 <= r < self.num_rows or r in seen:
                raise ResidencyError(f"batch entry {b}: row id out of range or repeated")
            seen.add(r)
        width = -(-self.max_positions // block_size)
        for b, (st, n) in enumerate(zip(stable_l, lens_l, strict=True)):
            if not 0 <= st <= n <= bt.shape[1] * block_size:
                raise ResidencyError(f"batch entry {b}: stable={st}, len={n}: need 0 <= stable "
                                     f"<= len <= block_table width {bt.shape[1]} * {block_size}")
            if n > self.max_positions:
                raise ResidencyError(f"batch entry {b}: len={n} exceeds the {self.max_positions} "
                                     "positions the device table holds (max_positions)")
        bp = self.padded_size(B)
        step = self._steps.get((bp, block_size))
        if step is None:
            step = BoundStep(torch.zeros((bp, 5), dtype=torch.int64, device=self.device),
                             torch.zeros((bp, width), dtype=torch.int32, device=self.device),
                             block_size)
            self._steps[(bp, block_size)] = step
        # Fresh host tensors each step (pinned where an accelerator exists: torch's host
        # allocator reuses a block only after the copy that read it finished), so an
        # asynchronous copy still in flight is never overwritten.
        meta = empty_host((bp, 5), torch.int64)
        meta.zero_()
        meta[:, 0] = self.num_rows  # padding entries use the trash row
        meta[:B] = torch.tensor([rows_l, tags_l, stable_l, lens_l, [1] * B]).T
        table = empty_host((bp, width), torch.int32)
        table.zero_()
        w = min(width, bt.shape[1])
        table[:B, :w] = bt[:, :w]
        step.meta.copy_(meta, non_blocking=True)
        step.block_table.copy_(table, non_blocking=True)
        step.batch = B
        self.step = step
        return step

    def resolve_layer(self, layer: int, topk: torch.Tensor) -> DeviceResolved:
        """Resolve one layer's ``[B, K]`` top-k (a device tensor) against the bound step.
        Device ops only; input errors surface at :meth:`check`."""
        step = self.step
        if step is None:
            raise ResidencyError("resolve_layer before bind_step")
        if not 0 <= layer < self.num_layers:
            raise ResidencyError(f"layer={layer}: out of range [0, {self.num_layers})")
        B, K = topk.shape
        if B != step.batch:
            raise ResidencyError(f"layer {layer}: top-k of {B} requests, the bound step has "
                                 f"{step.batch}")
        if K > self.hot_size:
            raise ResidencyError(f"layer={layer}, K={K}, block_size={step.block_size}: bad "
                                 f"arguments (need K <= topk_buffer_size={self.hot_size})")
        if topk.device != self.device:
            topk = topk.to(self.device, non_blocking=True)  # host-produced top-k: H2D
        if self.kernel == "native":
            return self._resolve_native(layer, step, topk)
        if step.padded > B:
            topk = torch.cat((topk, topk.new_full((step.padded - B, K), -1)))
        out = self._resolve_ops(*self.layer_state(layer), *step.args(), topk, step.block_size)
        slots, miss_src, miss_dst, copy_src, copy_dst, counts = out
        return DeviceResolved(slots[:B], miss_src[:B], miss_dst[:B], counts[:B], copy_src,
                              copy_dst)

    def resolve(self, layer: int, rows: torch.Tensor, tags: torch.Tensor, stable: torch.Tensor,
                lens: torch.Tensor, topk: torch.Tensor, block_table: torch.Tensor,
                block_size: int) -> DeviceResolved:
        """:meth:`bind_step` then :meth:`resolve_layer`."""
        self.bind_step(rows, tags, stable, lens, block_table, block_size)
        return self.resolve_layer(layer, topk)

    def _resolve_native(self, layer: int, step: BoundStep, topk: torch.Tensor) -> DeviceResolved:
        """The C++ kernel on the bound step: reads the real entries' top-k only (padding
        entries are never read), writes the layer's persistent outputs."""
        if topk.dtype not in (torch.int32, torch.int64):
            topk = topk.to(torch.int64)
        if not topk.is_contiguous():
            topk = topk.contiguous()
        K = topk.shape[1]
        key = (layer, step.padded, step.batch, step.block_size, K, topk.dtype)
        call = self._calls.get(key)
        if call is None:
            call = self._calls[key] = _NativeCall.make(self, layer, step, K, topk.dtype)
        self._native_resolve(call.args_addr, topk.data_ptr(), 0)
        return call.resolved

    def gather_misses(self, pool_rows: torch.Tensor, hot_rows: torch.Tensor,
                      resolved: DeviceResolved) -> None:
        """:func:`gather_misses` with this table's kernel (``pool_rows``, ``hot_rows``: one
        layer's rows, as that function takes them)."""
        if self.kernel != "native" or not (is_host(pool_rows) and is_host(hot_rows)):
            gather_misses(pool_rows, hot_rows, resolved.copy_src, resolved.copy_dst)
            return
        key = (pool_rows.data_ptr(), hot_rows.data_ptr())
        block = self._gathers.get(key)
        if block is None:
            block = self._gathers[key] = _gather_block(pool_rows, hot_rows)
        n = resolved.copy_src.numel()
        desc = (ctypes.c_int64 * 3)(resolved.copy_src.data_ptr(), resolved.copy_dst.data_ptr(), n)
        rc = self._native_gather(ctypes.addressof(block), ctypes.addressof(desc), 0)
        if rc < 0:
            i = -rc - 1
            raise IndexError(f"miss gather: descriptor {i} (pool row {int(resolved.copy_src[i])} "
                             f"of {pool_rows.shape[0]}, hot row {int(resolved.copy_dst[i])} of "
                             f"{hot_rows.shape[0]}) is outside its buffer")

    def check(self) -> tuple[int, int]:
        """Once per step, outside the per-layer path: read every layer's report (one
        device -> host copy), raise the first recorded input error, and return the
        (valid positions, misses) resolved since the last check."""
        rep = host_read(self.report, reason=STEP_READ).clone()
        self.report.zero_()
        bad = (rep[:, 0] != 0).nonzero().flatten()
        if bad.numel():
            layer = int(bad[0])
            _, b, i, value, length, row = rep[layer, :6].tolist()
            raise ResidencyError(f"layer {layer}, batch entry {b} (row {row}): top-k[{i}]={value} "
                                 f"outside [-1, len={length})")
        return int(rep[:, 6].sum()), int(rep[:, 7].sum())

    # ------------------------------------------------------------------ rows

    def release(self, row: int) -> None:
        """Empty ``row`` in every layer (device ops: its resident positions leave the map)."""
        if not 0 <= row < self.num_rows:
            raise ResidencyError(f"row={row}: out of range [0, {self.num_rows})")
        cap = self.max_positions
        sp = self.slot_pos[:, row, : self.hot_size].to(torch.int64)
        self.pos_slot[:, row].scatter_(1, torch.where(sp >= 0, sp, cap), -1)
        self.slot_pos[:, row] = -1
        self.stamp[:, row] = 0
        self.tag[:, row] = -1
        self.clock[:, row] = 0

    def inspect(self, layer: int, row: int) -> tuple[list[int], list[int]]:
        """(slot -> position, live slots from LRU to MRU): a device read, for tests."""
        if not (0 <= layer < self.num_layers and 0 <= row < self.num_rows):
            raise ResidencyError(f"layer={layer}, row={row}: out of range")
        sp = self.slot_pos[layer, row, : self.hot_size].to("cpu", torch.int64)
        st = self.stamp[layer, row, : self.hot_size].to("cpu")
        live = (sp >= 0).nonzero().flatten()
        return sp.tolist(), live[st[live].argsort()].tolist()

    def policy_state(self, layer: int, row: int) -> PolicyState:
        n = len(self.inspect(layer, row)[1])
        return PolicyState(n, 0, [], [], 0)


def _pick_kernel(use_native: str, state: torch.Tensor) -> str:
    """``native`` or ``ops`` for a table whose state is ``state`` (see
    :class:`DeviceResidency`)."""
    check_choice("use_native", use_native)
    if use_native == "off":
        return "ops"
    why = None if is_host(state) else f"the table's device is {state.device}, not the host"
    if why is None and not native.available():
        why = "the native library is not available (see the log)"
    if why is None:
        return "native"
    if use_native == "on":
        raise ResidencyError(f"key 'use_native'='on' with residency_backend 'device': {why}")
    return "ops"


@dataclasses.dataclass
class _NativeCall:
    """One (layer, padded batch, batch, block size, K, top-k dtype)'s argument block of
    ``ao_dres_resolve`` and the persistent outputs it writes."""

    args: ctypes.Array  # kept alive: the kernel reads it through args_addr
    args_addr: int
    resolved: DeviceResolved  # views of the persistent outputs (they keep them alive)

    @classmethod
    def make(cls, table: DeviceResidency, layer: int, step: BoundStep, k: int,
             topk_dtype: torch.dtype) -> _NativeCall:
        bp, B = step.padded, step.batch
        slots = torch.empty((bp, k), dtype=torch.int32)
        miss_src = torch.empty((bp, k), dtype=torch.int64)
        miss_dst = torch.empty((bp, k), dtype=torch.int64)
        copy_src = torch.empty(bp * k, dtype=torch.int64)
        copy_dst = torch.empty(bp * k, dtype=torch.int64)
        counts = torch.empty((bp, 2), dtype=torch.int32)
        state = table.layer_state(layer)
        pos_slot = state[0]
        fields = [pos_slot.data_ptr(), pos_slot.element_size(), *(t.data_ptr() for t in state[1:]),
                  table.num_rows, table.max_positions, table.hot_size,
                  step.meta.data_ptr(), bp, step.block_table.data_ptr(),
                  step.block_table.shape[1], step.block_size,
                  torch.empty(0, dtype=topk_dtype).element_size(), k,
                  slots.data_ptr(), miss_src.data_ptr(), miss_dst.data_ptr(),
                  copy_src.data_ptr(), copy_dst.data_ptr(), counts.data_ptr()]
        lib = native.load()
        assert lib is not None  # the kernel was picked because it loads
        if len(fields) != lib.ao_dres_num_args():
            raise ResidencyError(f"native device table: {len(fields)} arguments, the library "
                                 f"takes {lib.ao_dres_num_args()}")
        args = (ctypes.c_int64 * len(fields))(*fields)
        resolved = DeviceResolved(slots[:B], miss_src[:B], miss_dst[:B], counts[:B], copy_src,
                                  copy_dst)
        return cls(args, ctypes.addressof(args), resolved)


def _gather_block(pool_rows: torch.Tensor, hot_rows: torch.Tensor) -> ctypes.Array:
    """``ao_dres_gather``'s buffer block: both contiguous host tensors of one row layout."""
    if not (pool_rows.is_contiguous() and hot_rows.is_contiguous()):
        raise ResidencyError("the native miss gather needs contiguous pool and hot rows")
    if pool_rows.dtype != hot_rows.dtype or pool_rows.shape[1:] != hot_rows.shape[1:]:
        raise ResidencyError(f"row layout differs: pool {tuple(pool_rows.shape)} "
                             f"{pool_rows.dtype}, hot {tuple(hot_rows.shape)} {hot_rows.dtype}")
    row_bytes = hot_rows[0].numel() * hot_rows.element_size() if hot_rows.shape[0] else 0
    return (ctypes.c_int64 * 5)(pool_rows.data_ptr(), pool_rows.shape[0], hot_rows.data_ptr(),
                                hot_rows.shape[0], row_bytes)


def _ints(v: torch.Tensor | Sequence[int]) -> list[int]:
    return v.tolist() if isinstance(v, torch.Tensor) else [int(x) for x in v]
