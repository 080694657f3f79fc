"""The SSD tier's index, held by the scheduler: key -> slot, eviction order, capacity.

Why in the scheduler: one process decides which slot every rank writes a page to
and which slot a lookup reads from, single-threaded, so the ranks' files never
disagree about a key (each rank holds its own shard of a block at the *same* slot
number in its own file). Workers only write page -> slot and read slot -> page.

An entry is *writing* from the slot's allocation until every rank reported its
write, then *ready*: only ready entries are found by lookups and only ready,
unpinned entries are evicted (a pin holds a slot while ranks read it). Order is an
:class:`~ascend_offload.store.eviction.EvictionPolicy` over the ready keys.

Persistence (``ssd.persist``): :meth:`SsdIndex.snapshot` / :meth:`SsdIndex.restore`
and :func:`write_index_file` / :func:`read_index_file`. The file is written to a
temporary name, fsynced, then renamed over the old one (and the directory
fsynced): a crash at any point leaves either the old or the new index, both
usable. Entries are trusted only as far as the slot headers confirm them on read
(``store/ssd/format.py``): a slot rewritten after the index was saved is a miss.

Every method holds the index's lock: the scheduler thread changes the index while
the persister thread (``connectors/store/ssd.py``) takes snapshots of an idle engine's
last changes, which no scheduler step would otherwise write.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from ascend_offload.store.eviction import make_policy
from ascend_offload.store.private_files import PrivatePathError, open_private

log = logging.getLogger(__name__)

INDEX_FORMAT = 1

_F = TypeVar("_F", bound=Callable[..., Any])


def _locked(method: _F) -> _F:
    @functools.wraps(method)
    def run(self: SsdIndex, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return run  # type: ignore[return-value]


class _Entry:
    __slots__ = ("pins", "ready", "slot")

    def __init__(self, slot: int, ready: bool) -> None:
        self.slot = slot
        self.ready = ready
        self.pins = 0


class SsdIndex:
    """Slots of one SSD tier (the same slot numbers on every rank's file)."""

    def __init__(self, num_slots: int, eviction: str = "lru") -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.policy = make_policy(eviction, num_slots)
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # popped from the end: 0, 1, ...
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.RLock()
        #: bumped on every change that a persisted index would show
        self.generation = 0
        #: monotonic totals
        self.evicted = 0

    # ------------------------------------------------------------------ queries

    @_locked
    def __contains__(self, key: object) -> bool:
        return key in self._entries

    @_locked
    def __len__(self) -> int:
        return len(self._entries)

    @property
    def used_slots(self) -> int:
        with self._lock:
            return self.num_slots - len(self._free)

    @_locked
    def is_ready(self, key: str) -> bool:
        e = self._entries.get(key)
        return e is not None and e.ready

    @_locked
    def slot(self, key: str) -> int:
        return self._entries[key].slot

    @_locked
    def lookup_prefix(self, keys: Sequence[str]) -> int:
        """Leading ``keys`` that are ready on the tier."""
        n = 0
        for k in keys:
            e = self._entries.get(k)
            if e is None or not e.ready:
                break
            n += 1
        return n

    # ------------------------------------------------------------------ writes

    @_locked
    def allocate(self, keys: Sequence[str]) -> list[int | None]:
        """A slot for each key not on the tier yet (``None`` for a key already there or
        when no slot is free and none can be evicted). New entries are *writing*."""
        out: list[int | None] = []
        for k in keys:
            if k in self._entries or not (self._free or self._evict_one()):
                out.append(None)
                continue
            slot = self._free.pop()
            self._entries[k] = _Entry(slot, ready=False)
            out.append(slot)
        return out

    def _evict_one(self) -> bool:
        victim = next((k for k in self.policy.victims() if self._entries[k].pins == 0), None)
        if victim is None:
            return False
        self._remove(victim, evicted=True)  # after the walk: its order must not change under it
        self.evicted += 1
        return True

    @_locked
    def mark_ready(self, keys: Iterable[str]) -> None:
        """Every rank wrote these keys' slots: lookups find them now."""
        for k in keys:
            e = self._entries.get(k)
            if e is not None and not e.ready:
                e.ready = True
                self.policy.insert(k)
                self.generation += 1

    @_locked
    def drop(self, keys: Iterable[str]) -> int:
        """Forget entries (a failed write, a slot that failed verification); their slots
        are free again. Pinned entries stay until unpinned. Returns how many went."""
        n = 0
        for k in keys:
            e = self._entries.get(k)
            if e is not None and e.pins == 0:
                self._remove(k)
                n += 1
        return n

    def _remove(self, key: str, *, evicted: bool = False) -> None:
        e = self._entries.pop(key)
        if evicted:
            self.policy.evict(key)  # ARC keeps a ghost of it
        else:
            self.policy.remove(key)
        self._free.append(e.slot)
        if e.ready:
            self.generation += 1

    @_locked
    def clear(self) -> int:
        """Forget every ready entry, pinned or not (the store's reset); entries still
        being written keep their slots until their writes are reported (a write landing
        in a slot already handed to another key would otherwise go unnoticed by the
        index). Returns how many entries went."""
        gone = [k for k, e in self._entries.items() if e.ready]
        for k in gone:
            self._entries[k].pins = 0
            self._remove(k)
        self.policy.clear()
        self.generation += 1
        return len(gone)

    # ------------------------------------------------------------------ reads

    @_locked
    def pin(self, keys: Sequence[str]) -> list[int]:
        """Hold the slots of ready ``keys`` while ranks read them (never evicted
        meanwhile); a hit, so the policy sees it."""
        slots = []
        for k in keys:
            e = self._entries[k]
            if not e.ready:
                raise KeyError(f"ssd entry {k!r} is not ready")
            e.pins += 1
            self.policy.touch(k)
            slots.append(e.slot)
        return slots

    @_locked
    def unpin(self, keys: Iterable[str]) -> None:
        for k in keys:
            e = self._entries.get(k)
            if e is not None and e.pins > 0:
                e.pins -= 1

    # ------------------------------------------------------------------ persistence

    @_locked
    def snapshot(self, meta: dict[str, Any]) -> dict[str, Any]:
        """The ready entries in eviction order (first victim first), with ``meta`` (the
        geometry a reader must match)."""
        entries = [[k, self._entries[k].slot] for k in self.policy.victims()]
        return {"format": INDEX_FORMAT, **meta, "num_slots": self.num_slots, "entries": entries}

    @_locked
    def snapshot_if_changed(self, meta: dict[str, Any], since: int) -> tuple[int, dict[str, Any]] | None:
        """``(generation, snapshot)`` when the index changed after generation ``since``
        (one consistent view for a thread that did not make the changes); else None."""
        if self.generation == since:
            return None
        return self.generation, self.snapshot(meta)

    @_locked
    def restore(self, data: dict[str, Any], meta: dict[str, Any]) -> int:
        """Load the ready entries of a snapshot whose geometry equals ``meta`` and
        ``num_slots``; returns how many were kept (0 and nothing changed when the
        snapshot does not match or is malformed: it is untrusted input)."""
        if self._entries:
            raise RuntimeError("restore into a non-empty SSD index")
        if data.get("format") != INDEX_FORMAT or data.get("num_slots") != self.num_slots:
            return 0
        if any(data.get(k) != v for k, v in meta.items()):
            return 0
        entries = data.get("entries")
        if not isinstance(entries, list):
            return 0
        seen_slots: set[int] = set()
        parsed: list[tuple[str, int]] = []
        for item in entries:
            if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str)
                    or type(item[1]) is not int or not 0 <= item[1] < self.num_slots
                    or item[1] in seen_slots):
                return 0
            seen_slots.add(item[1])
            parsed.append((item[0], item[1]))
        if len({k for k, _ in parsed}) != len(parsed):
            return 0
        for key, slot in parsed:
            self._entries[key] = _Entry(slot, ready=True)
            self.policy.insert(key)
        self._free = [s for s in range(self.num_slots - 1, -1, -1) if s not in seen_slots]
        return len(parsed)


