"""Worker-side store whose object placement is decided by the scheduler.

Why: in vLLM the scheduler (which must answer prefix lookups) and the workers
(which hold the bytes) are different processes. The scheduler's index
(``LocalStore(with_data=False)``) allocates, pins and evicts; each step it tells
the workers which page every block object of that step lives in. This class
serves the :class:`~ascend_offload.store.base.KVStore` contract to the layerwise
pipeline from those placements: an object key is ``block_key + "|" + layer``, its
bytes are row ``page`` of that layer's host plane.

A (block, layer) object is readable only if this rank committed it *at the page
the scheduler names now*: a key evicted and later stored again elsewhere can
never be read from its old page (invariant I3).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

import torch

from ascend_offload import device
from ascend_offload.store.base import KVStore, Pin, StoreError, StoreStats, WriteHandle

SEP = "|"


def split_key(key: str) -> tuple[str, str]:
    block, sep, layer = key.rpartition(SEP)
    if not sep:
        raise StoreError(f"key {key!r} is not '<block key>{SEP}<layer>'")
    return block, layer


@dataclasses.dataclass
class _Pending:
    block: str
    layer: str
    page: int


class ScheduledPageStore(KVStore):
    """Per-rank host planes (one ``[num_pages, layer_block_bytes]`` tensor per layer)."""

    row_addressable = True

    def __init__(self, layer_block_bytes: Mapping[str, int], num_pages: int) -> None:
        self.num_pages = num_pages
        self.planes = {
            name: device.empty_host((num_pages, nbytes), torch.uint8)
            for name, nbytes in layer_block_bytes.items()
        }
        self._layers = frozenset(self.planes)
        self._lock = threading.Lock()
        self._pages: dict[str, int] = {}  # this step's placements: block key -> page
        self._save_blocks: frozenset[str] = frozenset()
        self._committed: dict[tuple[str, str], int] = {}  # (block, layer) -> page
        self._pending: dict[int, _Pending] = {}
        self._layers_done: Counter[str] = Counter()
        self._done: set[str] = set()
        self._failed: set[str] = set()
        self._tokens = itertools.count(1)
        self._stats = StoreStats(total_pages=num_pages)

    # ------------------------------------------------------------ scheduler input

    def set_step(self, pages: Mapping[str, int], save_blocks: Iterable[str], freed: Iterable[str]) -> None:
        """Placements for the coming step; ``freed`` block keys lost their pages."""
        with self._lock:
            for block in freed:
                for layer in self._layers:
                    self._committed.pop((block, layer), None)
                self._layers_done.pop(block, None)
            self._pages = dict(pages)
            self._save_blocks = frozenset(save_blocks)

    def mark_filled(self, pages: Mapping[str, int]) -> None:
        """Blocks whose every layer was written at ``pages[block]`` outside this store
        (fetched from a shared tier): readable once the scheduler names that page."""
        with self._lock:
            for block, page in pages.items():
                for layer in self._layers:
                    self._committed[(block, layer)] = page

    def committed_page(self, block: str) -> int | None:
        """The page holding every layer of ``block`` on this rank, or None."""
        with self._lock:
            pages = {self._committed.get((block, layer)) for layer in self._layers}
        return pages.pop() if len(pages) == 1 else None

    def take_results(self) -> tuple[set[str], set[str]]:
        """Blocks whose every layer was committed / some layer failed since the last call."""
        with self._lock:
            done, failed = self._done - self._failed, set(self._failed)
            self._done, self._failed = set(), set()
            return done, failed

    # ------------------------------------------------------------ helpers

    def _place(self, key: str) -> tuple[str, str, int]:
        block, layer = split_key(key)
        if layer not in self._layers:
            raise StoreError(f"key {key!r}: unknown layer {layer!r}")
        page = self._pages.get(block)
        if page is None:
            raise StoreError(f"key {key!r}: the scheduler placed no page for this step")
        return block, layer, page

    def _readable(self, key: str) -> bool:
        block, layer = split_key(key)
        page = self._pages.get(block)
        return page is not None and self._committed.get((block, layer)) == page

    # ------------------------------------------------------------ contract

    def allocate(self, keys: Sequence[str], sizes: Sequence[int]) -> list[WriteHandle | None] | None:
        out: list[WriteHandle | None] = []
        with self._lock:
            for key, size in zip(keys, sizes, strict=True):
                block, layer = split_key(key)
                page = self._pages.get(block)
                if (
                    block not in self._save_blocks
                    or page is None
                    or self._committed.get((block, layer)) == page
                ):
                    # not placed (store full) or already stored: nothing to write
                    self._stats.duplicate_stores += 1
                    out.append(None)
                    continue
                if size != self.planes[layer].shape[1]:
                    raise StoreError(f"key {key!r}: size {size} != layer block bytes {self.planes[layer].shape[1]}")
                token = next(self._tokens)
                self._pending[token] = _Pending(block, layer, page)
                out.append(WriteHandle(key=key, size=size, token=token))
                self._stats.allocated_objects += 1
        return out

    def write(self, handle: WriteHandle, offset: int, src: torch.Tensor) -> None:
        with self._lock:
            p = self._pending.get(handle.token)
        if p is None:
            raise StoreError(f"write handle for {handle.key!r} is not pending")
        data = src.reshape(-1).view(torch.uint8)
        row = self.planes[p.layer][p.page]
        if offset < 0 or offset + data.numel() > row.numel():
            raise StoreError(f"write of {data.numel()} bytes at {offset} outside {handle.key!r}")
        row[offset : offset + data.numel()].copy_(data)
        with self._lock:
            self._stats.bytes_written += data.numel()

    def commit(self, handles: Sequence[WriteHandle]) -> None:
        with self._lock:
            for h in handles:
                p = self._pending.pop(h.token, None)
                if p is None:
                    raise StoreError(f"commit of {h.key!r}: not pending")
                self._committed[(p.block, p.layer)] = p.page
                self._stats.committed_objects += 1
                self._layers_done[p.block] += 1
                if self._layers_done[p.block] == len(self._layers):
                    self._done.add(p.block)

    def abort(self, handles: Sequence[WriteHandle]) -> None:
        with self._lock:
            for h in handles:
                p = self._pending.pop(h.token, None)
                if p is not None:
                    self._failed.add(p.block)
                    self._stats.aborted_objects += 1

    def lookup_prefix(self, keys: Sequence[str]) -> int:
        with self._lock:
            return self._stats.count_prefix(keys, self._readable)

    def pin(self, keys: Sequence[str]) -> Pin | None:
        """Placement is pinned by the scheduler for the whole step; this only checks."""
        with self._lock:
            if not all(self._readable(k) for k in keys):
                return None
            return Pin(keys=tuple(keys), token=next(self._tokens))

    def _pinned_place(self, pin: Pin, key: str) -> tuple[str, int]:
        """(layer, page) of a pinned, readable key (call with the lock held)."""
        if key not in pin.keys:
            raise StoreError(f"read of {key!r} without an active pin")
        if not self._readable(key):
            raise StoreError(f"read of {key!r}: not committed at its current page")
        _, layer, page = self._place(key)
        return layer, page

    def read(self, pin: Pin, key: str, offset: int, dst: torch.Tensor) -> None:
        with self._lock:
            layer, page = self._pinned_place(pin, key)
        out = dst.reshape(-1).view(torch.uint8)
        row = self.planes[layer][page]
        if offset < 0 or offset + out.numel() > row.numel():
            raise StoreError(f"read of {out.numel()} bytes at {offset} outside {key!r}")
        out.copy_(row[offset : offset + out.numel()])
        with self._lock:
            self._stats.reads += 1
            self._stats.bytes_read += out.numel()

    def unpin(self, pin: Pin) -> None:
        return None

    def pinned_rows(self, pin: Pin, keys: Sequence[str]) -> tuple[torch.Tensor, list[int]] | None:
        """One layer's keys map to rows of that layer's plane (mixed layers: None)."""
        pages: list[int] = []
        layers = set()
        with self._lock:
            for key in keys:
                layer, page = self._pinned_place(pin, key)
                layers.add(layer)
                pages.append(page)
            if len(layers) != 1:
                return None
            (layer,) = layers
            plane = self.planes[layer]
            self._stats.reads += len(keys)
            self._stats.bytes_read += len(keys) * plane.shape[1]
        return plane, pages

    def pending_rows(self, handles: Sequence[WriteHandle]) -> tuple[torch.Tensor, list[int]] | None:
        with self._lock:
            ps = [self._pending.get(h.token) for h in handles]
            if any(p is None for p in ps):
                bad = next(h.key for h, p in zip(handles, ps, strict=True) if p is None)
                raise StoreError(f"write handle for {bad!r} is not pending")
            layers = {p.layer for p in ps if p is not None}
            if len(layers) != 1:
                return None
            plane = self.planes[layers.pop()]
            self._stats.bytes_written += len(handles) * plane.shape[1]
        return plane, [p.page for p in ps if p is not None]

    def stats(self) -> StoreStats:
        with self._lock:
            s = dataclasses.replace(self._stats)
            s.pending_objects = len(self._pending)
            s.stored_objects = len(self._committed)
            return s
