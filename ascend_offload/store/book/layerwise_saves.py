"""Layerwise mode: which blocks a step saves, where they go, and when they are committed.

Every layer of a block is one object on each worker rank, written by the rank's
layerwise pipeline during the forward; the scheduler only places block keys on
pages and counts the ranks' reports per key. Why these rules:

* a key already being saved this step or stored earlier is not written twice;
  the request reads the stored copy back instead, so it is pinned for it;
* a block is committed only when every rank reported it (each holds its own
  shard); one failed rank aborts it, since a partial object would be served to all;
* blocks stay pinned for the requests that read them back in later steps until
  those requests end (with shared layer buffers a request reloads its own KV);
* a partial block's key is private to its request (``partial_prefix``): nobody
  can hit it again, so it is discarded once its request ended and it is not
  being written.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Mapping

from ascend_offload.store.base import Pin, WriteHandle
from ascend_offload.store.book.request_book import RequestBook, RequestEntry
from ascend_offload.store.local import LocalStore
from ascend_offload.store.shared.remote_fetch import RemoteFetches


@dataclasses.dataclass
class LayerwiseEntry(RequestEntry):
    hit_keys: tuple[str, ...] = ()  # leading blocks the pipeline loads from the store
    pins: list[Pin] = dataclasses.field(default_factory=list)  # held until the request ends
    private_keys: list[str] = dataclasses.field(default_factory=list)  # its partial blocks


@dataclasses.dataclass
class _Saving:
    handle: WriteHandle
    readers: list[str]  # requests that save (and later read back) this block
    done: int = 0  # ranks that reported it written
    failed: int = 0  # ranks that reported it failed
    held: int = 0  # ranks whose publish of its page may still read it
    stale: bool = False  # settled by a reset while held: aborted once released


class LayerwiseSaves(RequestBook[LayerwiseEntry]):
    """Lookups, per-step save placement, and per-rank completion of block saves."""

    def __init__(
        self, index: LocalStore, *, block_size: int, page_bytes: int, world_size: int,
        min_load_blocks: int, partial_prefix: str, remote: RemoteFetches | None = None,
    ) -> None:
        super().__init__(index, LayerwiseEntry, block_size=block_size, page_bytes=page_bytes,
                         world_size=world_size, min_load_blocks=min_load_blocks, remote=remote)
        self.partial_prefix = partial_prefix
        self._saving: dict[str, _Saving] = {}
        self._held: dict[str, _Saving] = {}  # every rank reported; settled once released

    @property
    def saving(self) -> frozenset[str]:
        """Keys placed for saving whose ranks have not all reported."""
        return frozenset(self._saving)

    def accept_load(self, req_id: str, num_tokens: int) -> bool:
        """vLLM takes ``num_tokens`` from the store: the pipeline loads the offered blocks
        layer by layer, so their pin is held until the request ends."""
        taken = self._take_offer(req_id, num_tokens)
        if taken is None:
            return False
        e, pin, _, _ = taken
        e.hit_keys = pin.keys
        e.pins.append(pin)
        return True

    def hit_keys(self, req_id: str) -> tuple[str, ...]:
        """Keys of the request's leading blocks found in the store (its accepted offer)."""
        return self.entry(req_id).hit_keys

    def place(self, req_id: str, keys: Iterable[str]) -> list[str]:
        """The request saves ``keys`` this step: returns those newly placed on a page
        (the ones the ranks write). Others are written by another request this step,
        stored already (pinned for this request to read back), or skipped because
        the store is full (a later step needing one reports a load error)."""
        e = self.entry(req_id)
        placed: list[str] = []
        for key in keys:
            if key.startswith(self.partial_prefix):
                e.private_keys.append(key)
            saving = self._saving.get(key)
            if saving is not None:  # another request stores the same block this step
                saving.readers.append(req_id)
                self._count(e, "duplicate_blocks", 1)
                continue
            if self.index.is_committed(key):  # stored earlier: read it back, pinned
                pin = self.index.pin([key])
                if pin is not None:
                    e.pins.append(pin)
                self._count(e, "duplicate_blocks", 1)
                continue
            handles = self.index.allocate([key], [self.page_bytes])
            if not handles or handles[0] is None:
                self._count(e, "skipped_blocks", 1)
                continue
            self._saving[key] = _Saving(handles[0], [req_id])
            placed.append(key)
            self._count(e, "saved_blocks", 1)
        return placed

    def pages(self, keys: Iterable[str]) -> dict[str, int]:
        """Page of every key that has one; a key without (the store was full) makes the
        worker report a load error for its block."""
        pages: dict[str, int] = {}
        for key in keys:
            if key not in pages and self.index.has(key):
                pages[key] = self.index.pages(key)[0]
        return pages

    def take_freed(self) -> list[str]:
        """Keys whose pages were freed since the last step (workers forget them)."""
        return self.index.take_freed()

    def report(self, done: Mapping[str, int], failed: Mapping[str, int]) -> None:
        """Ranks' completions (block key -> number of ranks); keys not being saved
        (already settled) are ignored."""
        for key, n in done.items():
            if key in self._saving:
                self._saving[key].done += n
        for key, n in failed.items():
            if key in self._saving:
                self._saving[key].failed += n
        for key in dict.fromkeys(itertools.chain(done, failed)):
            if key in self._saving:
                self._settle(key)

    def _settle(self, key: str) -> None:
        s = self._saving[key]
        if s.done + s.failed < self.world_size:
            return
        del self._saving[key]
        if s.held:  # a publish may still read its page: settled when released
            self._held[key] = s
            return
        self._settle_saved(key, s)

    def hold(self, counts: Mapping[str, int]) -> None:
        for key, n in counts.items():
            s = self._saving.get(key) or self._held.get(key)
            if s is not None:
                s.held += n

    def release(self, counts: Mapping[str, int]) -> None:
        for key, n in counts.items():
            s = self._saving.get(key) or self._held.get(key)
            if s is None:
                continue
            s.held = max(0, s.held - n)
            if not s.held and self._held.pop(key, None) is not None:
                self._settle_saved(key, s)

    def _settle_saved(self, key: str, s: _Saving) -> None:
        if s.stale:
            self.index.abort([s.handle])
            return
        if s.failed:
            self.totals["save_failed_jobs"] += 1
            self.index.abort([s.handle])
            return
        self.index.commit([s.handle])
        alive = [self._entries[r] for r in s.readers if r in self._entries]
        for e in alive:  # they read it back in later steps: keep it resident
            pin = self.index.pin([key])
            if pin is not None:
                e.pins.append(pin)
        if not alive and key.startswith(self.partial_prefix):
            self.index.discard([key])

    def _finished(self, e: LayerwiseEntry) -> None:
        for pin in e.pins:
            self.index.unpin(pin)
        e.pins.clear()
        # its partial-block objects can never be hit again: free them now
        self.index.discard([k for k in e.private_keys if k not in self._saving])

    def _settle_for_reset(self) -> None:
        """Settle every placed save before the index forgets its objects: pending
        objects are aborted (their pages are reused only by a later step's copies,
        which every rank runs after this step's), read-back pins and hit keys are
        dropped (the clear makes the pins inert). Late reports of these keys arrive
        with the old epoch and are dropped by the connector."""
        for key, s in self._saving.items():
            if s.held:  # a late publish still reads its page: pending until released
                s.stale = True
                self._held[key] = s
            else:
                self.index.abort([s.handle])
        for s in self._held.values():
            s.stale = True  # pre-reset objects never commit
        self._saving.clear()
        for e in self._entries.values():
            e.pins.clear()
            e.hit_keys = ()
