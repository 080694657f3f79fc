"""Hot-buffer residency: which logical token sits in which hot-buffer slot.

One table per (layer, request row) of ``hot_size`` slots. One call per layer
resolves the whole batch: for every top-k position it returns the global
hot-buffer row (``row * hot_size + slot``), the list of misses (host pool row
-> hot-buffer row) to copy, and it updates the replacement state.

Replacement policies (:data:`POLICIES`): ``lru`` (exact LRU, the default) and
``arc`` (adaptive replacement: rows selected again are kept apart from rows
seen once, ghost lists of evicted positions size the two). ARC keeps a drifting
focus region that LRU trades for one-off background rows, is level with LRU on
uniform or sink + window top-k traces, and trails it slightly where a row's only
reuse comes a fixed two steps later, hence LRU stays the default (``bench
sparse`` prints every policy's hit rate per trace kind).

Two implementations with identical outputs, checked against each other on
random traces: :class:`NativeResidency` (``csrc_npu/residency.cpp`` through
ctypes, O(K + misses) per row, parallel over rows) and :class:`TorchResidency`
(vectorised torch, used when the native build is unavailable). The exact
semantics are written down at the top of ``csrc_npu/residency.cpp``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from ascend_offload import native
from ascend_offload.errors import AscendOffloadError
from ascend_offload.native import (
    ARG_BLOCK_SIZE,
    ARG_BLOCK_TABLE,
    ARG_BT_STRIDE,
    ARG_LENS,
    ARG_ROWS,
    ARG_STABLE,
    ARG_TAGS,
)

if TYPE_CHECKING:
    from ascend_offload.sparse.device_residency import DeviceResidency

logger = logging.getLogger(__name__)

MAX_HOT_SIZE = 65534  # config.MAX_TOPK_BUFFER_SIZE; a slot takes at most 16 bits of a native entry; the mark index is 16 bits
POLICIES = ("lru", "arc")  # the native table's policy ids are the indices
BACKENDS = ("host", "device")  # where a layer's resolve runs (docs/sparse.md "Device residency")


class ResidencyError(AscendOffloadError, ValueError):
    """A resolve call was given inconsistent input (names the request and value)."""


@dataclasses.dataclass
class Resolved:
    """The result of one layer's resolve for a batch.

    The native implementation returns one object per (layer, batch, top-k) shape,
    updated in place, whose tensors are views of per-layer buffers: both stay valid
    until the same layer is resolved again (the next step). The miss
    lists are the first ``num_misses`` entries of ``src_rows``/``dst_rows``;
    ``miss_src``/``miss_dst`` slice them on demand (a slice is a torch op,
    ~3 us each here, and the native copy path needs none)."""

    slots: torch.Tensor  # [B, K] int32 global hot-buffer rows, -1 for padding
    src_rows: torch.Tensor  # [>= M] int32 host-pool rows to copy (first M valid)
    dst_rows: torch.Tensor  # [>= M] int32 hot-buffer rows they go to
    counts: torch.Tensor  # [B, 2] int32: (valid positions, misses) per batch entry
    num_misses: int  # M
    num_valid: int  # valid (non-padding) top-k positions over the batch: counts[:, 0].sum()

    @property
    def miss_src(self) -> torch.Tensor:
        return self.src_rows[: self.num_misses]

    @property
    def miss_dst(self) -> torch.Tensor:
        return self.dst_rows[: self.num_misses]


@dataclasses.dataclass(frozen=True)
class PolicyState:
    """A row's replacement state beyond its slots (tests and debugging): the sizes
    of ARC's T1 / T2 (LRU: every entry is in T1), its ghost positions, least
    recent first, and its target size for T1."""

    t1: int
    t2: int
    b1: list[int]
    b2: list[int]
    p: int


class Residency(Protocol):
    num_layers: int
    num_rows: int
    hot_size: int
    kind: str
    policy: str  # one of POLICIES
    max_positions: int  # positions (tokens) one request may reach in this table

    def bind_step(self, rows: torch.Tensor, tags: torch.Tensor, stable: torch.Tensor,
                  lens: torch.Tensor, block_table: torch.Tensor, block_size: int) -> None:
        """The batch of a decode step, shared by every layer's :meth:`resolve_layer`."""

    def resolve_layer(self, layer: int, topk: torch.Tensor) -> Resolved:
        """Resolve one layer's ``[B, K]`` top-k against the bound step."""

    def resolve(self, layer: int, rows: torch.Tensor, tags: torch.Tensor, stable: torch.Tensor,
                lens: torch.Tensor, topk: torch.Tensor, block_table: torch.Tensor,
                block_size: int) -> Resolved:
        """:meth:`bind_step` then :meth:`resolve_layer` (binds this batch)."""

    def release(self, row: int) -> None: ...

    def inspect(self, layer: int, row: int) -> tuple[list[int], list[int]]: ...

    def policy_state(self, layer: int, row: int) -> PolicyState: ...


