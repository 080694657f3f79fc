"""Prefill-first dispatch on a prefill worker rank: sends waiting for their decode's registration.

The proxy (``dispatch: prefill_first``) sends the prefill at the same time as the
decode, so the prefill computes before it knows where the KV goes. In the step
where a request's prompt is computed, its :class:`SendJob` carries a fetch ticket
and all of its blocks; :class:`AwaitingSends` starts fetching the registration
(:class:`~ascend_offload.pd.registration_fetch.RegistrationFetcher`) and
remembers which layers the forward has written for it. When the registration
arrives (:meth:`AwaitingSends.take`, polled at every layer and every step):

* during the forward: the layers already written are published at once and the
  request joins the step's sends, so its later layers go out as they are written;
* after the forward: every layer is published at once (the scheduler held the
  finished request's blocks for this: its ``request_finished`` delays the free).

Nothing waits without bound: a request not registered within ``wait_s`` (or whose
fetch was refused, or whose registration is malformed or unusable) ends as
*expired* / *refused*, its blocks are freed and decode, which never gets its
layers, fails the request at its own deadline and recomputes. At most
``max_requests`` wait at once; more are refused at once. Free of vLLM.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ascend_offload.pd.prefill_requests import SendJob, check_registration, job_for
from ascend_offload.pd.registration import DecodeRegistration, ParamsError, ProtocolGuard
from ascend_offload.pd.registration_fetch import FetchFailed, RegistrationFetcher

log = logging.getLogger(__name__)

# A fetch that has not ended this long after its deadline is given up here (a backstop:
# the fetcher's own deadline ends it first).
_BACKSTOP_S = 5.0


@dataclass(frozen=True)
class Joined:
    """A request whose registration arrived: publish ``layers`` now; ``in_forward``: the
    forward writing its other layers runs now, so it joins this step's sends."""

    job: SendJob
    layers: tuple[int, ...]
    in_forward: bool


@dataclass(frozen=True)
class Ended:
    """A request that will not be sent: its blocks may be freed."""

    request_id: str
    reason: str
    expired: bool


@dataclass
class AwaitingStats:
    fetched: int = 0  # registrations that arrived and were usable
    held: int = 0  # of those, published after the forward ended (blocks held for them)
    expired: int = 0  # no registration within the deadline
    refused: int = 0  # refused fetch, malformed or unusable registration, table full


@dataclass
class _Waiting:
    job: SendJob
    deadline: float
    in_forward: bool = True
    layers: set[int] = field(default_factory=set)


class AwaitingSends:
    """One worker rank's prefill-first sends whose registration has not arrived yet."""

    def __init__(self, fetcher: RegistrationFetcher, *, wait_s: float, max_requests: int = 1024,
                 protocol: str = "", clock: Callable[[], float] = time.monotonic) -> None:
        self.fetcher = fetcher
        self.wait_s = wait_s
        self.max_requests = max_requests
        self.guard = ProtocolGuard(protocol) if protocol else None
        self.stats = AwaitingStats()
        self._clock = clock
        self._waiting: dict[str, _Waiting] = {}
        self._logged_expiry = False

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._waiting

    def add(self, job: SendJob) -> Ended | None:
        """Start fetching ``job``'s registration (its forward runs now); an ``Ended`` if refused."""
        assert job.ticket is not None
        if len(self._waiting) >= self.max_requests:
            self.stats.refused += 1
            why = f"{len(self._waiting)} requests already wait for their registration (limit {self.max_requests})"
            log.error("remote-d2h: %s not sent to decode: %s", job.request_id, why)
            return Ended(job.request_id, why, expired=False)
        deadline = self._clock() + self.wait_s
        self._waiting[job.request_id] = _Waiting(job, deadline)
        self.fetcher.submit(job.request_id, job.ticket, deadline)
        return None

    def layer_written(self, layer: int) -> None:
        """The running forward wrote ``layer`` for its requests."""
        for w in self._waiting.values():
            if w.in_forward:
                w.layers.add(layer)

    def end_forward(self, num_layers: int) -> None:
        """The forward ended: every layer of its requests is written."""
        for w in self._waiting.values():
            if w.in_forward:
                w.in_forward = False
                w.layers = set(range(num_layers))

    def take(self) -> tuple[list[Joined], list[Ended]]:
        """Registrations that arrived (to publish), and requests that will never be sent."""
        joined: list[Joined] = []
        ended: list[Ended] = []
        for rid, result in self.fetcher.poll().items():
            w = self._waiting.pop(rid, None)
            if w is None:
                continue
            if isinstance(result, FetchFailed):
                ended.append(self._end(rid, result.reason, result.expired))
                continue
            try:
                job = self._usable(w.job, result)
            except ParamsError as exc:
                ended.append(self._end(rid, f"unusable registration: {exc}", expired=False))
                continue
            self.stats.fetched += 1
            if not w.in_forward:
                self.stats.held += 1
            joined.append(Joined(job, tuple(sorted(w.layers)), w.in_forward))
        if self._waiting:
            now = self._clock()
            for rid in [r for r, w in self._waiting.items() if now > w.deadline + _BACKSTOP_S]:
                del self._waiting[rid]
                self.fetcher.cancel(rid)
                ended.append(self._end(rid, "the registration fetch did not end by its deadline", True))
        return joined, ended

    def _usable(self, job: SendJob, reg: DecodeRegistration) -> SendJob:
        check_registration(reg)
        if self.guard is not None and (why := self.guard.refuse(reg)) is not None:
            raise ParamsError(why)
        return dataclasses.replace(job_for(job.request_id, reg, job.block_ids), ticket=None)

    def _end(self, rid: str, reason: str, expired: bool) -> Ended:
        if expired:
            self.stats.expired += 1
            # Counted always; logged at warning the first time, then at debug (a decode
            # that stopped registering would otherwise log every request).
            (log.debug if self._logged_expiry else log.warning)(
                "remote-d2h: %s: %s; its blocks are freed (decode recomputes)", rid, reason)
            self._logged_expiry = True
        else:
            self.stats.refused += 1
            log.error("remote-d2h: %s not sent to decode: %s", rid, reason)
        return Ended(rid, reason, expired)

    def close(self) -> None:
        for rid in self._waiting:
            self.fetcher.cancel(rid)
        self._waiting.clear()
        self.fetcher.close()
