"""A tiny in-memory KVStore for the layerwise unit tests (the contract of store/base.py).

Why here: the pipeline must be testable without the page-pool store; this one
keeps each object in its own bytearray and enforces pending/committed/pinned.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence

import torch

from ascend_offload.store.base import KVStore, Pin, StoreError, StoreStats, WriteHandle


class DictStore(KVStore):
    def __init__(self, capacity_objects: int = 1 << 20) -> None:
        self.capacity = capacity_objects
        self._data: dict[str, torch.Tensor] = {}
        self._committed: set[str] = set()
        self._pending: dict[str, int] = {}
        self._pins: dict[int, tuple[str, ...]] = {}
        self._tok = itertools.count(1)
        self._lock = threading.Lock()
        self._stats = StoreStats()
        self.writes: list[str] = []

    def allocate(self, keys: Sequence[str], sizes: Sequence[int]) -> list[WriteHandle | None] | None:
        with self._lock:
            new = [k for k in keys if k not in self._data]
            if len(self._data) + len(new) > self.capacity:
                self._stats.skipped_stores += len(new)
                return None
            out: list[WriteHandle | None] = []
            for k, size in zip(keys, sizes, strict=True):
                if k in self._data:
                    out.append(None)
                    self._stats.duplicate_stores += 1
                    continue
                tok = next(self._tok)
                self._data[k] = torch.zeros(size, dtype=torch.uint8)
                self._pending[k] = tok
                self._stats.allocated_objects += 1
                out.append(WriteHandle(k, size, tok))
            return out

    def write(self, handle: WriteHandle, offset: int, src: torch.Tensor) -> None:
        with self._lock:
            if self._pending.get(handle.key) != handle.token:
                raise StoreError(f"write to non-pending {handle.key}")
            buf = self._data[handle.key]
        raw = src.contiguous().view(torch.uint8).reshape(-1)
        buf[offset : offset + raw.numel()].copy_(raw)
        self._stats.bytes_written += raw.numel()
        self.writes.append(handle.key)

    def commit(self, handles: Sequence[WriteHandle]) -> None:
        with self._lock:
            for h in handles:
                if self._pending.get(h.key) != h.token:
                    raise StoreError(f"commit of unknown handle {h.key}")
                del self._pending[h.key]
                self._committed.add(h.key)
                self._stats.committed_objects += 1

    def abort(self, handles: Sequence[WriteHandle]) -> None:
        with self._lock:
            for h in handles:
                if self._pending.get(h.key) == h.token:
                    del self._pending[h.key]
                    del self._data[h.key]
                    self._stats.aborted_objects += 1

    def lookup_prefix(self, keys: Sequence[str]) -> int:
        with self._lock:
            n = 0
            for k in keys:
                if k not in self._committed:
                    break
                n += 1
            return n

    def pin(self, keys: Sequence[str]) -> Pin | None:
        with self._lock:
            if any(k not in self._committed for k in keys):
                return None
            p = Pin(tuple(keys), next(self._tok))
            self._pins[p.token] = p.keys
            return p

    def read(self, pin: Pin, key: str, offset: int, dst: torch.Tensor) -> None:
        with self._lock:
            if key not in self._pins.get(pin.token, ()):
                raise StoreError(f"read of unpinned {key}")
            buf = self._data[key]
        raw = dst.view(torch.uint8).reshape(-1)
        if offset + raw.numel() > buf.numel():
            raise StoreError(f"read past the end of {key}")
        raw.copy_(buf[offset : offset + raw.numel()])
        self._stats.reads += 1

    def unpin(self, pin: Pin) -> None:
        with self._lock:
            self._pins.pop(pin.token, None)

    def evict(self, key: str) -> None:
        """Test hook: drop a committed object as an eviction would."""
        with self._lock:
            self._committed.discard(key)
            self._data.pop(key, None)

    def stats(self) -> StoreStats:
        return self._stats
