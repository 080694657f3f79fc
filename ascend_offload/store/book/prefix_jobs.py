"""Whole-prefix mode: copy jobs between vLLM's blocks and the worker ranks' host pages.

The scheduler decides everything (the store index lives here); each worker rank
only copies ``block_ids[i] <-> pages[i]`` of a :class:`CopyJob` and reports the
job done or failed. Why count reports: every rank holds its own shard of each
object, so an object is committed (or a load's pin released) only once *all*
ranks reported; one failed rank aborts a save, because a partial object would
be served to every rank later.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Mapping, Sequence

from ascend_offload.store.base import Pin, WriteHandle
from ascend_offload.store.book.request_book import RequestBook, RequestEntry
from ascend_offload.store.local import LocalStore
from ascend_offload.store.shared.remote_fetch import RemoteFetches

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CopyJob:
    """Copy ``block_ids[i]`` <-> pool page ``pages[i]`` on every rank. A save also names
    the blocks' keys: with a shared tier the ranks publish them from those pages."""

    job_id: int
    block_ids: tuple[int, ...]
    pages: tuple[int, ...]
    keys: tuple[str, ...] = ()


@dataclasses.dataclass
class PrefixEntry(RequestEntry):
    saved_upto: int = 0  # blocks [0, saved_upto) are stored, being stored, or skipped


@dataclasses.dataclass
class _Job:
    kind: str  # "load" | "save"
    req_id: str
    handles: list[WriteHandle] = dataclasses.field(default_factory=list)
    pin: Pin | None = None
    done: int = 0
    failed: int = 0
    held: int = 0  # ranks whose publish of the saved pages may still read them
    stale: bool = False  # settled by a reset while held: aborted once released


