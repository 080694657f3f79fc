"""What every tier behind the scheduler's host pages shares: a request's wait for
blocks brought into reserved pages before they are offered.

Why fetch first and offer after: vLLM fails a request whose offered blocks then do
not arrive (``kv_load_failure_policy`` defaults to ``fail``), so a block the host
pages lack is never offered directly. The lookup reserves host pages for the blocks
the tier has (pending objects of the scheduler's index), the ranks fill them, and
the request waits (the lookup answers ``None``; vLLM asks again next step) until
they are committed or the deadline passed. The shared tier (``store/shared/remote_fetch.py``) and
the SSD tier (``store/ssd/jobs.py``) differ only in how they find the blocks and how the
ranks' reports settle a job; the request side is here, once.
"""

from __future__ import annotations

import abc
import itertools
import logging
import time
from collections.abc import Callable, Sequence

from ascend_offload.store.base import WriteHandle
from ascend_offload.store.local import LocalStore

log = logging.getLogger(__name__)


class TierWaits(abc.ABC):
    """One tier's open jobs as requests see them: one consult per request, a deadline
    on its wait, and the pages it reserved behind the host prefix."""

    #: the tier's name in log lines
    what = "tier"

    def __init__(self, index: LocalStore, *, page_bytes: int, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.index = index
        self.page_bytes = page_bytes
        self.timeout_s = timeout_s
        self._clock = clock
        self._ids = itertools.count(1)
        self._waiting: dict[str, tuple[int, float]] = {}  # req_id -> (job id, deadline)
        self._asked: set[str] = set()
        self._brought_for: dict[str, frozenset[str]] = {}

    @abc.abstractmethod
    def _is_open(self, job_id: int) -> bool:
        """Whether the job still waits for ranks' reports."""

    @abc.abstractmethod
    def _wait_timed_out(self) -> None:
        """Count a request that stopped waiting at its deadline."""

    def _wait_state(self, req_id: str) -> bool | None:
        """A request already consulted: True while it still waits for its job, False
        once it settled or the deadline passed. None: its first consult."""
        w = self._waiting.get(req_id)
        if w is not None:
            job_id, deadline = w
            if self._is_open(job_id):
                if self._clock() < deadline:
                    return True
                self._wait_timed_out()
                log.warning("store: request %s stops waiting for %s job %d after %.1f s; its blocks "
                            "are recomputed", req_id, self.what, job_id, self.timeout_s)
            del self._waiting[req_id]
            return False
        if req_id in self._asked:
            return False
        self._asked.add(req_id)
        return None

    def _reserve(self, keys: Sequence[str], local_hit: int, n: int) -> list[WriteHandle]:
        """Pending host objects for ``keys[local_hit:local_hit + n]``, as many leading
        ones as the pages allow (none when they are full of pins and pending saves);
        the host prefix is pinned meanwhile so it is not evicted to make room."""
        if n <= 0:
            return []
        # a guard, not a hit: the lookup's offer pins (and touches) what it serves
        guard = self.index.pin(keys[:local_hit], touch=False) if local_hit else None
        try:
            handles = self.index.allocate(keys[local_hit:local_hit + n], [self.page_bytes] * n)
        finally:
            if guard is not None:
                self.index.unpin(guard)
        if handles is None:
            return []
        lead = next((i for i, h in enumerate(handles) if h is None), len(handles))
        self.index.abort([h for h in handles[lead:] if h is not None])
        return [h for h in handles[:lead] if h is not None]

    def _start_wait(self, req_id: str, job_id: int, keys: tuple[str, ...]) -> None:
        self._waiting[req_id] = (job_id, self._clock() + self.timeout_s)
        self._brought_for[req_id] = frozenset(keys)

    def _clear_waits(self) -> None:
        """Forget every request's wait (the store's reset)."""
        self._waiting.clear()
        self._asked.clear()
        self._brought_for.clear()

    def fetched_keys(self, req_id: str) -> frozenset[str]:
        """Keys brought in from the tier for this request."""
        return self._brought_for.get(req_id, frozenset())

    def again(self, req_id: str) -> None:
        """vLLM preempted the request: its next admission consults the tier again. Why:
        "asked" holds for one admission only; while the request was out its blocks may
        have gone to the tier and left the host pages (an SSD spill, another engine's
        publish), and without a new consult they would be recomputed."""
        self.forget(req_id)

    def forget(self, req_id: str) -> None:
        """The request finished; its job (if any) still settles on the ranks' reports."""
        self._waiting.pop(req_id, None)
        self._asked.discard(req_id)
        self._brought_for.pop(req_id, None)