def _check_dims(num_layers: int, num_rows: int, hot_size: int, policy: str = "lru") -> None:
    if num_layers <= 0 or num_rows <= 0:
        raise ResidencyError(f"num_layers={num_layers}, num_rows={num_rows}: must be > 0")
    if not 0 < hot_size <= MAX_HOT_SIZE:
        raise ResidencyError(f"topk_buffer_size={hot_size}: must be in [1, {MAX_HOT_SIZE}]")
    if policy not in POLICIES:
        raise ResidencyError(f"key 'residency_policy'={policy!r}: accepted {', '.join(POLICIES)}")


def _host(t: torch.Tensor, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    # The common case (already host, right dtype, contiguous) returns without a torch
    # op: at batch 1 the wrapper's own overhead is comparable to the native call.
    if t.dtype is dtype and t.is_cpu and t.is_contiguous():
        return t
    return t.to(device="cpu", dtype=dtype).contiguous()


@dataclasses.dataclass
class _Step:
    """A bound step: the host tensors (kept alive: the native table reads them through
    raw pointers) and those pointers, in ``ao_res_resolve``'s argument slots."""

    rows: torch.Tensor
    tags: torch.Tensor
    stable: torch.Tensor
    lens: torch.Tensor
    block_table: torch.Tensor
    block_size: int
    ptrs: tuple[tuple[int, int], ...]
    serial: int


@dataclasses.dataclass(slots=True)
class _LayerCall:
    """One (layer, B, K) call shape of the native table: its packed argument block
    (outputs fixed, inputs per step / call), the error slots, a ctypes view of the
    counts, the result object updated in place and the step the block is bound to."""

    args: ctypes.Array
    p_args: int
    err: torch.Tensor
    counts_c: ctypes.Array
    result: Resolved
    step: int = 0


class NativeResidency:
    """The C++ table (see ``csrc_npu/residency.cpp``).

    Per decode step an attention backend binds the batch once (:meth:`bind_step`)
    and then resolves each layer with just its top-k (:meth:`resolve_layer`): the
    batch pointers are written into a layer's argument block only when the step
    changed. Why: at batch 1 the per-call Python work of the general
    :meth:`resolve` (six tensor conversions, eight pointer writes, a fresh result
    object) cost ~3 us next to an ~8 us native call."""

    kind = "native"

    def __init__(self, num_layers: int, num_rows: int, hot_size: int, *, nthreads: int = 1,
                 policy: str = "lru"):
        _check_dims(num_layers, num_rows, hot_size, policy)
        lib = native.load()
        if lib is None:
            raise RuntimeError("native residency library unavailable")
        self._lib = lib
        self.num_layers, self.num_rows, self.hot_size = num_layers, num_rows, hot_size
        self.policy = policy
        self.nthreads = max(1, nthreads)
        self._bufs: dict[int, tuple[torch.Tensor, ...]] = {}
        self._calls: dict[tuple[int, int, int], _LayerCall] = {}
        self._step: _Step | None = None
        self._serial = 0
        self._h = lib.ao_res_create_policy(num_layers, num_rows, hot_size, POLICIES.index(policy))
        if not self._h:
            raise RuntimeError("ao_res_create_policy failed")
        # An entry packs position and slot in 32 bits (2^20 positions at H = 4096).
        self.max_positions = int(lib.ao_res_max_positions(self._h))
        # The per-layer call through the CPython trampoline when it builds (~0.25 us
        # less per call than ctypes, a few percent of a batch-1 resolve).
        self._call3 = native.fastcall()
        self._fn_layer = native.address_of(lib, "ao_res_resolve_layer")

    def __del__(self) -> None:
        h = getattr(self, "_h", None)
        if h:
            self._lib.ao_res_destroy(h)
            self._h = None

    def bind_step(self, rows: torch.Tensor, tags: torch.Tensor, stable: torch.Tensor,
                  lens: torch.Tensor, block_table: torch.Tensor, block_size: int) -> None:
        rows, stable, lens = _host(rows), _host(stable), _host(lens)
        block_table, tags = _host(block_table), _host(tags, torch.int64)
        if block_table.dim() != 2 or block_table.shape[0] != rows.numel():
            raise ResidencyError(f"block_table shape {tuple(block_table.shape)} does not match "
                                 f"a batch of {rows.numel()} requests")
        self._serial += 1
        ptrs = ((ARG_ROWS, rows.data_ptr()), (ARG_TAGS, tags.data_ptr()),
                (ARG_STABLE, stable.data_ptr()), (ARG_LENS, lens.data_ptr()),
                (ARG_BLOCK_TABLE, block_table.data_ptr()), (ARG_BT_STRIDE, block_table.shape[1]),
                (ARG_BLOCK_SIZE, block_size))
        self._step = _Step(rows, tags, stable, lens, block_table, block_size, ptrs, self._serial)

    def resolve_layer(self, layer: int, topk: torch.Tensor) -> Resolved:
        step = self._step
        if step is None:
            raise ResidencyError("resolve_layer before bind_step")
        if topk.dtype is not torch.int32 or not topk.is_cpu or not topk.is_contiguous():
            topk = _host(topk)
        B, K = topk.shape
        call = self._calls.get((layer, B, K)) or self._layer_call(layer, B, K)
        args = call.args
        if call.step != step.serial:  # first use of this layer's block in this step
            if B != step.rows.numel():
                raise ResidencyError(f"layer {layer}: top-k of {B} requests, the bound step "
                                     f"has {step.rows.numel()}")
            for slot, value in step.ptrs:
                args[slot] = value
            call.step = step.serial
        if self._call3 is not None:  # releases the GIL only for batches worth it
            n = self._call3(self._fn_layer, self._h, call.p_args, topk.data_ptr(), B > 1)
        else:
            n = self._lib.ao_res_resolve_layer(self._h, call.p_args, topk.data_ptr())
        if n < 0:
            _raise_native(int(n), call.err.tolist(), layer, step.rows, step.stable, step.lens,
                          topk, K, self.hot_size, step.block_table, step.block_size,
                          self.max_positions)
        res = call.result
        res.num_misses = n
        # The valid total through a ctypes view: a numpy/torch sum costs ~7 us here.
        res.num_valid = sum(call.counts_c[0::2])
        return res

    def resolve(self, layer: int, rows: torch.Tensor, tags: torch.Tensor, stable: torch.Tensor,
                lens: torch.Tensor, topk: torch.Tensor, block_table: torch.Tensor,
                block_size: int) -> Resolved:
        self.bind_step(rows, tags, stable, lens, block_table, block_size)
        return self.resolve_layer(layer, topk)

    def _layer_call(self, layer: int, B: int, K: int) -> _LayerCall:
        """Per-layer output buffers (with their data pointers), allocated once: a
        fresh allocation per call costs more than the resolve itself at small
        batches. Results of a layer stay valid until that layer is resolved
        again, i.e. the next step."""
        if not 0 <= layer < self.num_layers:
            raise ResidencyError(f"layer={layer}: out of range [0, {self.num_layers})")
        if B > self.num_rows:
            raise ResidencyError(f"batch of {B} requests exceeds num_rows={self.num_rows}")
        cap = self.num_rows * K
        buf = self._bufs.get(layer)
        if buf is None or buf[0].numel() < cap:
            buf = (torch.empty(cap, dtype=torch.int32), torch.empty(cap, dtype=torch.int32),
                   torch.empty(cap, dtype=torch.int32),
                   torch.empty(2 * self.num_rows, dtype=torch.int32),
                   torch.empty(2, dtype=torch.int32))
            self._bufs[layer] = buf
            self._calls = {k: v for k, v in self._calls.items() if k[0] != layer}
        out, msrc, mdst, counts, err = buf
        out_v, counts_v = out[: B * K].view(B, K), counts[: 2 * B].view(B, 2)
        # Outputs fixed here, inputs per call.
        args = native.resolve_args(layer=layer, batch=B, k=K, out=out_v.data_ptr(),
                                   msrc=msrc.data_ptr(), mdst=mdst.data_ptr(),
                                   counts=counts_v.data_ptr(), err=err.data_ptr(),
                                   nthreads=self.nthreads)
        counts_c = (ctypes.c_int32 * (2 * B)).from_address(counts_v.data_ptr())
        # One result object per (layer, B, K), updated in place: its tensors are views
        # of these buffers anyway (valid until the layer's next resolve).
        call = _LayerCall(args, ctypes.addressof(args), err, counts_c,
                          Resolved(out_v, msrc, mdst, counts_v, 0, 0))
        self._calls[(layer, B, K)] = call
        return call

    def release(self, row: int) -> None:
        if self._lib.ao_res_release(self._h, row) != 0:
            raise ResidencyError(f"row={row}: out of range [0, {self.num_rows})")

    def inspect(self, layer: int, row: int) -> tuple[list[int], list[int]]:
        """(slot -> position, live slots from LRU to MRU) for tests."""
        pos = torch.empty(self.hot_size, dtype=torch.int32)
        order = torch.empty(self.hot_size, dtype=torch.int32)
        n = self._lib.ao_res_inspect(self._h, layer, row, pos.data_ptr(), order.data_ptr())
        if n < 0:
            raise ResidencyError(f"layer={layer}, row={row}: out of range")
        return pos.tolist(), order[:n].tolist()

    def policy_state(self, layer: int, row: int) -> PolicyState:
        info = torch.empty(6, dtype=torch.int32)
        b1 = torch.empty(self.hot_size, dtype=torch.int32)
        b2 = torch.empty(self.hot_size, dtype=torch.int32)
        if self._lib.ao_res_policy_state(self._h, layer, row, info.data_ptr(), b1.data_ptr(),
                                         b2.data_ptr()) < 0:
            raise ResidencyError(f"layer={layer}, row={row}: out of range")
        _, n1, n2, g1, g2, p = info.tolist()
        return PolicyState(n1, n2, b1[:g1].tolist(), b2[:g2].tolist(), p)


def _raise_native(code: int, err: list[int], layer: int, rows: torch.Tensor, stable: torch.Tensor,
                  lens: torch.Tensor, topk: torch.Tensor, K: int, hot_size: int,
                  block_table: torch.Tensor, block_size: int, max_positions: int) -> None:
    b, i = err
    if code == -1:
        raise ResidencyError(
            f"layer {layer}, batch entry {b} (row {int(rows[b])}): top-k[{i}]={int(topk[b, i])} "
            f"outside [-1, len={int(lens[b])})")
    if code == -2:
        raise ResidencyError(
            f"layer {layer}, batch entry {b}: stable={int(stable[b])}, len={int(lens[b])}: need "
            f"0 <= stable <= len <= block_table width {block_table.shape[1]} * {block_size}")
    if code == -3:
        raise ResidencyError(f"layer {layer}, batch entry {b}: row id out of range or repeated")
    if code == -6:
        raise ResidencyError(
            f"layer {layer}, batch entry {b}: len={int(lens[b])} exceeds the "
            f"{max_positions} positions the native table holds "
            f"at topk_buffer_size={hot_size} (use a smaller buffer or use_native='off')")
    if code == -5:
        raise ResidencyError(f"layer={layer}, K={K}, block_size={block_size}: bad arguments "
                             f"(need K <= topk_buffer_size={hot_size}, block_size > 0)")
    raise RuntimeError(f"native residency internal error {code} at batch entry {b}, index {i}")


@dataclasses.dataclass
class _TwinRow:
    tag: int
    slot_pos: torch.Tensor  # [H] int64, -1 = free
    stamp: torch.Tensor  # [H] int64, recency (larger = newer), 0 for free slots
    map: torch.Tensor  # [capacity] int64 position -> slot, -1 = absent
    seg: torch.Tensor  # [H] int64: ARC's T1 (0) or T2 (1); always 0 under LRU
    ghost: torch.Tensor  # [capacity] int64 position -> 0, or the ghost list B1 (1) / B2 (2)
    gstamp: torch.Tensor  # [capacity] int64: order within a ghost list (larger = newer)
    clock: int = 1
    gclock: int = 1
    p: int = 0  # ARC's target size of T1


class TorchResidency:
    """Pure-torch twin of the native table: same semantics, same outputs."""

    kind = "torch"

    def __init__(self, num_layers: int, num_rows: int, hot_size: int, *, policy: str = "lru"):
        _check_dims(num_layers, num_rows, hot_size, policy)
        self.num_layers, self.num_rows, self.hot_size = num_layers, num_rows, hot_size
        self.policy = policy
        self.max_positions = 2**62  # int64 tensors: no practical limit
        self._rows: dict[tuple[int, int], _TwinRow] = {}
        self._step: tuple | None = None

    def _fresh(self, tag: int, cap: int) -> _TwinRow:
        H, cap = self.hot_size, max(cap, 1)
        return _TwinRow(tag, torch.full((H,), -1, dtype=torch.int64),
                        torch.zeros(H, dtype=torch.int64), torch.full((cap,), -1, dtype=torch.int64),
                        torch.zeros(H, dtype=torch.int64), torch.zeros(cap, dtype=torch.int64),
                        torch.zeros(cap, dtype=torch.int64))

    def bind_step(self, rows: torch.Tensor, tags: torch.Tensor, stable: torch.Tensor,
                  lens: torch.Tensor, block_table: torch.Tensor, block_size: int) -> None:
        self._step = (rows, tags, stable, lens, block_table, block_size)

    def resolve_layer(self, layer: int, topk: torch.Tensor) -> Resolved:
        if self._step is None:
            raise ResidencyError("resolve_layer before bind_step")
        rows, tags, stable, lens, block_table, block_size = self._step
        return self._resolve(layer, rows, tags, stable, lens, topk, block_table, block_size)

    def resolve(self, layer: int, rows: torch.Tensor, tags: torch.Tensor, stable: torch.Tensor,
                lens: torch.Tensor, topk: torch.Tensor, block_table: torch.Tensor,
                block_size: int) -> Resolved:
        self.bind_step(rows, tags, stable, lens, block_table, block_size)
        return self._resolve(layer, rows, tags, stable, lens, topk, block_table, block_size)

    def _resolve(self, layer: int, rows: torch.Tensor, tags: torch.Tensor, stable: torch.Tensor,
                 lens: torch.Tensor, topk: torch.Tensor, block_table: torch.Tensor,
                 block_size: int) -> Resolved:
        topk = topk.to("cpu", torch.int64)
        bt = block_table.to("cpu", torch.int64)
        rows_l, tags_l = rows.tolist(), tags.tolist()
        stable_l, lens_l = stable.tolist(), lens.tolist()
        B, K = topk.shape
        if not 0 <= layer < self.num_layers or K > self.hot_size or block_size <= 0:
            raise ResidencyError(f"layer={layer}, K={K}, block_size={block_size}: bad arguments "
                                 f"(need K <= topk_buffer_size={self.hot_size}, block_size > 0)")
        if len(set(rows_l)) != B or any(not 0 <= r < self.num_rows for r in rows_l):
            bad = next(b for b, r in enumerate(rows_l)
                       if not 0 <= r < self.num_rows or rows_l.index(r) != b)
            raise ResidencyError(f"layer {layer}, batch entry {bad}: row id out of range or repeated")
        # Validate every entry before touching any state: a rejected call changes nothing.
        for b in range(B):
            length, st_len = lens_l[b], stable_l[b]
            if length < 0 or st_len < 0 or st_len > length or length > bt.shape[1] * block_size:
                raise ResidencyError(
                    f"layer {layer}, batch entry {b}: stable={st_len}, len={length}: need "
                    f"0 <= stable <= len <= block_table width {bt.shape[1]} * {block_size}")
            bad = ((topk[b] < -1) | (topk[b] >= length)).nonzero()
            if bad.numel():
                i = int(bad[0, 0])
                raise ResidencyError(
                    f"layer {layer}, batch entry {b} (row {rows_l[b]}): top-k[{i}]="
                    f"{int(topk[b, i])} outside [-1, len={length})")
        out = torch.empty((B, K), dtype=torch.int32)
        counts = torch.empty((B, 2), dtype=torch.int32)
        srcs: list[torch.Tensor] = []
        dsts: list[torch.Tensor] = []
        for b in range(B):
            s_out, msrc, mdst, nvalid = self._resolve_row(
                layer, b, rows_l[b], tags_l[b], stable_l[b], lens_l[b], topk[b], bt[b],
                block_size)
            out[b] = s_out
            counts[b, 0], counts[b, 1] = nvalid, msrc.numel()
            srcs.append(msrc)
            dsts.append(mdst)
        msrc_all = torch.cat(srcs).to(torch.int32) if srcs else torch.empty(0, dtype=torch.int32)
        mdst_all = torch.cat(dsts).to(torch.int32) if dsts else torch.empty(0, dtype=torch.int32)
        return Resolved(out, msrc_all, mdst_all, counts, int(msrc_all.numel()),
                        int(counts[:, 0].sum()))

    def _resolve_row(self, layer: int, b: int, row: int, tag: int, stable: int, length: int,
                     topk: torch.Tensor, bt: torch.Tensor, block_size: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        H = self.hot_size
        base = row * H
        key = (layer, row)
        st = self._rows.get(key)
        if st is None or st.tag != tag:
            st = self._fresh(tag, length)
            self._rows[key] = st
        if st.map.numel() < length:
            n = st.map.numel()
            cap = max(length, 2 * n)
            st.map = torch.cat([st.map, torch.full((cap - n,), -1, dtype=torch.int64)])
            st.ghost = torch.cat([st.ghost, torch.zeros(cap - n, dtype=torch.int64)])
            st.gstamp = torch.cat([st.gstamp, torch.zeros(cap - n, dtype=torch.int64)])
        # Forget speculative positions (they may be rolled back).
        inval = st.slot_pos >= stable
        if bool(inval.any()):
            st.map[st.slot_pos[inval]] = -1
            st.slot_pos[inval] = -1
            st.stamp[inval] = 0
            st.seg[inval] = 0
        st.ghost[stable:] = 0
        valid = topk >= 0
        slot = torch.where(valid, st.map[topk.clamp(min=0)], -1)
        hit = slot >= 0
        hit_idx = hit.nonzero().flatten()
        miss_occ = (valid & ~hit).nonzero().flatten()
        mpos = topk[miss_occ]
        uniq, inv = torch.unique(mpos, return_inverse=True)
        first = torch.full((uniq.numel(),), topk.numel(), dtype=torch.int64).scatter_reduce(
            0, inv, torch.arange(mpos.numel()), "amin")
        order = first.argsort()
        miss_pos = uniq[order]
        m = miss_pos.numel()
        free = (st.slot_pos < 0).nonzero().flatten()
        nf = min(m, free.numel())
        new_slots = free[:nf]
        cand = st.slot_pos >= 0
        cand[slot[hit_idx]] = False
        if m - nf > int(cand.sum()):
            raise RuntimeError("torch residency: not enough evictable slots (K > hot size?)")
        if self.policy == "arc":
            new_slots, to_t2 = self._arc_victims(st, cand, miss_pos, new_slots, m - nf)
            st.seg[slot[hit_idx]] = 1
            st.seg[new_slots] = to_t2
        elif m > nf:
            cand_idx = cand.nonzero().flatten()
            victims = cand_idx[st.stamp[cand_idx].argsort()[: m - nf]]
            st.map[st.slot_pos[victims]] = -1
            new_slots = torch.cat([new_slots, victims])
        st.slot_pos[new_slots] = miss_pos
        st.map[miss_pos] = new_slots
        rank = torch.empty(m, dtype=torch.int64)
        rank[order] = torch.arange(m)
        occ_slots = new_slots[rank[inv]]
        res = torch.full((topk.numel(),), -1, dtype=torch.int64)
        res[hit_idx] = base + slot[hit_idx]
        res[miss_occ] = base + occ_slots
        # Each distinct position is touched once, at its first occurrence: hits in
        # top-k order, then misses ("amin" keeps a repeated slot's first touch).
        touched = torch.cat([slot[hit_idx], occ_slots])
        stamps = st.clock + torch.arange(touched.numel())
        st.stamp.scatter_reduce_(0, touched, stamps, "amin", include_self=False)
        st.clock += touched.numel()
        blk = bt[miss_pos // block_size]
        msrc = blk * block_size + miss_pos % block_size
        return res.to(torch.int32), msrc, base + new_slots, int(valid.sum())

    def _arc_victims(self, st: _TwinRow, cand: torch.Tensor, miss_pos: torch.Tensor,
                     free: torch.Tensor, nv: int) -> tuple[torch.Tensor, torch.Tensor]:
        """ARC's part of a row's call (semantics at the top of residency.cpp): adapt
        the T1 target from the ghost misses, pick the victims of T1 and T2, move their
        positions to the ghost lists and trim those. Returns the misses' slots and
        whether each goes to T2 (a ghost miss)."""
        H = self.hot_size
        gcls = st.ghost[miss_pos]
        g1, g2 = int((gcls == 1).sum()), int((gcls == 2).sum())
        b1, b2 = int((st.ghost == 1).sum()), int((st.ghost == 2).sum())
        p = st.p + (g1 * max(1, b2 // b1) if g1 else 0) - (g2 * max(1, b1 // b2) if g2 else 0)
        st.p = min(max(p, 0), H)
        st.ghost[miss_pos] = 0
        c1 = (cand & (st.seg == 0)).nonzero().flatten()
        c2 = (cand & (st.seg == 1)).nonzero().flatten()
        c1, c2 = c1[st.stamp[c1].argsort()], c2[st.stamp[c2].argsort()]  # least recent first
        k1, k2, fresh = c1.numel(), c2.numel(), miss_pos.numel() - g1 - g2
        e1 = min(k1, max(nv - k2, min(nv, max(0, k1 + fresh - st.p))))
        victims = (c1[:e1], c2[: nv - e1])
        for lst, v in ((1, victims[0]), (2, victims[1])):
            vpos = st.slot_pos[v]
            st.map[vpos] = -1
            st.ghost[vpos] = lst
            st.gstamp[vpos] = st.gclock + torch.arange(vpos.numel())
            st.gclock += vpos.numel()
        # Least recent ghosts go first: |T1| + |B1| <= H, then |B1| + |B2| <= H.
        self._trim_ghosts(st, 1, k1 - e1 + fresh + int((st.ghost == 1).sum()) - H)
        self._trim_ghosts(st, 2, int((st.ghost != 0).sum()) - H)
        return torch.cat([free, *victims]), (gcls != 0).to(torch.int64)

    @staticmethod
    def _trim_ghosts(st: _TwinRow, lst: int, over: int) -> None:
        if over > 0:
            g = (st.ghost == lst).nonzero().flatten()
            st.ghost[g[st.gstamp[g].argsort()[:over]]] = 0

    def release(self, row: int) -> None:
        if not 0 <= row < self.num_rows:
            raise ResidencyError(f"row={row}: out of range [0, {self.num_rows})")
        for layer in range(self.num_layers):
            self._rows.pop((layer, row), None)

    def inspect(self, layer: int, row: int) -> tuple[list[int], list[int]]:
        st = self._rows.get((layer, row))
        if st is None:
            return [-1] * self.hot_size, []
        live = (st.slot_pos >= 0).nonzero().flatten()
        order = live[(st.seg[live] * (st.clock + 1) + st.stamp[live]).argsort()]  # T1, then T2
        return st.slot_pos.tolist(), order.tolist()

    def policy_state(self, layer: int, row: int) -> PolicyState:
        st = self._rows.get((layer, row))
        if st is None:
            return PolicyState(0, 0, [], [], 0)
        live = st.slot_pos >= 0
        n2 = int((live & (st.seg == 1)).sum())

        def ghosts(lst: int) -> list[int]:
            g = (st.ghost == lst).nonzero().flatten()
            return g[st.gstamp[g].argsort()].tolist()

        return PolicyState(int(live.sum()) - n2, n2, ghosts(1), ghosts(2), st.p)


TRISTATE = ("auto", "on", "off")  # the use_native and device_compile keys


def check_choice(key: str, value: str) -> None:
    """Raise naming ``key`` unless ``value`` is one of :data:`TRISTATE`: both residency
    factories and both tables check these keys the same way."""
    if value not in TRISTATE:
        raise ResidencyError(f"key {key!r}={value!r}: accepted 'auto', 'on', 'off'")


def make_residency(num_layers: int, num_rows: int, hot_size: int, *, use_native: str = "auto",
                   nthreads: int = 1, policy: str = "lru", backend: str = "host",
                   max_positions: int | None = None, device: torch.device | str | None = None,
                   batch_sizes: Sequence[int] | None = None, device_compile: str = "auto"
                   ) -> NativeResidency | TorchResidency | DeviceResidency:
    """``backend``: ``host`` (this module's tables) or ``device`` (the static-shape table
    of :mod:`~ascend_offload.sparse.device_residency`, exact LRU only, on ``device``,
    indexing ``max_positions`` positions per request, padded to ``batch_sizes``).
    ``use_native``: ``auto`` (native if it builds, else the twin, logged once; device:
    the C++ kernel where the table's device is the host, else the tensor ops), ``on``
    (native or raise), ``off`` (the twin; device: the tensor ops). ``policy``: one of
    :data:`POLICIES`. ``device_compile`` (device backend, tensor ops only): ``auto``
    compiles them with ``torch.compile`` where the platform compiles them well (CUDA),
    ``on`` always, ``off`` never; the host backend checks it and ignores it."""
    if backend not in BACKENDS:
        raise ResidencyError(f"key 'residency_backend'={backend!r}: accepted {', '.join(BACKENDS)}")
    check_choice("use_native", use_native)
    check_choice("device_compile", device_compile)
    _check_dims(num_layers, num_rows, hot_size, policy)
    if backend == "device":
        if policy != "lru":
            raise ResidencyError(f"key 'residency_policy'={policy!r} with residency_backend "
                                 "'device': the device table is exact LRU only")
        if max_positions is None:
            raise ResidencyError("the device residency needs max_positions (its map's width)")
        from ascend_offload.sparse.device_residency import DeviceResidency

        return DeviceResidency(num_layers, num_rows, hot_size, max_positions=max_positions,
                               device=device, batch_sizes=batch_sizes, use_native=use_native,
                               compile_kernel=device_compile)
    if use_native != "off":
        if native.available():
            return NativeResidency(num_layers, num_rows, hot_size, nthreads=nthreads, policy=policy)
        if use_native == "on":
            raise RuntimeError("use_native='on' but the native residency library could not be "
                               "built or loaded (see the log for the compiler output)")
    return TorchResidency(num_layers, num_rows, hot_size, policy=policy)
