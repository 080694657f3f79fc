"""A host-only transport in front of device-resident KV: reads land in pinned host
twins, then move to the device.

Why a wrapper: the P/D consumer reads ``(remote -> local)`` byte runs into the
addresses of its wire layout and knows nothing of where the KV lives. When the
transport cannot reach device memory (Mooncake over TCP, the loopback engine), the
layout describes the host twins of ``device.HostMirror`` instead, and this engine
finishes every read by copying the blocks it filled into the device tensors
before the read returns, so a layer acknowledged to the prefill is on the device.
The prefill side stages the other way (``KVRegion.stage_out`` before a layer is
published); the wire protocol is the same either way.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from ascend_offload.transfer.base import PendingRead, ReadOp, TransferEngine, TransferError

if TYPE_CHECKING:
    import torch

    from ascend_offload.device import HostMirror


class _Span:
    """One device tensor (block index on dim 0) and the address range of its host twin."""

    __slots__ = ("block_bytes", "dev", "end", "num_blocks", "start", "stride")

    def __init__(self, dev: torch.Tensor, host: torch.Tensor) -> None:
        self.dev = dev
        self.num_blocks = host.shape[0]
        self.stride = max(1, host.stride(0) * host.element_size())
        self.block_bytes = host[0].numel() * host.element_size() if self.num_blocks else 0
        self.start = host.data_ptr()
        self.end = self.start + max(0, self.num_blocks - 1) * self.stride + self.block_bytes

    def holds(self, addr: int) -> bool:
        """``addr`` lies inside one of this tensor's blocks (not in a gap between them,
        where an interleaved tensor's blocks may be)."""
        return self.start <= addr < self.end and (addr - self.start) % self.stride < self.block_bytes


class StagedEngine(TransferEngine):
    """``inner`` reading into host twins; each read then lands its blocks on the device.

    ``pairs`` are (device tensor, its host twin), block index on dim 0, as the wire
    layout lists them (``kv_layout.block_views``); tensors sharing memory (aliased
    layers) may repeat and are landed once.
    """

    def __init__(self, inner: TransferEngine, mirror: HostMirror,
                 pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.inner = inner
        self.mirror = mirror
        self.name = f"{inner.name}+staged"
        spans: dict[tuple[int, int], _Span] = {}
        for dev, host in pairs:
            span = _Span(dev, host)
            if span.num_blocks:
                spans.setdefault((span.start, span.stride), span)
        self._spans = sorted(spans.values(), key=lambda s: s.start)
        self._starts = [s.start for s in self._spans]
        self.landed_blocks = 0  # device blocks written after reads (for stats and tests)

    @property
    def endpoint(self) -> str:
        return self.inner.endpoint

    def _register(self, addr: int, length: int) -> None:
        self.inner.register(addr, length)

    def unregister(self, addr: int) -> None:
        self.inner.unregister(addr)

    def _read(self, peer: str, ops: Sequence[ReadOp]) -> None:  # pragma: no cover - read() is overridden
        self.inner.read(peer, ops)

    def read(self, peer: str, ops: Iterable[ReadOp]) -> int:
        """The inner engine's batched read into the twins, then one device copy per run of
        blocks filled (a failed read raises before anything is landed)."""
        ops = list(ops)
        n = self.inner.read(peer, ops)
        if ops:
            self._land(ops)
        return n

    def start_read(self, peer: str, ops: Iterable[ReadOp]) -> PendingRead:
        """The inner engine's read starts now; the device copies follow in ``wait``, after it
        succeeded (as in :meth:`read`)."""
        ops = list(ops)
        return _StagedRead(self, self.inner.start_read(peer, ops), ops)

    def _land(self, ops: Sequence[ReadOp]) -> None:
        blocks: defaultdict[int, set[int]] = defaultdict(set)
        for op in ops:
            if op.length <= 0:
                continue
            i = self._find(op.local_addr)
            if i is None:
                raise TransferError(f"read into [{op.local_addr:#x}, +{op.length}) outside the staged KV")
            span = self._spans[i]
            first = (op.local_addr - span.start) // span.stride
            last = min((op.local_addr + op.length - 1 - span.start) // span.stride, span.num_blocks - 1)
            blocks[i].update(range(first, last + 1))
        for i, ids in blocks.items():
            self.mirror.from_host(self._spans[i].dev, sorted(ids))
            self.landed_blocks += len(ids)

    def _find(self, addr: int) -> int | None:
        """The span whose blocks hold ``addr``: the nearest start below it, else (tensors
        whose blocks interleave, e.g. per-head views of one buffer) a scan of all."""
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0 and self._spans[i].holds(addr):
            return i
        return next((j for j, s in enumerate(self._spans) if s.holds(addr)), None)

    def close(self) -> None:
        self.inner.close()


class _StagedRead(PendingRead):
    """An inner read into the host twins; waiting lands its blocks on the device."""

    def __init__(self, engine: StagedEngine, inner: PendingRead, ops: Sequence[ReadOp]) -> None:
        self._engine = engine
        self._inner = inner
        self._ops = ops

    def wait(self) -> int:
        n = self._inner.wait()
        if self._ops:
            self._engine._land(self._ops)
        return n
