"""Scheduler-side store bookkeeping of requests, common to both connector modes.

Why a vLLM-free module: the rules that keep the store index consistent are
decided here, single-threaded, in vLLM's scheduler process:

* a lookup pins exactly the prefix it offers, so eviction cannot take it before
  the load ran;
* the pin is released whenever the offer is not taken as offered (asked again,
  nothing allocated, a different token count);
* a finished request leaves nothing pinned.

Keeping vLLM's request and scheduler types out lets unit tests drive these rules
with plain keys and block ids. The connector translates vLLM's calls into them;
the mode-specific parts (copy jobs, layerwise saves) extend :class:`RequestBook`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from ascend_offload.store.base import Pin
from ascend_offload.store.local import LocalStore
from ascend_offload.store.shared.remote_fetch import RemoteFetches

log = logging.getLogger(__name__)

#: Per-request block counters, reported when a request finishes and summed in
#: :attr:`RequestBook.totals` for the connector's metrics.
COUNT_NAMES = ("loaded_blocks", "saved_blocks", "skipped_blocks", "duplicate_blocks", "remote_blocks")


@dataclasses.dataclass
class RequestEntry:
    """One request's load offer and block counters."""

    load_pin: Pin | None = None
    load_range: tuple[int, int] = (0, 0)  # [first, last) block indices offered for loading
    loaded_blocks: int = 0
    saved_blocks: int = 0
    skipped_blocks: int = 0  # not saved: the store was full
    duplicate_blocks: int = 0  # not saved: the store had (or was writing) them already
    remote_blocks: int = 0  # of loaded_blocks: fetched from the shared tier for this request

    def counts(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in COUNT_NAMES}


E = TypeVar("E", bound=RequestEntry)