class PrefixJobs(RequestBook[PrefixEntry]):
    """Lookups, load and save jobs, and their completion across ranks."""

    def __init__(
        self, index: LocalStore, *, block_size: int, page_bytes: int, world_size: int,
        min_load_blocks: int, remote: RemoteFetches | None = None,
    ) -> None:
        super().__init__(index, PrefixEntry, block_size=block_size, page_bytes=page_bytes,
                         world_size=world_size, min_load_blocks=min_load_blocks, remote=remote)
        self._job_ids = itertools.count(1)
        self._jobs: dict[int, _Job] = {}
        self._held: dict[int, _Job] = {}  # saves every rank reported, settled once released
        self._pending_loads: list[CopyJob] = []
        #: loads every rank reported since the scheduler last drained this: (request, all ok)
        self.settled_loads: list[tuple[str, bool]] = []

    @property
    def open_jobs(self) -> int:
        """Jobs some rank has not reported yet."""
        return len(self._jobs)

    def accept_load(self, req_id: str, num_tokens: int, block_ids: Sequence[int]) -> CopyJob | None:
        """vLLM allocated ``block_ids`` (the request's block table) and takes ``num_tokens``
        from the store: queue the load of the offered blocks into them. The lookup's pin
        moves to the job and is released once every rank reported it."""
        taken = self._take_offer(req_id, num_tokens)
        if taken is None:
            return None
        e, pin, first, last = taken
        pages = tuple(self.index.pages(k)[0] for k in pin.keys)
        job = CopyJob(next(self._job_ids), tuple(block_ids[first:last]), pages)
        self._jobs[job.job_id] = _Job(kind="load", req_id=req_id, pin=pin)
        self._pending_loads.append(job)
        e.saved_upto = max(e.saved_upto, last)  # loaded blocks are stored already
        return job

    def take_loads(self) -> list[CopyJob]:
        """The loads accepted since the last step. Pages freed meanwhile need no notice
        in this mode (workers address pages only through jobs), so that list is drained."""
        self.index.take_freed()
        loads, self._pending_loads = self._pending_loads, []
        return loads

    def saved_upto(self, req_id: str) -> int:
        """Leading blocks of the request already stored, being stored, or skipped."""
        return self.entry(req_id).saved_upto

    def plan_save(self, req_id: str, keys: Sequence[str], block_ids: Sequence[int]) -> CopyJob | None:
        """Save the request's full blocks ``[saved_upto, len(keys))``; ``keys[i]`` is block
        ``i``'s key and ``block_ids`` the request's block table. Blocks the store already
        has are counted as duplicates; a full store skips all of them (a later request
        simply misses). None when nothing is to be copied."""
        e = self.entry(req_id)
        first, full = e.saved_upto, len(keys)
        if full <= first:
            return None
        e.saved_upto = full
        new_keys = keys[first:]
        handles = self.index.allocate(new_keys, [self.page_bytes] * len(new_keys))
        if handles is None:
            self._count(e, "skipped_blocks", len(new_keys))
            return None
        ids, pages, owned = [], [], []
        for i, h in enumerate(handles):
            if h is None:
                self._count(e, "duplicate_blocks", 1)
                continue
            ids.append(block_ids[first + i])
            pages.append(self.index.pages(h.key)[0])
            owned.append(h)
        if not owned:
            return None
        self._count(e, "saved_blocks", len(owned))
        job = CopyJob(next(self._job_ids), tuple(ids), tuple(pages), tuple(h.key for h in owned))
        self._jobs[job.job_id] = _Job(kind="save", req_id=req_id, handles=owned)
        return job

    def report(self, done: Mapping[int, int], failed: Mapping[int, int]) -> None:
        """Ranks' completions (job id -> number of ranks): a job completes when every rank
        reported; then a save commits (or aborts if any rank failed) and a load's pin is
        released."""
        for job_id, n in done.items():
            self._account(job_id, done=n)
        for job_id, n in failed.items():
            self._account(job_id, failed=n)

    def _account(self, job_id: int, done: int = 0, failed: int = 0) -> None:
        job = self._jobs.get(job_id)
        if job is None:
            log.warning("store: completion for unknown job %d ignored", job_id)
            return
        job.done += done
        job.failed += failed
        if job.done + job.failed < self.world_size:
            return
        del self._jobs[job_id]
        if job.failed:
            self.totals[f"{job.kind}_failed_jobs"] += 1
        if job.kind == "save":
            if job.held:  # a publish may still read its pages: settled when released
                self._held[job_id] = job
            else:
                self._settle_save(job)
        else:
            if job.pin is not None:
                self.index.unpin(job.pin)
            self.settled_loads.append((job.req_id, not job.failed))

    def _settle_save(self, job: _Job) -> None:
        if job.failed or job.stale:
            self.index.abort(job.handles)
        else:
            self.index.commit(job.handles)

    def hold(self, counts: Mapping[int, int]) -> None:
        for job_id, n in counts.items():
            job = self._jobs.get(job_id) or self._held.get(job_id)
            if job is None or job.kind != "save":
                log.warning("store: publish hold for unknown save job %d: its pages may be "
                            "reused under a late put (a fetch of it verifies, a miss)", job_id)
                continue
            job.held += n

    def release(self, counts: Mapping[int, int]) -> None:
        for job_id, n in counts.items():
            job = self._jobs.get(job_id) or self._held.get(job_id)
            if job is None:
                continue
            job.held = max(0, job.held - n)
            if not job.held and self._held.pop(job_id, None) is not None:
                self._settle_save(job)

    @property
    def held_jobs(self) -> int:
        """Save jobs every rank reported whose pages a late publish still reads."""
        return len(self._held)

    def rewind_saves(self, req_id: str, upto: int) -> None:
        """A resumed request holds only blocks ``[0, upto)`` (the rest is recomputed):
        save from there again (blocks the store still has count as duplicates)."""
        e = self.entry(req_id)
        e.saved_upto = min(e.saved_upto, upto)

    def _settle_for_reset(self) -> None:
        """Settle every open job before the index forgets its objects: a save's pending
        objects are aborted (their pages are free for a *later* step's copies, which
        every rank runs after this step's), a load's pin is dropped with the clear; the
        ranks' reports of these jobs arrive with the old epoch and are dropped, so none
        commits into the new index. Every request saves again from block 0."""
        for job_id, job in self._jobs.items():
            if job.kind != "save":
                continue
            if job.held:  # a late publish still reads its pages: pending until released
                job.stale = True
                self._held[job_id] = job
            else:
                self.index.abort(job.handles)
        for job in self._held.values():
            job.stale = True  # pre-reset objects never commit
        self._jobs.clear()
        self._pending_loads.clear()
        self.settled_loads.clear()
        for e in self._entries.values():
            e.saved_upto = 0
