"""What the shared-store backends (bench/stores/mooncake.py, bench/stores/memcache.py) have in
common: every byte crosses a registered *staging* pool of host pages.

* **Pending objects never leave this process.** ``allocate`` reserves staging pages
  (``w|<key>``), ``write*`` fill them, the backend's ``commit`` is one batched put
  that frees them.
* **A pin holds a local copy.** The backend's ``pin`` fetches objects into staging
  pages (``r<token>|<key>``) and hands them to :meth:`StagedStore._hold`; reads come
  from those pages until ``unpin``, so eviction by the service can never pull bytes
  from under a read.
* **Pages a transfer may still touch are quarantined**, never reused
  (:meth:`StagedStore._release`).

The subclass owns the client, the service's health and every call to it.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from collections.abc import Sequence

import torch

from ascend_offload.store.base import KVStore, Pin, StoreError, StoreStats, WriteHandle
from ascend_offload.store.local import LocalStore

log = logging.getLogger(__name__)

W = "w|"  # staging name of a pending object; pins use "r<token>|"


@dataclasses.dataclass
class PinRecord:
    staging_pin: Pin
    # key -> (staging key, object size)
    objects: dict[str, tuple[str, int]]
    whole_pages: bool  # every object is exactly one staging page (fast row paths)


class StagedStore(KVStore):
    """Staging pool, pending writes, pins and reads of a shared-store backend (module doc)."""

    row_addressable = True

    def _init_staging(self, staging_bytes: int, page_bytes: int) -> None:
        """Create the staging pool (before the subclass registers ``_base``/``_plane``)."""
        self.page_bytes = page_bytes
        self._staging = LocalStore(staging_bytes, page_bytes)
        plane = self._staging.pending_rows([])  # public accessor of the pool plane
        assert plane is not None
        self._plane = plane[0]
        self._base = self._plane.data_ptr()
        self._lock = threading.Lock()
        self._stage_lock = threading.Lock()
        self._pending: dict[str, int] = {}  # key -> token of its live allocation
        self._pins: dict[int, PinRecord] = {}
        self._tokens = itertools.count(1)
        self._stats = StoreStats(total_pages=self._staging.num_pages)
        self.quarantined_pages = 0  # staging pages a failed transfer may still write
        self._closed = False

    # ------------------------------------------------------------------ staging

    def _page_spans(self, pages: list[int], size: int) -> tuple[list[int], list[int]]:
        """(addresses, lengths) of an object's pages, the last one partial."""
        ptrs, lens, left = [], [], size
        for p in pages:
            n = min(self.page_bytes, left)
            ptrs.append(self._base + p * self.page_bytes)
            lens.append(n)
            left -= n
        return ptrs, lens

    def _stage_alloc(self, keys: list[str], sizes: list[int]) -> list[WriteHandle | None] | None:
        """Staging allocation. Serialized with a pin's commit-then-pin, the one moment a
        staged object is committed but not yet pinned (the pool evicts such objects)."""
        with self._stage_lock:
            return self._staging.allocate(keys, sizes)

    def _unstage(self, handles: Sequence[WriteHandle]) -> None:
        """Free staging objects. The pool also lists every freed key for its index users
        (``take_freed``); nobody reads that list here, so it is drained at once."""
        self._staging.abort(handles)
        self._staging.take_freed()

    def _staged(self, handles: Sequence[WriteHandle]) -> list[WriteHandle]:
        """The staging handles of pending ``handles`` (one lock for the batch: per-object
        Python is what small objects pay for)."""
        with self._lock:
            pending = self._pending
            for h in handles:
                if pending.get(h.key) != h.token:
                    raise StoreError(f"write handle for {h.key!r} is not a pending allocation")
        return [WriteHandle(W + h.key, h.size, h.token) for h in handles]

    def _release(self, handles: Sequence[WriteHandle], unsafe: Sequence[WriteHandle], why: str) -> None:
        """Free staging objects except ``unsafe`` ones (quarantined, logged with ``why``:
        a transfer may still touch them)."""
        keep = {h.key for h in unsafe}
        if keep:
            with self._lock:
                self.quarantined_pages += sum(len(self._staging.pages(k)) for k in keep)
            log.warning("%s; %d staging objects quarantined", why, len(keep))
        self._unstage([h for h in handles if h.key not in keep])

    # ------------------------------------------------------------------ writes

    @staticmethod
    def _checked(keys: Sequence[str], sizes: Sequence[int]) -> list[str]:
        """``allocate``'s argument checks; the unique keys."""
        if len(keys) != len(sizes):
            raise StoreError(f"allocate: {len(keys)} keys but {len(sizes)} sizes")
        for key, size in zip(keys, sizes, strict=True):
            if size <= 0:
                raise StoreError(f"allocate: size of {key!r} must be > 0, got {size}")
        return list(dict.fromkeys(keys))

    def _skipped(self, n: int) -> None:
        with self._lock:
            self._stats.skipped_stores += n

    def _allocate_absent(self, keys: Sequence[str], sizes: Sequence[int],
                         present: set[str]) -> list[WriteHandle | None] | None:
        """Pending staging objects for the keys the service does not hold (``present``)."""
        new: list[tuple[int, str, int]] = []
        seen: set[str] = set()
        for i, key in enumerate(keys):
            if key in present or key in seen:
                continue
            seen.add(key)
            new.append((i, key, sizes[i]))
        got = self._stage_alloc([W + k for _, k, _ in new], [s for _, _, s in new])
        if got is None:
            self._skipped(len(new))
            return None
        out: list[WriteHandle | None] = [None] * len(keys)
        with self._lock:
            for (i, key, size), h in zip(new, got, strict=True):
                if h is None:  # pending here already
                    continue
                self._pending[key] = h.token
                out[i] = WriteHandle(key, size, h.token)
            made = sum(1 for h in out if h is not None)
            self._stats.allocated_objects += made
            self._stats.duplicate_stores += len(keys) - made
        return out

    def write(self, handle: WriteHandle, offset: int, src: torch.Tensor) -> None:
        self._staging.write(self._staged([handle])[0], offset, src)

    def write_batch(self, handles: Sequence[WriteHandle], src: torch.Tensor) -> None:
        self._staging.write_batch(self._staged(handles), src)

    def write_rows(self, handles: Sequence[WriteHandle], src: torch.Tensor,
                   rows: Sequence[int]) -> None:
        self._staging.write_rows(self._staged(handles), src, rows)

    def pending_rows(self, handles: Sequence[WriteHandle]) -> tuple[torch.Tensor, list[int]] | None:
        return self._staging.pending_rows(self._staged(handles))

    def _unpend(self, handles: Sequence[WriteHandle]) -> None:
        with self._lock:
            for h in handles:
                self._pending.pop(h.key, None)

    def _count_puts(self, handles: Sequence[WriteHandle], codes: Sequence[int], duplicate: int) -> None:
        """Commit counters from a put's per-object codes (``duplicate``: another client
        put the object first)."""
        with self._lock:
            st = self._stats
            for h, code in zip(handles, codes, strict=True):
                if code == 0:
                    st.committed_objects += 1
                    st.bytes_written += h.size
                elif code == duplicate:
                    st.duplicate_stores += 1
                else:
                    st.skipped_stores += 1

    def abort(self, handles: Sequence[WriteHandle]) -> None:
        mine: list[WriteHandle] = []
        with self._lock:
            for h in handles:
                if self._pending.get(h.key) == h.token:
                    del self._pending[h.key]
                    mine.append(WriteHandle(W + h.key, h.size, h.token))
            self._stats.aborted_objects += len(mine)
        self._unstage(mine)

    # ------------------------------------------------------------------ reads

    def _hold(self, token: int, keys: list[str], skeys: list[str], handles: list[WriteHandle],
              sizes: list[int]) -> Pin:
        """Turn fetched staging objects into the pin ``token`` of ``keys``."""
        with self._stage_lock:  # no allocation may evict them between commit and pin
            self._staging.commit(handles)
            staging_pin = self._staging.pin(skeys)
        assert staging_pin is not None  # committed and ours alone
        objects = {k: (s, n) for k, s, n in zip(keys, skeys, sizes, strict=True)}
        whole = all(n == self.page_bytes for n in sizes)
        with self._lock:
            self._pins[token] = PinRecord(staging_pin, objects, whole)
            self._stats.reads += len(keys)
            self._stats.bytes_read += sum(sizes)
        return Pin(keys=tuple(keys), token=token)

    def _record(self, pin: Pin) -> PinRecord:
        with self._lock:
            rec = self._pins.get(pin.token)
        if rec is None:
            raise StoreError(f"read without an active pin (token {pin.token})")
        return rec

    def _object(self, rec: PinRecord, key: str) -> tuple[str, int]:
        got = rec.objects.get(key)
        if got is None:
            raise StoreError(f"read of {key!r} without an active pin")
        return got

    def read(self, pin: Pin, key: str, offset: int, dst: torch.Tensor) -> None:
        rec = self._record(pin)
        skey, size = self._object(rec, key)
        nbytes = dst.numel() * dst.element_size()
        if offset < 0 or offset + nbytes > size:
            raise StoreError(f"byte range [{offset}, {offset + nbytes}) outside object of {size} bytes")
        self._staging.read(rec.staging_pin, skey, offset, dst)

    def read_batch(self, pin: Pin, keys: Sequence[str], dst: torch.Tensor) -> None:
        rec = self._record(pin)
        skeys = [self._object(rec, k)[0] for k in keys]
        if rec.whole_pages:
            self._staging.read_batch(rec.staging_pin, skeys, dst)
        else:
            super().read_batch(pin, keys, dst)

    def read_rows(self, pin: Pin, keys: Sequence[str], dst: torch.Tensor,
                  rows: Sequence[int]) -> None:
        rec = self._record(pin)
        skeys = [self._object(rec, k)[0] for k in keys]
        if rec.whole_pages:
            self._staging.read_rows(rec.staging_pin, skeys, dst, rows)
        else:
            super().read_rows(pin, keys, dst, rows)

    def pinned_rows(self, pin: Pin, keys: Sequence[str]) -> tuple[torch.Tensor, list[int]] | None:
        rec = self._record(pin)
        skeys = [self._object(rec, k)[0] for k in keys]
        return self._staging.pinned_rows(rec.staging_pin, skeys) if rec.whole_pages else None

    def unpin(self, pin: Pin) -> None:
        with self._lock:
            rec = self._pins.pop(pin.token, None)
        if rec is None:
            return
        self._staging.unpin(rec.staging_pin)
        self._staging.discard([s for s, _ in rec.objects.values()])
        self._staging.take_freed()

    # ------------------------------------------------------------------ misc

    def stats(self) -> StoreStats:
        """Counters of this client. ``stored_objects`` stays 0: the service holds the
        index of the whole store; pages are those of the staging pool."""
        staging = self._staging.stats()
        with self._lock:
            s = dataclasses.replace(self._stats)
            s.pending_objects = len(self._pending)
            s.pinned_objects = sum(len(r.objects) for r in self._pins.values())
            s.free_pages = staging.free_pages
            s.total_pages = staging.total_pages
            return s