class RequestBook(Generic[E]):
    """Requests' store lookups and pins over the scheduler's store index.

    ``block_size`` converts between vLLM's token counts and store blocks;
    ``world_size`` is the number of worker ranks whose reports complete a copy;
    ``remote`` (shared-tier backends): blocks the index lacks are fetched from there
    first (``store/shared/remote_fetch.py``).
    """

    def __init__(
        self,
        index: LocalStore,
        entry_type: type[E],
        *,
        block_size: int,
        page_bytes: int,
        world_size: int,
        min_load_blocks: int,
        remote: RemoteFetches | None = None,
    ) -> None:
        if block_size < 1 or world_size < 1:
            raise ValueError(f"block_size={block_size}, world_size={world_size}: both must be >= 1")
        self.index = index
        self.block_size = block_size
        self.page_bytes = page_bytes
        self.world_size = world_size
        self.min_load_blocks = min_load_blocks
        self.remote = remote
        #: engine-wide sums of the per-request counters plus failed-job counts
        self.totals: Counter[str] = Counter()
        self._entry_type = entry_type
        self._entries: dict[str, E] = {}
        #: grows with every :meth:`reset`; the ranks echo the epoch of the step they ran
        self.epoch = 0

    # ------------------------------------------------------------------ entries

    def entry(self, req_id: str) -> E:
        """The request's entry, created on first use."""
        e = self._entries.get(req_id)
        if e is None:
            e = self._entries[req_id] = self._entry_type()
        return e

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._entries

    def _count(self, e: E, name: str, n: int) -> None:
        setattr(e, name, getattr(e, name) + n)
        self.totals[name] += n

    # ------------------------------------------------------------------ loads

    def lookup(
        self,
        req_id: str,
        num_computed_tokens: int,
        max_blocks: int,
        keys_upto: Callable[[int], Sequence[str]],
    ) -> int | None:
        """Tokens the store can add after ``num_computed_tokens``, pinned until taken;
        None while a fetch from the shared tier runs for the request (ask again).

        ``max_blocks``: the most leading blocks that may come from the store;
        ``keys_upto(n)``: the keys of blocks ``[0, n)``, built only when a hit of at
        least ``min_load_blocks`` is still possible. Any earlier offer is released
        first (vLLM asks again when an allocation failed)."""
        e = self.entry(req_id)
        self._release_load(e)
        first = num_computed_tokens // self.block_size
        if max_blocks - first < self.min_load_blocks:
            return 0
        keys = keys_upto(max_blocks)
        hit = self.index.lookup_prefix(keys)
        if self.remote is not None and hit < max_blocks:
            if self.remote.consult(req_id, keys, hit):
                return None
            if self.remote.fetched_keys(req_id):  # a settled fetch made them local
                hit = self.index.lookup_prefix(keys)
        if hit - first < self.min_load_blocks:
            return 0
        pin = self.index.pin(keys[first:hit])
        if pin is None:  # cannot happen single-threaded; stay safe
            return 0
        e.load_pin, e.load_range = pin, (first, hit)
        return (hit - first) * self.block_size

    def release_load(self, req_id: str) -> None:
        """Drop the request's pending load offer, if any."""
        e = self._entries.get(req_id)
        if e is not None:
            self._release_load(e)

    def _release_load(self, e: E) -> None:
        if e.load_pin is not None:
            self.index.unpin(e.load_pin)
            e.load_pin = None
            e.load_range = (0, 0)

    def _take_offer(self, req_id: str, num_tokens: int) -> tuple[E, Pin, int, int] | None:
        """The offer vLLM took exactly as made: ``(entry, pin, first, last)``, with the pin
        now the caller's to hold or release and the blocks counted as loaded. Any other
        count releases the offer."""
        e = self.entry(req_id)
        pin = e.load_pin
        if num_tokens == 0 or pin is None:
            self._release_load(e)
            return None
        first, last = e.load_range
        if (last - first) * self.block_size != num_tokens:
            log.warning("store: request %s: scheduler accepted %d external tokens, expected %d; "
                        "not loading", req_id, num_tokens, (last - first) * self.block_size)
            self._release_load(e)
            return None
        e.load_pin = None
        self._count(e, "loaded_blocks", last - first)
        if self.remote is not None:
            fetched = self.remote.fetched_keys(req_id)
            self._count(e, "remote_blocks", sum(1 for k in pin.keys if k in fetched))
        return e, pin, first, last

    def preempted(self, req_id: str) -> None:
        """vLLM preempted the request: its resumption consults the tier behind the local
        pages again (blocks that went there meanwhile come back, not recomputed)."""
        if self.remote is not None:
            self.remote.again(req_id)

    # ------------------------------------------------------------------ end

    def finish(self, req_id: str) -> dict[str, int] | None:
        """Forget a finished request; its pins are released. Returns its block counts
        (None for a request never seen)."""
        if self.remote is not None:
            self.remote.forget(req_id)
        e = self._entries.pop(req_id, None)
        if e is None:
            return None
        self._release_load(e)
        self._finished(e)
        return e.counts()

    def _finished(self, e: E) -> None:
        """Mode-specific release of what a finished request still holds."""

    def report(self, done: Mapping[Any, int], failed: Mapping[Any, int]) -> None:
        """Ranks' completions (job id or block key -> ranks done / failed) in the
        current epoch; implemented per mode."""

    def hold(self, counts: Mapping[Any, int]) -> None:
        """Ranks whose publish of a save (job id or block key -> ranks) outlived its
        deadline: the library may still read the saved pages, so the save's objects stay
        pending (pages never reused) until :meth:`release`; implemented per mode."""

    def release(self, counts: Mapping[Any, int]) -> None:
        """Those publishes really ended: the held saves settle now (commit, or abort if a
        rank failed or a reset came meanwhile)."""

    def reset(self) -> int:
        """Forget every object of the index (``LocalStore.clear``) and start a new epoch;
        returns how many objects were dropped. Every offer is dropped (its pin is inert
        after the clear); modes extend :meth:`_settle_for_reset` to settle their
        in-flight jobs first. The per-request counters and the totals stay."""
        self._settle_for_reset()
        for e in self._entries.values():
            e.load_pin = None
            e.load_range = (0, 0)
        self.epoch += 1
        self.totals["store_resets"] += 1
        return self.index.clear()

    def _settle_for_reset(self) -> None:
        """Mode-specific settling of open jobs before the index forgets its objects."""

    def current(self, epoch: int) -> bool:
        """Whether the ranks' report of a step run in ``epoch`` counts. A report of an
        older epoch is of jobs the reset settled already: it must not commit anything
        into the new index (counted as ``stale_reports``)."""
        if epoch == self.epoch:
            return True
        self.totals["stale_reports"] += 1
        log.debug("store: a report of epoch %d dropped (now %d)", epoch, self.epoch)
        return False

    # ------------------------------------------------------------------ reporting

    def store_gauges(self) -> dict[str, int]:
        """The store index's occupancy, reported with every finished request."""
        g = self.index.stats()
        return {
            "stored_objects": g.stored_objects,
            "pinned_objects": g.pinned_objects,
            "pending_objects": g.pending_objects,
            "free_pages": g.free_pages,
            "total_pages": g.total_pages,
            "skipped_stores": g.skipped_stores,
            "evicted_objects": g.evicted_objects,
        }

    def counters(self) -> dict[str, int]:
        """Monotonic totals for the connector's metrics (turned into deltas there)."""
        return self.metrics()[0]

    def metrics(self) -> tuple[dict[str, int], dict[str, int]]:
        """(monotonic totals, idle gauges: objects pinned and pending now), from one
        ``stats()`` of the index (it walks the objects: once per report)."""
        g = self.index.stats()
        totals = dict(self.totals)
        totals.update(lookups=g.lookups, hit_objects=g.hit_objects, miss_objects=g.miss_objects,
                      evicted_objects=g.evicted_objects)
        if self.remote is not None:
            totals.update(self.remote.counters())
        return totals, {"pinned_objects": g.pinned_objects, "pending_objects": g.pending_objects}
