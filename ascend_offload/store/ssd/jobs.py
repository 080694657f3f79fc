"""Scheduler-side SSD-tier bookkeeping: spill jobs (write-behind) and promote jobs.

**Spill: write-behind at commit.** When a saved object is committed in the host
index (every rank copied it), the next step sends a spill job: every rank writes
the object's page to the slot the :class:`~ascend_offload.store.ssd.index.SsdIndex`
chose, on its writer thread. The host object is pinned from then until every rank
reported the write, so its page is neither evicted nor reused under the writer; the
slot becomes *ready* (found by lookups) only then. Why not spill at eviction: host
eviction happens inside the allocation of a save, in the scheduler's step; a spill
there would have to wait for a disk write before the page could be reused (stalling
the scheduler), or drop the object. Write-behind costs disk bandwidth for objects
that are never evicted, bounded by ``max_inflight`` pinned blocks (over it, commits
wait in the backlog; a backlog object evicted from the host first is not spilled:
``ssd_spill_skipped``).

**Promote: fetch first, offer after** (``store/book/tier_waits.py``, shared with
``store/shared/remote_fetch.py``; :class:`RequestBook` calls ``consult`` / ``fetched_keys`` /
``forget`` / ``counters``). A lookup that continues the host prefix on the tier reserves host pages
(pending objects), pins the slots and answers "ask later" (``None``); the ranks read,
verify and copy the slots in ``start_load_kv`` and report how many leading blocks
arrived whole. Once every rank reported, the leading blocks that verified on every
rank are committed in the host index (the next lookup offers them, pinned), the
rest aborted; a slot that failed verification on any rank is dropped from the index
and counted (``ssd_checksum_failures``). The request never waits past ``timeout_s``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence

from ascend_offload.store.base import Pin, WriteHandle
from ascend_offload.store.book.tier_waits import TierWaits
from ascend_offload.store.local import LocalStore
from ascend_offload.store.ssd.index import SsdIndex

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SpillJob:
    """Every rank writes page ``pages[i]`` to slot ``slots[i]`` (block ``keys[i]``)."""

    job_id: int
    keys: tuple[str, ...]
    pages: tuple[int, ...]
    slots: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class PromoteJob:
    """Every rank reads slot ``slots[i]`` into page ``pages[i]`` (block ``keys[i]``), verified."""

    job_id: int
    keys: tuple[str, ...]
    pages: tuple[int, ...]
    slots: tuple[int, ...]


@dataclasses.dataclass
class _Spill:
    keys: tuple[str, ...]
    pin: Pin
    done: int = 0
    failed: int = 0
    cancelled: bool = False  # by a reset: its slots are freed, never made ready


@dataclasses.dataclass
class _Promote:
    keys: tuple[str, ...]
    handles: list[WriteHandle]
    reports: int = 0
    good: int = 0  # min over the reporting ranks of the leading blocks that arrived whole


class SsdJobs(TierWaits):
    """Spills and promotes of one SSD tier over the scheduler's host index (module doc)."""

    what = "SSD promote"

    def __init__(
        self,
        index: LocalStore,
        ssd: SsdIndex,
        *,
        page_bytes: int,
        world_size: int,
        timeout_s: float,
        max_inflight: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(index, page_bytes=page_bytes, timeout_s=timeout_s, clock=clock)
        self.ssd = ssd
        self.world_size = world_size
        self.max_inflight = max(1, max_inflight)
        self._watched: dict[str, None] = {}  # saved keys not spilled yet, oldest first
        self._spills: dict[int, _Spill] = {}
        self._spill_queue: list[SpillJob] = []
        self._inflight = 0
        self._promotes: dict[int, _Promote] = {}
        self._promote_queue: list[PromoteJob] = []
        self._corrupt: set[str] = set()  # keys a rank found corrupt, dropped once not being read
        self.totals: Counter[str] = Counter()

    # ------------------------------------------------------------------ spills

    def watch(self, keys: Iterable[str]) -> None:
        """Keys of a planned save: spilled once committed in the host index."""
        for k in keys:
            if k not in self.ssd:
                self._watched[k] = None

    def plan_spills(self) -> None:
        """Turn committed, watched keys into one spill job (call once per step)."""
        room = self.max_inflight - self._inflight
        if not self._watched or room <= 0:
            return
        ready: list[str] = []
        for k in list(self._watched):
            if len(ready) >= room:
                break
            if self.index.is_committed(k):
                del self._watched[k]
                if k not in self.ssd:
                    ready.append(k)
            elif not self.index.has(k):  # aborted, or evicted before it could be spilled
                del self._watched[k]
                self.totals["ssd_spill_skipped"] += 1
        if not ready:
            return
        slots = self.ssd.allocate(ready)
        keys = [k for k, s in zip(ready, slots, strict=True) if s is not None]
        self.totals["ssd_spill_skipped"] += len(ready) - len(keys)
        pin = self.index.pin(keys, touch=False) if keys else None  # the writer's hold, not a hit
        if pin is None:  # cannot happen single-threaded (committed a moment ago); stay safe
            self.ssd.drop(keys)
            return
        job = SpillJob(next(self._ids), tuple(keys), tuple(self.index.pages(k)[0] for k in keys),
                       tuple(self.ssd.slot(k) for k in keys))
        self._spills[job.job_id] = _Spill(job.keys, pin)
        self._spill_queue.append(job)
        self._inflight += len(keys)

    def take_spills(self) -> list[SpillJob]:
        jobs, self._spill_queue = self._spill_queue, []
        return jobs

    def report_spills(self, done: Mapping[int, int], failed: Mapping[int, int]) -> None:
        """Ranks' spill results (job id -> ranks): once every rank reported, the slots are
        ready (all wrote) or freed (one failed), and the host pin is released."""
        for counts, attr in ((done, "done"), (failed, "failed")):
            for job_id, n in counts.items():
                job = self._spills.get(job_id)
                if job is None:
                    log.warning("SSD tier: spill report for unknown job %d ignored", job_id)
                    continue
                setattr(job, attr, getattr(job, attr) + n)
        for job_id in dict.fromkeys((*done, *failed)):
            job = self._spills.get(job_id)
            if job is None or job.done + job.failed < self.world_size:
                continue
            del self._spills[job_id]
            self._inflight -= len(job.keys)
            self.index.unpin(job.pin)
            if job.cancelled:
                self.ssd.drop(job.keys)
            elif job.failed:
                self.ssd.drop(job.keys)
                self.totals["ssd_spill_failed"] += len(job.keys)
            else:
                self.ssd.mark_ready(job.keys)
                self.totals["ssd_spilled_blocks"] += len(job.keys)

    # ------------------------------------------------------------------ promotes (RequestBook's tier)

    def consult(self, req_id: str, keys: Sequence[str], local_hit: int) -> bool:
        """True while the request should wait for a promote of ``keys[local_hit:]`` from
        the tier; starts it on the request's first call (as ``RemoteFetches.consult``)."""
        state = self._wait_state(req_id)
        if state is not None:
            return state
        if local_hit >= len(keys):
            return False
        owned = self._reserve(keys, local_hit, self.ssd.lookup_prefix(keys[local_hit:]))
        if not owned:
            return False
        self.totals["ssd_hit_blocks"] += len(owned)
        job_keys = tuple(h.key for h in owned)
        job = PromoteJob(next(self._ids), job_keys, tuple(self.index.pages(k)[0] for k in job_keys),
                         tuple(self.ssd.pin(job_keys)))
        self._promotes[job.job_id] = _Promote(job_keys, owned, good=len(owned))
        self._promote_queue.append(job)
        self._start_wait(req_id, job.job_id, job_keys)
        return True

    def _is_open(self, job_id: int) -> bool:
        return job_id in self._promotes

    def _wait_timed_out(self) -> None:
        self.totals["ssd_promote_wait_timeouts"] += 1

    def take_promotes(self) -> list[PromoteJob]:
        jobs, self._promote_queue = self._promote_queue, []
        return jobs

    def report_promotes(self, good: Mapping[tuple[int, int], int], corrupt: Mapping[str, int]) -> None:
        """Ranks' promote results: ``good[(job id, n)]`` ranks brought the job's first ``n``
        blocks whole; ``corrupt[key]`` ranks found the key's slot failed verification."""
        for key, n in corrupt.items():
            self.totals["ssd_checksum_failures"] += n
            self._corrupt.add(key)
        touched = []
        for (job_id, n), ranks in good.items():
            job = self._promotes.get(job_id)
            if job is None:
                log.warning("SSD tier: promote report for unknown job %d ignored", job_id)
                continue
            job.reports += ranks
            job.good = min(job.good, max(0, n))
            touched.append(job_id)
        for job_id in dict.fromkeys(touched):
            job = self._promotes.get(job_id)
            if job is None or job.reports < self.world_size:
                continue
            del self._promotes[job_id]
            self.ssd.unpin(job.keys)
            self.index.commit(job.handles[:job.good])
            self.index.abort(job.handles[job.good:])
            self.totals["ssd_promoted_blocks"] += job.good
        # a slot that failed verification is forgotten once no open promote reads it
        held = {k for job in self._promotes.values() for k in job.keys}
        gone = [k for k in self._corrupt if k not in held]
        self.ssd.drop(gone)
        self._corrupt.difference_update(gone)

    # ------------------------------------------------------------------ reset

    def reset(self) -> int:
        """The store's reset (after the host index forgot its objects): forget every
        entry of the tier and every request's promote. Spills still being written are
        cancelled (their slots stay reserved until the ranks report, then are freed,
        never made ready); promotes still open commit nothing (their pages are aborted
        when reported). Returns how many tier entries went."""
        for job in self._spill_queue:  # planned but not sent: nothing reads their pages
            spill = self._spills.pop(job.job_id)
            self._inflight -= len(spill.keys)
            self.ssd.drop(spill.keys)
        self._spill_queue.clear()
        for spill in self._spills.values():
            spill.cancelled = True
        for pjob in self._promote_queue:  # planned but not sent
            promote = self._promotes.pop(pjob.job_id)
            self.index.abort(promote.handles)
        self._promote_queue.clear()
        for promote in self._promotes.values():
            promote.good = 0
        self._watched.clear()
        self._clear_waits()
        self._corrupt.clear()
        return self.ssd.clear()

    # ------------------------------------------------------------------ reporting

    @property
    def open_jobs(self) -> int:
        return len(self._spills) + len(self._promotes)

    def counters(self) -> dict[str, int]:
        """Monotonic totals (the connector's metrics turn them into deltas)."""
        out = {name: self.totals[name] for name in (
            "ssd_spilled_blocks", "ssd_spill_failed", "ssd_spill_skipped", "ssd_hit_blocks",
            "ssd_promoted_blocks", "ssd_checksum_failures", "ssd_promote_wait_timeouts")}
        out["ssd_evicted"] = self.ssd.evicted
        return out
