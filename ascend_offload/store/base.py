"""The host KV store contract every backend implements.

Life of an object (invariant I3):

    allocate(keys, sizes) -> pending handles      (atomic: all or none)
    write(handle, offset, src)                    (any number of segments)
    commit(handles) | abort(handles)              (only committed is visible)
    lookup_prefix(keys) -> n                      (longest committed prefix)
    pin(keys) -> Pin | None                       (pinned = never evicted)
    read(pin, key, dst) ...                       (only while pinned)
    unpin(pin)

Why this shape: a writer that dies half way leaves only pending objects that
nobody can read; a reader holds a pin for exactly as long as it copies, so
eviction can never pull bytes from under a load; counters are exact so tests
and metrics can assert on them.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from ascend_offload.errors import AscendOffloadError


class StoreError(AscendOffloadError, RuntimeError):
    """A store operation was used against its contract (e.g. reading unpinned data)."""


@dataclasses.dataclass
class StoreStats:
    """Exact counters, monotonically increasing except the gauges at the end."""

    lookups: int = 0
    hit_objects: int = 0
    miss_objects: int = 0
    allocated_objects: int = 0
    committed_objects: int = 0
    aborted_objects: int = 0
    skipped_stores: int = 0  # allocations refused because the store was full
    duplicate_stores: int = 0  # allocations skipped because the key already exists
    evicted_objects: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    reads: int = 0
    # gauges
    pinned_objects: int = 0
    pending_objects: int = 0
    stored_objects: int = 0
    free_pages: int = 0
    total_pages: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def count_prefix(self, keys: Sequence[str], present: Callable[[str], bool]) -> int:
        """Length of the leading run of ``keys`` that are ``present``; records the lookup."""
        n = 0
        for key in keys:
            if not present(key):
                break
            n += 1
        self.lookups += 1
        self.hit_objects += n
        self.miss_objects += len(keys) - n
        return n


class WriteHandle(NamedTuple):
    """A pending object: writable, not readable, not evictable.

    A named tuple, not a dataclass: one is made per stored block, and construction
    cost showed up in ``bench store`` for small objects."""

    key: str
    size: int
    token: int  # identifies this allocation (a re-allocation of the key gets another)


@dataclasses.dataclass(frozen=True)
class Pin:
    """A set of committed objects that stay resident until ``unpin``."""

    keys: tuple[str, ...]
    token: int


class KVStore(abc.ABC):
    """Backend-neutral contract (local page pool, Mooncake Store, Memcache)."""

    @abc.abstractmethod
    def allocate(self, keys: Sequence[str], sizes: Sequence[int]) -> list[WriteHandle | None] | None:
        """Reserve pending objects. Keys already present (pending or committed)
        get ``None`` in their position and are not written again. Returns
        ``None`` when the new objects do not all fit (nothing is reserved)."""

    @abc.abstractmethod
    def write(self, handle: WriteHandle, offset: int, src: torch.Tensor) -> None:
        """Copy ``src`` (any dtype, contiguous) into the object at byte ``offset``."""

    @abc.abstractmethod
    def commit(self, handles: Sequence[WriteHandle]) -> None:
        """Make objects readable. Committing an aborted or unknown handle raises."""

    @abc.abstractmethod
    def abort(self, handles: Sequence[WriteHandle]) -> None:
        """Drop pending objects and free their space (idempotent)."""

    @abc.abstractmethod
    def lookup_prefix(self, keys: Sequence[str]) -> int:
        """Number of leading keys that are committed (no side effects but counters)."""

    @abc.abstractmethod
    def pin(self, keys: Sequence[str]) -> Pin | None:
        """Pin all ``keys`` (all committed) or none; ``None`` if any is missing."""

    @abc.abstractmethod
    def read(self, pin: Pin, key: str, offset: int, dst: torch.Tensor) -> None:
        """Copy ``dst.nbytes`` bytes of pinned ``key`` starting at ``offset`` into ``dst``."""

    @abc.abstractmethod
    def unpin(self, pin: Pin) -> None:
        """Release a pin (idempotent)."""

    def write_batch(self, handles: Sequence[WriteHandle], src: torch.Tensor) -> None:
        """Write ``src[i]`` (one row per handle, ``src.shape[0] == len(handles)``) as
        the whole content of ``handles[i]``. Backends override this with one copy."""
        rows = src.reshape(len(handles), -1)
        for h, row in zip(handles, rows, strict=True):
            self.write(h, 0, row)

    def read_batch(self, pin: Pin, keys: Sequence[str], dst: torch.Tensor) -> None:
        """Fill ``dst[i]`` with the whole content of pinned ``keys[i]``."""
        rows = dst.reshape(len(keys), -1)
        for key, row in zip(keys, rows, strict=True):
            self.read(pin, key, 0, row)

    def read_rows(self, pin: Pin, keys: Sequence[str], dst: torch.Tensor,
                  rows: Sequence[int]) -> None:
        """Fill row ``rows[i]`` of the 2-D host tensor ``dst`` with the whole content of
        pinned ``keys[i]`` (a KV layer's scattered blocks). Backends override this with
        one scatter: per-object Python held the GIL for ~25 us a block, which the model
        thread then waited for."""
        for key, r in zip(keys, rows, strict=True):
            self.read(pin, key, 0, dst[r])

    def write_rows(self, handles: Sequence[WriteHandle], src: torch.Tensor,
                   rows: Sequence[int]) -> None:
        """Write row ``rows[i]`` of the 2-D host tensor ``src`` as the whole content of
        ``handles[i]`` (see :meth:`read_rows`)."""
        for h, r in zip(handles, rows, strict=True):
            self.write(h, 0, src[r])

    #: True when :meth:`pinned_rows` / :meth:`pending_rows` answer for this backend's
    #: objects (then a native copy queue can move them).
    row_addressable: bool = False

    def pinned_rows(self, pin: Pin, keys: Sequence[str]) -> tuple[torch.Tensor, list[int]] | None:
        """``(plane, rows)``: pinned ``keys[i]`` is the whole row ``rows[i]`` of the 2-D
        host tensor ``plane``, or None when the backend cannot say (other layouts, remote
        bytes). Why: an ordered native copy queue then moves the bytes with no Python on
        its thread (transfer/copy_queue.py). The caller copies while the pin is held and
        counts as having read the objects."""
        return None

    def pending_rows(self, handles: Sequence[WriteHandle]) -> tuple[torch.Tensor, list[int]] | None:
        """``(plane, rows)`` whose rows take the whole content of pending ``handles[i]``
        (see :meth:`pinned_rows`); the caller writes them before ``commit``."""
        return None

    @abc.abstractmethod
    def stats(self) -> StoreStats:
        """A snapshot of the counters."""

    def contains(self, key: str) -> bool:
        return self.lookup_prefix([key]) == 1

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release backend resources."""
