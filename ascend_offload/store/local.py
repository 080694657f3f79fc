"""The embedded default store: a host pool of fixed-size pages.

Objects span any set of pages (no contiguous extent is needed, so the pool
never fragments into unusable holes). One lock guards the metadata; byte copies
into a *pending* object run outside it because nobody else can reach a pending
object, and reads run under a pin, which eviction respects.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from collections.abc import Sequence

import torch

from ascend_offload import device
from ascend_offload.store.base import KVStore, Pin, StoreError, StoreStats, WriteHandle
from ascend_offload.store.eviction import make_policy

log = logging.getLogger(__name__)


class _Object:
    """Per-object metadata (slots: one is made per stored block)."""

    __slots__ = ("committed", "pages", "pins", "size", "token")

    def __init__(self, size: int, pages: list[int], token: int) -> None:
        self.size = size
        self.pages = pages
        self.token = token
        self.committed = False
        self.pins = 0


class LocalStore(KVStore):
    """Thread-safe page-pool store; committed, unpinned objects are evicted in the
    order of its eviction policy (``lru`` or ``arc``, store/eviction.py)."""

    def __init__(
        self, capacity_bytes: int, page_bytes: int, eviction: str = "lru", *, with_data: bool = True
    ) -> None:
        """``with_data=False`` keeps only the index: vLLM's scheduler decides pages
        while each worker rank holds the bytes of its own shard (see connectors/store/)."""
        if page_bytes <= 0:
            raise ValueError(f"page_bytes must be > 0, got {page_bytes}")
        num_pages = capacity_bytes // page_bytes  # a remainder smaller than a page is unused
        if num_pages < 1:
            raise ValueError(
                f"capacity_bytes={capacity_bytes} holds no page of page_bytes={page_bytes}"
            )
        self.page_bytes = page_bytes
        self.num_pages = num_pages
        # committed objects; an object has >= 1 page, so at most num_pages of them
        self._policy = make_policy(eviction, num_pages)
        self._pool = device.empty_host((num_pages if with_data else 0, page_bytes), torch.uint8)
        self._flat = self._pool.view(-1)
        self._words = device.as_words(self._pool) if with_data else self._pool
        self._with_data = with_data
        self.row_addressable = with_data
        # Popped from the end: a fresh pool hands out pages 0, 1, 2, ... (runs copy as one).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._objects: dict[str, _Object] = {}
        self._pins: dict[int, frozenset[str]] = {}
        self._evictable = 0  # pages of committed, unpinned objects (kept exact, O(1) checks)
        self._freed: list[str] = []  # keys that lost their pages since take_freed()
        self._tokens = itertools.count(1)
        self._lock = threading.Lock()
        self._stats = StoreStats(total_pages=num_pages, free_pages=num_pages)

    # ------------------------------------------------------------------ helpers

    def _pages_for(self, size: int) -> int:
        return (size + self.page_bytes - 1) // self.page_bytes  # size > 0 is checked

    def _evict_until(self, needed: int) -> None:
        """Evict committed, unpinned objects in the policy's order until ``needed`` pages
        are free (the caller checked that free + evictable pages suffice)."""
        objects = self._objects
        victims, freed, want = [], 0, needed - len(self._free)
        # no pin held: no predicate, so no Python call per candidate
        pinned = (lambda k: objects[k].pins > 0) if self._pins else None
        for key in self._policy.victims(pinned):
            obj = objects[key]
            if obj.pins:  # a policy may yield pinned keys (LRU does: cheaper to check here)
                continue
            victims.append(key)
            freed += len(obj.pages)
            if freed >= want:
                break
        self._policy.evict_many(victims)  # after the walk: its order must not change under it
        for key in victims:
            obj = objects.pop(key)
            self._freed.append(key)
            self._free.extend(reversed(obj.pages))
            self._evictable -= len(obj.pages)
            self._stats.evicted_objects += 1

    def _need_data(self) -> None:
        if not self._with_data:
            raise StoreError("this LocalStore is an index only; bytes live in the worker pools")

    def pages(self, key: str) -> list[int]:
        """Page numbers of an allocated object (for index-only stores)."""
        with self._lock:
            obj = self._objects.get(key)
            if obj is None:
                raise StoreError(f"no object {key!r}")
            return list(obj.pages)

    def _pending_object(self, handle: WriteHandle) -> _Object:
        obj = self._objects.get(handle.key)
        if obj is None or obj.token != handle.token or obj.committed:
            raise StoreError(f"write handle for {handle.key!r} is not a pending allocation")
        return obj

    def _runs(self, obj: _Object, offset: int, nbytes: int) -> list[tuple[int, int, int]]:
        """(pool byte offset, object byte offset, length) runs covering the range,
        merging consecutive pages into one run."""
        if offset < 0 or offset + nbytes > obj.size:
            raise StoreError(
                f"byte range [{offset}, {offset + nbytes}) outside object of {obj.size} bytes"
            )
        runs: list[tuple[int, int, int]] = []
        pos, end, p = offset, offset + nbytes, self.page_bytes
        while pos < end:
            idx, within = divmod(pos, p)
            length = min(p - within, end - pos)
            start = obj.pages[idx] * p + within
            if runs and runs[-1][0] + runs[-1][2] == start:
                a, b, n = runs[-1]
                runs[-1] = (a, b, n + length)
            else:
                runs.append((start, pos - offset, length))
            pos += length
        return runs

    @staticmethod
    def _bytes(t: torch.Tensor) -> torch.Tensor:
        if not t.is_contiguous():
            raise StoreError("store copies need contiguous tensors")
        return t.reshape(-1).view(torch.uint8)

    def _single_page_rows(self, objs: Sequence[_Object]) -> list[int] | None:
        """Page indices when every object is exactly one full page (one indexed copy)."""
        if all(len(o.pages) == 1 and o.size == self.page_bytes for o in objs):
            return [o.pages[0] for o in objs]
        return None

    # ------------------------------------------------------------------ contract

    def allocate(self, keys: Sequence[str], sizes: Sequence[int]) -> list[WriteHandle | None] | None:
        if len(keys) != len(sizes):
            raise StoreError(f"allocate: {len(keys)} keys but {len(sizes)} sizes")
        with self._lock:
            out: list[WriteHandle | None] = [None] * len(keys)
            new: list[tuple[int, str, int]] = []
            seen: set[str] = set()
            objects, page = self._objects, self.page_bytes
            needed = 0
            for i, key in enumerate(keys):
                size = sizes[i]
                if size <= 0:
                    raise StoreError(f"allocate: size of {key!r} must be > 0, got {size}")
                if key in objects or key in seen:
                    self._stats.duplicate_stores += 1
                    continue
                seen.add(key)
                new.append((i, key, size))
                needed += 1 if size <= page else self._pages_for(size)
            if needed > len(self._free):
                if needed > len(self._free) + self._evictable:
                    self._stats.skipped_stores += len(new)
                    return None
                self._evict_until(needed)
            free, tokens = self._free, self._tokens
            for i, key, size in new:
                pages = [free.pop()] if size <= page else [free.pop() for _ in range(self._pages_for(size))]
                token = next(tokens)
                objects[key] = _Object(size, pages, token)
                out[i] = WriteHandle(key, size, token)
            self._stats.allocated_objects += len(new)
            return out

    def write(self, handle: WriteHandle, offset: int, src: torch.Tensor) -> None:
        self._need_data()
        with self._lock:
            obj = self._pending_object(handle)
        data = self._bytes(src)
        for pool_off, src_off, n in self._runs(obj, offset, data.numel()):
            self._flat[pool_off : pool_off + n].copy_(data[src_off : src_off + n])
        with self._lock:
            self._stats.bytes_written += data.numel()

    def write_batch(self, handles: Sequence[WriteHandle], src: torch.Tensor) -> None:
        self._need_data()
        with self._lock:
            objs = [self._pending_object(h) for h in handles]
        rows = self._single_page_rows(objs)
        if rows is None:
            super().write_batch(handles, src)
            return
        data = src.reshape(len(handles), -1)
        if data.dtype != torch.uint8:
            data = data.contiguous().view(torch.uint8)
        if data.shape[1] != self.page_bytes:
            raise StoreError(f"write_batch rows of {data.shape[1]} bytes into {self.page_bytes}-byte objects")
        plan = device.plan_rows(range(len(objs)), rows)
        device.move_rows(device.as_words(data), self._words, plan)
        with self._lock:
            self._stats.bytes_written += data.numel()

    def commit(self, handles: Sequence[WriteHandle]) -> None:
        with self._lock:
            keys: list[str] = []
            try:
                for h in handles:
                    obj = self._pending_object(h)
                    obj.committed = True
                    self._evictable += len(obj.pages)
                    keys.append(h.key)
            finally:  # a bad handle raises after the ones before it committed
                self._stats.committed_objects += len(keys)
                self._policy.insert_many(keys)

    def abort(self, handles: Sequence[WriteHandle]) -> None:
        with self._lock:
            for h in handles:
                obj = self._objects.get(h.key)
                if obj is None or obj.token != h.token or obj.committed:
                    continue  # idempotent: already aborted, or not ours to drop
                del self._objects[h.key]
                self._free.extend(reversed(obj.pages))
                self._freed.append(h.key)
                self._stats.aborted_objects += 1

    def lookup_prefix(self, keys: Sequence[str]) -> int:
        with self._lock:
            objects = self._objects
            n = self._stats.count_prefix(
                keys, lambda k: (o := objects.get(k)) is not None and o.committed
            )
            if n < len(keys):
                self._policy.miss(keys[n])  # the prefix stops here (ARC: a ghost hit?)
            return n

    def pin(self, keys: Sequence[str], *, touch: bool = True) -> Pin | None:
        """Hold committed ``keys`` (all or none). ``touch=False`` for a pin the store's
        owner takes for itself (a write-behind spill reading the pages, a guard while
        it allocates): not a use, so the eviction policy must not see a hit (ARC would
        move every such key to T2 and lose its scan resistance)."""
        keys = list(dict.fromkeys(keys))  # a key pinned twice in one call counts once
        with self._lock:
            objs = [self._objects.get(k) for k in keys]
            if any(o is None or not o.committed for o in objs):
                return None
            for obj in objs:
                assert obj is not None
                if obj.pins == 0:
                    self._evictable -= len(obj.pages)
                obj.pins += 1
            if touch:
                self._policy.touch_many(keys)  # a pin is a hit that will be read
            token = next(self._tokens)
            self._pins[token] = frozenset(keys)
            return Pin(keys=tuple(keys), token=token)

    def _pinned_object(self, pin: Pin, key: str) -> _Object:
        keys = self._pins.get(pin.token)
        if keys is None or key not in keys:
            raise StoreError(f"read of {key!r} without an active pin")
        return self._objects[key]

    def read(self, pin: Pin, key: str, offset: int, dst: torch.Tensor) -> None:
        self._need_data()
        with self._lock:
            obj = self._pinned_object(pin, key)
        out = self._bytes(dst)
        for pool_off, dst_off, n in self._runs(obj, offset, out.numel()):
            out[dst_off : dst_off + n].copy_(self._flat[pool_off : pool_off + n])
        with self._lock:
            self._stats.reads += 1
            self._stats.bytes_read += out.numel()

    def read_batch(self, pin: Pin, keys: Sequence[str], dst: torch.Tensor) -> None:
        self._need_data()
        with self._lock:
            objs = [self._pinned_object(pin, k) for k in keys]
        rows = self._single_page_rows(objs)
        if rows is None:
            super().read_batch(pin, keys, dst)
            return
        out = dst.reshape(len(keys), -1)
        if out.dtype != torch.uint8:
            out = out.view(torch.uint8)
        if out.shape[1] != self.page_bytes or not out.is_contiguous():
            raise StoreError("read_batch needs contiguous rows of one page each")
        plan = device.plan_rows(rows, range(len(objs)))
        device.move_rows(self._words, device.as_words(out), plan)
        with self._lock:
            self._stats.reads += len(keys)
            self._stats.bytes_read += out.numel()

    def read_rows(self, pin: Pin, keys: Sequence[str], dst: torch.Tensor,
                  rows: Sequence[int]) -> None:
        self._need_data()
        with self._lock:
            pages = self._single_page_rows([self._pinned_object(pin, k) for k in keys])
        if pages is None or len(rows) != len(pages):
            super().read_rows(pin, keys, dst, rows)
            return
        if not device.copy_host_rows(self._pool, pages, dst, rows):
            words = self._row_words(dst)
            if words is None:
                super().read_rows(pin, keys, dst, rows)
                return
            device.move_rows(self._words, words, device.plan_rows(pages, rows))
        with self._lock:
            self._stats.reads += len(keys)
            self._stats.bytes_read += len(keys) * self.page_bytes

    def write_rows(self, handles: Sequence[WriteHandle], src: torch.Tensor,
                   rows: Sequence[int]) -> None:
        self._need_data()
        with self._lock:
            pages = self._single_page_rows([self._pending_object(h) for h in handles])
        if pages is None or len(rows) != len(pages):
            super().write_rows(handles, src, rows)
            return
        if not device.copy_host_rows(src, rows, self._pool, pages):
            words = self._row_words(src)
            if words is None:
                super().write_rows(handles, src, rows)
                return
            device.move_rows(words, self._words, device.plan_rows(rows, pages))
        with self._lock:
            self._stats.bytes_written += len(handles) * self.page_bytes

    def pinned_rows(self, pin: Pin, keys: Sequence[str]) -> tuple[torch.Tensor, list[int]] | None:
        if not self._with_data:
            return None
        with self._lock:
            pages = self._single_page_rows([self._pinned_object(pin, k) for k in keys])
            if pages is not None:
                self._stats.reads += len(keys)
                self._stats.bytes_read += len(keys) * self.page_bytes
        return None if pages is None else (self._pool, pages)

    def pending_rows(self, handles: Sequence[WriteHandle]) -> tuple[torch.Tensor, list[int]] | None:
        if not self._with_data:
            return None
        with self._lock:
            pages = self._single_page_rows([self._pending_object(h) for h in handles])
            if pages is not None:
                self._stats.bytes_written += len(handles) * self.page_bytes
        return None if pages is None else (self._pool, pages)

    def _row_words(self, t: torch.Tensor) -> torch.Tensor | None:
        """``t`` as page-sized word rows, or None (other row size, not contiguous, device)."""
        if not device.is_host(t) or t.dim() < 1 or t.shape[0] == 0 or not t.is_contiguous():
            return None
        if t[0].numel() * t.element_size() != self.page_bytes:
            return None
        words = device.as_words(t.view(t.shape[0], -1))
        return words if words.dtype == self._words.dtype else None

    def unpin(self, pin: Pin) -> None:
        with self._lock:
            keys = self._pins.pop(pin.token, None)
            if keys is None:
                return
            for key in keys:
                obj = self._objects.get(key)
                if obj is not None and obj.pins > 0:
                    obj.pins -= 1
                    if obj.pins == 0:
                        self._evictable += len(obj.pages)

    def stats(self) -> StoreStats:
        with self._lock:
            s = dataclasses.replace(self._stats)
            s.free_pages = len(self._free)
            s.pending_objects = sum(1 for o in self._objects.values() if not o.committed)
            s.stored_objects = len(self._policy)
            s.pinned_objects = sum(1 for o in self._objects.values() if o.pins)
            return s

    def has(self, key: str) -> bool:
        """Whether ``key`` is allocated (pending or committed); no counters touched."""
        with self._lock:
            return key in self._objects

    def is_committed(self, key: str) -> bool:
        with self._lock:
            obj = self._objects.get(key)
            return obj is not None and obj.committed

    def discard(self, keys: Sequence[str]) -> int:
        """Drop committed, unpinned objects now (request-private data that no one can
        hit again); returns how many were dropped."""
        n = 0
        with self._lock:
            for key in keys:
                obj = self._objects.get(key)
                if obj is None or not obj.committed or obj.pins:
                    continue
                del self._objects[key]
                self._policy.remove(key)  # no one can hit it again: no history either
                self._free.extend(reversed(obj.pages))
                self._evictable -= len(obj.pages)
                self._freed.append(key)
                n += 1
        return n

    def clear(self) -> int:
        """Forget every committed object, pinned or not, and every pin (a pin taken
        before is inert afterwards: its ``unpin`` is a no-op); returns how many objects
        were dropped. Pending objects stay: their writers own the pages until they
        ``commit`` or ``abort`` (an owner that wants them gone aborts them first).
        Why a pinned object may go: the caller (the connector's reset) knows that a
        copy still reading its pages runs before any later write can land there."""
        with self._lock:
            dropped = [key for key, obj in self._objects.items() if obj.committed]
            for key in dropped:
                obj = self._objects.pop(key)
                self._free.extend(reversed(obj.pages))
                self._freed.append(key)
            self._policy.clear()
            self._pins.clear()
            self._evictable = 0
            return len(dropped)

    def take_freed(self) -> list[str]:
        """Keys whose pages were freed (evicted, aborted, discarded) since the last call."""
        with self._lock:
            freed, self._freed = self._freed, []
            return freed

    def evictable_pages(self) -> int:
        """Pages that eviction could free now (exposed for invariant checks)."""
        with self._lock:
            return self._evictable