#: bytes a persisted index may take per slot (a key, its slot number, JSON punctuation);
#: a file larger than the tier's slots could need is not read (see :func:`max_index_bytes`)
INDEX_BYTES_PER_SLOT = 1024
_INDEX_HEAD_BYTES = 64 << 10  # format, geometry, weights identity


def max_index_bytes(num_slots: int) -> int:
    """The largest index file a tier of ``num_slots`` slots reads at start."""
    return _INDEX_HEAD_BYTES + num_slots * INDEX_BYTES_PER_SLOT


def write_index_file(path: Path, data: dict[str, Any]) -> None:
    """Atomically replace ``path`` with ``data`` (tmp file, fsync, rename, fsync dir). The
    temporary file is created 0600 and exclusively (a stale one of a crashed write is
    removed first; a link planted under its name makes the write fail, never followed)."""
    tmp = path.with_name(path.name + ".tmp")
    payload = json.dumps(data, separators=(",", ":")).encode()
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # unlink removes a link itself, never its target
    try:
        fd = open_private(tmp, os.O_WRONLY, "local.ssd.path", exclusive=True)
    except PrivatePathError as exc:
        raise OSError(str(exc)) from None
    try:
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)  # rename replaces a link at ``path`` itself, never its target
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def read_index_file(path: Path, max_bytes: int | None = None) -> dict[str, Any] | None:
    """The index saved at ``path``; None when absent, or (logged once, here) unreadable,
    a link, larger than ``max_bytes``, not JSON (nested past the parser's recursion limit
    included) or not an object: a bad index means "start empty", never a failed start."""
    try:
        fd = open_private(path, os.O_RDONLY, "local.ssd.path")
    except PrivatePathError as exc:
        if not path.exists() and not path.is_symlink():
            return None
        log.warning("SSD tier: cannot read index %s (%s); starting empty", path, exc)
        return None
    try:
        size = os.fstat(fd).st_size
        if max_bytes is not None and size > max_bytes:
            log.warning("SSD tier: index %s has %d bytes, more than the %d this tier's slots could "
                        "need; not read, starting empty", path, size, max_bytes)
            return None
        with os.fdopen(os.dup(fd), "rb") as fh:
            raw = fh.read(size + 1)
    except OSError as exc:
        log.warning("SSD tier: cannot read index %s (%s); starting empty", path, exc)
        return None
    finally:
        os.close(fd)
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        log.warning("SSD tier: index %s is not valid JSON (%s); starting empty", path, why)
        return None
    if not isinstance(data, dict):
        log.warning("SSD tier: index %s is not an object; starting empty", path)
        return None
    return data


def remove_index_file(path: Path) -> None:
    """Forget a persisted index (a tier started without ``persist``)."""
    for p in (path, path.with_name(path.name + ".tmp")):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
