"""Where a preempted request's computed KV lives, request by request (no vLLM).

Why: when vLLM preempts a request it frees the request's device blocks and later
re-admits it from zero computed tokens. Every full block it had computed was saved
to the store by the step that computed it, so on resumption the store can give
those blocks back instead of vLLM recomputing them. That is only correct when

* the save of every such block finished before the block was reused (the worker's
  fence, ``handle_preemptions``) and was committed before it is offered (a lookup
  only offers committed objects);
* a resumed request whose own saves are still in flight waits for them, with a
  deadline (``save_timeout_s``), instead of recomputing blocks that are one report
  away from the store, or waiting forever on a report that never comes;
* a block the store lost meanwhile (evicted, reset, a failed save) is recomputed,
  never served stale: the lookup simply stops at it.

This module keeps the states and the counters; the scheduler connector drives the
transitions from vLLM's calls and answers the questions below. States of one
request::

    DEVICE --preempt--> SAVING --saves reported--> STORED --offer taken--> LOADING --loads reported--> DEVICE
                    \\--(all saved)--------------^      \\--nothing to load------------------------------^
    any preempted state --reset / blocks gone--> LOST --resumed (recomputes)--> DEVICE

Counters: ``preempted_requests``; ``resumed_blocks`` (blocks of preempted requests
loaded back from the store, counted when the load was reported done);
``recomputed_blocks`` (full blocks a preempted request had computed that neither
the device prefix cache nor the store gave back); ``preempt_save_waits`` (lookups of
a resumed request answered "ask later" because its own saves were in flight).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)


class State(enum.Enum):
    DEVICE = "device"  # running; its blocks are on the device
    SAVING = "saving"  # preempted; some of its blocks' saves were not reported yet
    STORED = "stored"  # preempted; every save of its blocks settled (committed or not)
    LOADING = "loading"  # resumed; the store's copy of its blocks is being loaded
    LOST = "lost"  # preempted; the store dropped its objects (reset): it recomputes


COUNTER_NAMES = ("preempted_requests", "resumed_blocks", "recomputed_blocks", "preempt_save_waits")


@dataclasses.dataclass
class Residency:
    """One request's residency; ``keys`` are the store keys of the full blocks it had
    computed when it was last preempted."""

    state: State = State.DEVICE
    keys: tuple[str, ...] = ()
    preemptions: int = 0  # vLLM's request.num_preemptions last seen
    since: float = 0.0  # when the current preemption was seen (monotonic)
    waited: bool = False  # this preemption already counted a save wait
    loading: int = 0  # blocks of the accepted offer, not yet reported loaded
    counts: Counter[str] = dataclasses.field(default_factory=Counter)  # this request's counters


class ResidencyTracker:
    """Per-request residency states and the preemption counters.

    ``save_timeout_s``: how long a resumed request waits for its own in-flight saves
    before it is admitted anyway (the blocks whose saves did not settle are then
    recomputed). ``clock`` is injectable for tests.
    """

    def __init__(self, save_timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.save_timeout_s = save_timeout_s
        self._clock = clock
        self._reqs: dict[str, Residency] = {}
        self.totals: Counter[str] = Counter({name: 0 for name in COUNTER_NAMES})

    def state(self, req_id: str) -> State:
        r = self._reqs.get(req_id)
        return r.state if r is not None else State.DEVICE

    def keys(self, req_id: str) -> tuple[str, ...]:
        r = self._reqs.get(req_id)
        return r.keys if r is not None else ()

    def preempt(self, req_id: str, num_preemptions: int, keys: Sequence[str],
                pending: Callable[[str], bool]) -> bool:
        """vLLM preempted the request (its ``num_preemptions`` is now ``num_preemptions``):
        ``keys`` are its computed full blocks, ``pending(key)`` whether that block's save
        is still in flight. Seen at most once per preemption (the lookup of a request
        resumed in the same step may see it before ``build_connector_meta``); returns
        whether this call registered it."""
        r = self._reqs.setdefault(req_id, Residency())
        if num_preemptions <= r.preemptions:
            return False
        r.preemptions = num_preemptions
        r.keys = tuple(keys)
        r.since = self._clock()
        r.waited = False
        r.loading = 0
        r.state = State.SAVING if any(pending(k) for k in r.keys) else State.STORED
        self._count(r, "preempted_requests", 1)
        return True

    def wait_for_saves(self, req_id: str, pending: Callable[[str], bool]) -> bool:
        """Resumption lookup: True while the request's own saves are in flight and
        ``save_timeout_s`` has not passed since its preemption (answer "ask later");
        False once they settled or the deadline passed (look up what is stored)."""
        r = self._reqs.get(req_id)
        if r is None or r.state is not State.SAVING:
            return False
        if not any(pending(k) for k in r.keys):
            r.state = State.STORED
            return False
        if self._clock() - r.since >= self.save_timeout_s:
            log.warning("store: request %s resumed with its saves still in flight after %.1f s; "
                        "recomputing what did not settle", req_id, self.save_timeout_s)
            r.state = State.STORED
            return False
        if not r.waited:
            r.waited = True
            self._count(r, "preempt_save_waits", 1)
        return True

    def resume(self, req_id: str, device_blocks: int, loaded_blocks: int) -> None:
        """vLLM re-admitted a preempted request: ``device_blocks`` leading blocks came
        from the device prefix cache, the store loads the next ``loaded_blocks``; every
        other block it had computed is recomputed."""
        r = self._reqs.get(req_id)
        if r is None or r.state in (State.DEVICE, State.LOADING):
            return
        computed = len(r.keys)
        loaded = max(0, min(loaded_blocks, computed - device_blocks))
        self._count(r, "recomputed_blocks", max(0, computed - device_blocks - loaded))
        r.loading = loaded
        r.state = State.LOADING if loaded else State.DEVICE

    def loaded(self, req_id: str, ok: bool) -> None:
        """The resumed request's load was reported by every rank (``ok``: all copied);
        a failed load is recomputed by vLLM (``kv_load_failure_policy``)."""
        r = self._reqs.get(req_id)
        if r is None or r.state is not State.LOADING:
            return
        self._count(r, "resumed_blocks" if ok else "recomputed_blocks", r.loading)
        r.loading = 0
        r.state = State.DEVICE

    def reset(self) -> int:
        """The store forgot every object: every preempted request lost its blocks. A
        load in flight still runs (its pages are reused only by a later step's copies)
        but its report belongs to the old epoch and is dropped, so it is counted
        neither resumed nor recomputed. Returns how many requests were marked lost."""
        n = 0
        for r in self._reqs.values():
            if r.state in (State.SAVING, State.STORED):
                r.state = State.LOST
                n += 1
            elif r.state is State.LOADING:  # its report is fenced off: not counted
                r.loading = 0
                r.state = State.DEVICE
        return n

    def _count(self, r: Residency, name: str, n: int) -> None:
        r.counts[name] += n
        self.totals[name] += n

    def forget(self, req_id: str) -> dict[str, int]:
        """The request finished: its counters (empty for a request never preempted)."""
        r = self._reqs.pop(req_id, None)
        return {name: r.counts[name] for name in COUNTER_NAMES} if r is not None and r.preemptions else {}

    def counters(self) -> dict[str, int]:
        return dict(self.totals)
