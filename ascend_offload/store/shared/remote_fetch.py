"""Scheduler-side fetches from a shared store tier (Mooncake, Memcache) into the local pages.

Fetch first, offer after (``store/book/tier_waits.py``): blocks the local pages lack but
the shared tier has are fetched by the worker ranks into reserved local pages while
the request waits. Once every rank reported, the objects are committed locally and
the next lookup offers them like any local hit, under a pin. A failed fetch, a
master that went away or a fetch past its deadline only makes the next lookup
shorter: a miss, recomputed.

Rules (each a unit test):

* a request consults the shared tier once per admission (again after a preemption);
  its next lookups use the local index;
* a fetch is committed only when every rank fetched it whole, aborted otherwise,
  and never aborted while a rank says a transfer may still write its pages (its
  pages are quarantined; a get past its deadline releases them once it ended);
* a request never waits past ``timeout_s`` for a fetch.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from ascend_offload.store.base import WriteHandle
from ascend_offload.store.book.tier_waits import TierWaits
from ascend_offload.store.local import LocalStore

log = logging.getLogger(__name__)


class SharedTier(Protocol):
    """What the scheduler asks the shared tier (``store/shared/tier.py: RemoteIndex``)."""

    def available(self) -> bool: ...

    def lookup_prefix(self, keys: Sequence[str]) -> int: ...


@dataclasses.dataclass(frozen=True)
class FetchJob:
    """Every rank gets block ``keys[i]`` from the shared tier into its page ``pages[i]``."""

    job_id: int
    keys: tuple[str, ...]
    pages: tuple[int, ...]


@dataclasses.dataclass
class _Fetch:
    handles: list[WriteHandle]
    done: int = 0
    failed: int = 0
    unsafe: int = 0
    released: int = 0  # unsafe ranks whose late get has since ended


class RemoteFetches(TierWaits):
    """Fetch jobs of the shared tier and their completion across ranks (module doc)."""

    what = "shared-tier fetch"

    def __init__(
        self,
        index: LocalStore,
        tier: SharedTier,
        *,
        page_bytes: int,
        world_size: int,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(index, page_bytes=page_bytes, timeout_s=timeout_s, clock=clock)
        self.tier = tier
        self.world_size = world_size
        self._jobs: dict[int, _Fetch] = {}
        self._quarantined: dict[int, _Fetch] = {}  # settled, pages held for a late get
        self._queue: list[FetchJob] = []
        #: monotonic totals for the connector's metrics
        self.fetch_jobs = 0
        self.fetched_blocks = 0
        self.failed_fetch_jobs = 0
        self.timed_out_waits = 0
        self.quarantined_pages = 0
        self.released_pages = 0  # quarantined pages returned once their late get ended

    def consult(self, req_id: str, keys: Sequence[str], local_hit: int) -> bool:
        """True while the request should wait for a fetch of ``keys[local_hit:]`` (the
        local index has ``keys[:local_hit]``: a local hit is a prefix from block 0, so
        the fetch continues it). Starts that fetch on the first call."""
        state = self._wait_state(req_id)
        if state is not None:
            return state
        if local_hit >= len(keys) or not self.tier.available():
            return False
        owned = self._reserve(keys, local_hit, self.tier.lookup_prefix(keys[local_hit:]))
        if not owned:
            return False
        job = FetchJob(next(self._ids), tuple(h.key for h in owned),
                       tuple(self.index.pages(h.key)[0] for h in owned))
        self._jobs[job.job_id] = _Fetch(owned)
        self._queue.append(job)
        self._start_wait(req_id, job.job_id, job.keys)
        self.fetch_jobs += 1
        return True

    def _is_open(self, job_id: int) -> bool:
        return job_id in self._jobs

    def _wait_timed_out(self) -> None:
        self.timed_out_waits += 1

    def take_jobs(self) -> list[FetchJob]:
        """Fetch jobs started since the last step (the workers run them)."""
        jobs, self._queue = self._queue, []
        return jobs

    @property
    def open_jobs(self) -> int:
        return len(self._jobs)

    def report(self, done: Mapping[int, int], failed: Mapping[int, int],
               unsafe: Mapping[int, int]) -> None:
        """Ranks' fetch results (job id -> ranks); ``unsafe``: failed ranks whose transfer
        may still write the pages. Settles each job once every rank reported."""
        for counts, attr in ((done, "done"), (failed, "failed"), (unsafe, "unsafe")):
            for job_id, n in counts.items():
                job = self._jobs.get(job_id)
                if job is None:
                    log.warning("store: fetch report for unknown job %d ignored", job_id)
                    continue
                setattr(job, attr, getattr(job, attr) + n)
        for job_id in dict.fromkeys(itertools.chain(done, failed)):
            job = self._jobs.get(job_id)
            if job is None or job.done + job.failed < self.world_size:
                continue
            del self._jobs[job_id]
            if not job.failed:
                self.index.commit(job.handles)
                self.fetched_blocks += len(job.handles)
                continue
            self.failed_fetch_jobs += 1
            if job.unsafe > job.released:  # stays pending: its pages are not handed out again
                self.quarantined_pages += len(job.handles)
                self._quarantined[job_id] = job
            else:
                self.index.abort(job.handles)

    def release(self, counts: Mapping[int, int]) -> None:
        """Ranks whose get past its deadline (reported unsafe) has really ended (job id ->
        ranks): once every unsafe rank's has, the job's quarantined pages are free again.
        Why: repeated outages would otherwise shrink the page pool for good. A failure
        whose end nobody can see (a get that raised) stays quarantined."""
        for job_id, n in counts.items():
            job = self._jobs.get(job_id) or self._quarantined.get(job_id)
            if job is None:
                log.warning("store: release of unknown fetch job %d ignored", job_id)
                continue
            job.released += n
            if job.released >= job.unsafe and self._quarantined.pop(job_id, None) is not None:
                self.index.abort(job.handles)
                self.released_pages += len(job.handles)

    def counters(self) -> dict[str, int]:
        return {"remote_fetch_jobs": self.fetch_jobs, "remote_fetched_blocks": self.fetched_blocks,
                "remote_failed_fetch_jobs": self.failed_fetch_jobs,
                "remote_fetch_wait_timeouts": self.timed_out_waits,
                "remote_quarantined_pages": self.quarantined_pages,
                "remote_released_pages": self.released_pages}
