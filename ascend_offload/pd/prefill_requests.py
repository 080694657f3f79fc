"""Prefill scheduler bookkeeping of remote decodes, free of vLLM.

A request carrying decode's registration (``do_remote_decode``) is tracked
from allocation; in the step where its prompt finishes computing, its blocks
and decode target become a :class:`SendJob` for the workers. Its blocks are
held after vLLM finished it until the workers report decode answered. The
registration is parsed and validated here, at the boundary — its schema, and
what the wire and the socket layer will later need of it (a host ZMQ can
connect to, a request id decode accepts, a block list the protocol carries) —
so nothing a peer registered can raise later in the scheduler or the workers.
A malformed one fails that request alone: it is logged once, runs as a plain
prefill (its KV freed when it finishes, never held for a decode), and its
error is returned in the request's ``kv_transfer_params``
(``remote_d2h_error``); decode times out and recovers by its own policy.

Early dispatch: a request whose params carry a ``claim_url`` arrived before its
decode registered. By default (``claim_in_worker``) it is scheduled at once: in the
step where its prompt finishes it becomes a :class:`LateSendJob`, and each worker
claims the registration itself while it computes, publishing the layers already
written the moment it arrives (:mod:`ascend_offload.pd.late_sends`); its blocks are
held like any send's. Otherwise (layer sharing on the prefill: a layer's buffer is
reused within the forward, so it must be published before the next layer) it is held
back (:meth:`PrefillRequests.ready` is False) while the scheduler's claim
(:mod:`ascend_offload.pd.claims`) waits for the registration; then its params become
the registration and it follows the flow above. A claim refused at the boundary
(malformed keys), or a scheduler's claim that failed, is handled like a refused
registration: logged once, a plain prefill, the error in its ``kv_transfer_params``.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from ascend_offload.pd.claims import (
    MAX_BLOCKS,
    ClaimError,
    Claims,
    ClaimTicket,
    answer_max_bytes,
    wants_claim,
)
from ascend_offload.pd.protocol import MAX_NAME
from ascend_offload.pd.registration import DecodeRegistration, ParamsError, ProtocolGuard

# Key of the error returned in a rejected request's kv_transfer_params.
ERROR_KEY = "remote_d2h_error"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SendJob:
    """One request whose KV a prefill worker publishes to decode this step."""

    request_id: str  # prefill's own id
    remote_request_id: str  # decode's id: the name on the wire
    block_ids: tuple[int, ...]  # prefill blocks, aligned with decode's block list
    host: str
    kv_port: int
    d_tp: int
    dp_rank: int


@dataclasses.dataclass(frozen=True)
class LateSendJob:
    """A request computed before its decode registered: its workers claim the registration
    and publish to the decode it names (``claim_in_worker``)."""

    request_id: str  # prefill's own id
    block_ids: tuple[int, ...]  # all its prefill blocks: the registration's offset picks decode's
    claim_url: str
    proxy_request_id: str
    claim_token: str = dataclasses.field(repr=False)  # a secret: never in a log line

    @classmethod
    def of(cls, request_id: str, block_ids: Sequence[int], ticket: ClaimTicket) -> LateSendJob:
        return cls(request_id, tuple(block_ids), ticket.claim_url, ticket.proxy_request_id,
                   ticket.claim_token)


def send_job(rid: str, reg: DecodeRegistration, mine: Sequence[int] | None) -> SendJob:
    """The send of request ``rid`` (its prefill blocks ``mine``, None if unknown) to the
    decode ``reg`` names; ParamsError says why there is none."""
    if mine is None:
        raise ParamsError(f"no KV cache manager bound; cannot send {rid}")
    want = len(reg.remote_block_ids)
    src = tuple(mine[reg.remote_block_offset:reg.remote_block_offset + want])
    if len(src) != want:
        raise ParamsError(f"request {rid} has {len(mine)} prefill blocks from offset "
                          f"{reg.remote_block_offset}; decode expects {want}")
    return SendJob(rid, reg.remote_request_id, src, reg.remote_host, reg.remote_port,
                   reg.remote_tp_size, reg.remote_dp_rank)


class PromptProgress(Protocol):
    """The fields of a scheduler request this bookkeeping reads (vLLM's ``Request`` has them)."""

    @property
    def request_id(self) -> str: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_computed_tokens(self) -> int: ...


class ClaimingRequest(Protocol):
    """A waiting scheduler request whose params a claim may replace (vLLM's ``Request``)."""

    @property
    def request_id(self) -> str: ...
    kv_transfer_params: dict[str, Any] | None


def host_error(host: str) -> str | None:
    """Why ``host`` is not an IP address or DNS name ZMQ can connect to (None if it is)."""
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    if len(host) > 253 or not _HOSTNAME.fullmatch(host):
        return f"remote_host={host[:80]!r} is neither an IP address nor a host name"
    return None


def check_registration(reg: DecodeRegistration) -> None:
    """Checks the schema cannot express: what the socket layer and the wire need later."""
    why = host_error(reg.remote_host)
    if why:
        raise ParamsError(why)
    if not 0 < len(reg.remote_request_id) <= MAX_NAME:
        raise ParamsError(f"remote_request_id of {len(reg.remote_request_id)} characters "
                          f"(accepted: 1..{MAX_NAME})")
    if len(reg.remote_block_ids) > MAX_BLOCKS:
        raise ParamsError(f"{len(reg.remote_block_ids)} remote_block_ids (accepted: <= {MAX_BLOCKS})")
    if reg.remote_port == 0:
        raise ParamsError("remote_port=0 (accepted: 1..65535)")


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """The proxy dispatched this prefill on behalf of a registered decode."""
    return bool(params and params.get("do_remote_decode"))


class PrefillRequests:
    """Requests whose KV this prefill publishes to a decode: pending, sending."""

    def __init__(self, transfer_protocol: str = "", *, claim_timeout_s: float = 600.0,
                 claim_wait_s: float = 0.0, claim_in_worker: bool = False) -> None:
        """``transfer_protocol``: this prefill's ``backend/protocol``; a decode advertising
        another is refused per request (empty: not checked). ``claim_timeout_s``: how long
        an early-dispatched request waits for its decode's registration. ``claim_wait_s``:
        how long :meth:`ready` may block, once per step that follows an idle one, for a
        held request's claim to end (:meth:`end_step`). ``claim_in_worker``: schedule an
        early-dispatched request at once; its workers claim the registration
        (:class:`LateSendJob`)."""
        self.claim_in_worker = claim_in_worker
        self._tickets: dict[str, ClaimTicket] = {}  # claim_in_worker: early requests, until finished
        self.protocol = ProtocolGuard(transfer_protocol) if transfer_protocol else None
        # a registration of more blocks is refused (check_registration): no larger answer is read
        self.claims = Claims(timeout_s=claim_timeout_s, max_answer_bytes=answer_max_bytes(MAX_BLOCKS))
        self.claim_wait_s = claim_wait_s
        self._wait_budget = claim_wait_s  # what ready() may still block in this step
        self._pending: dict[str, tuple[PromptProgress, DecodeRegistration | ClaimTicket]] = {}
        self._sending: set[str] = set()
        self._errors: dict[str, str] = {}  # rejected requests -> why, until vLLM finishes them

    @property
    def sending(self) -> frozenset[str]:
        """Requests whose blocks decode may still read."""
        return frozenset(self._sending)

    @property
    def claiming(self) -> int:
        """Early-dispatched requests still waiting for their decode's registration."""
        return len(self.claims)

    def ready(self, request: ClaimingRequest) -> bool:
        """Whether vLLM may schedule ``request`` now: False while its claim runs (started
        here the first time it is asked about). Once the claim ended its params are the
        registration (``do_remote_decode``), or, if it failed, a plain prefill's."""
        rid = request.request_id
        if rid in self._tickets:
            return True
        if rid not in self.claims:
            params = request.kv_transfer_params
            if not wants_claim(params):
                return True
            assert params is not None
            try:
                ticket = ClaimTicket.from_params(params)
            except ClaimError as exc:
                self._claim_failed(request, exc)
                return True
            if self.claim_in_worker:  # computed now; its workers claim the registration
                self._tickets[rid] = ticket
                return True
            self.claims.submit(rid, ticket.claim_url, ticket.proxy_request_id, ticket.claim_token)
        outcome = self.claims.result(rid)
        if outcome is None and self._wait_budget > 0:
            # An otherwise idle scheduler waits here, not in an empty step: vLLM schedules
            # only at step boundaries, so a claim ending during an empty step would wait
            # for the next one (a worker round trip, ~2-3 ms on a loaded host).
            wait, self._wait_budget = self._wait_budget, 0.0
            self.claims.wait(wait, request_id=rid)
            outcome = self.claims.result(rid)
        if outcome is None:
            return False
        if isinstance(outcome, ClaimError):
            self._claim_failed(request, outcome)
        else:
            request.kv_transfer_params = {"do_remote_decode": True, "do_remote_prefill": False,
                                          **outcome.to_wire()}
            log.debug("remote-d2h: %s claimed decode %s:%d's registration", rid, outcome.remote_host,
                      outcome.remote_port)
        return True

    def _claim_failed(self, request: ClaimingRequest, exc: ClaimError) -> None:
        log.error("remote-d2h: request %s was dispatched before its decode registered and its claim "
                  "failed: %s; it runs as a plain prefill, decode will not get its KV", request.request_id, exc)
        self._errors[request.request_id] = f"claim of the decode registration failed: {exc}"
        request.kv_transfer_params = {"do_remote_decode": False, "do_remote_prefill": False}

    def end_step(self, idle: bool) -> None:
        """The scheduler built a step; ``idle``: it schedules nothing. The next step's
        :meth:`ready` may then block up to ``claim_wait_s`` once, for a held request's
        claim: at most one wait a step, only when nothing else would run, so vLLM neither
        spins empty steps to poll the claims nor delays work for them."""
        self._wait_budget = self.claim_wait_s if idle else 0.0

    def after_alloc(self, request: PromptProgress, params: Mapping[str, Any]) -> bool:
        """Track ``request`` until its prompt is computed; False if its registration is invalid."""
        ticket = self._tickets.get(request.request_id)
        if ticket is not None:  # its workers claim the registration and check it
            self._pending[request.request_id] = (request, ticket)
            return True
        try:
            reg = DecodeRegistration.from_params(params)
            check_registration(reg)
        except ParamsError as exc:
            log.error("remote-d2h: request %s has do_remote_decode but %s; decode will not get its KV",
                      request.request_id, exc)
            self._errors[request.request_id] = f"invalid decode registration: {exc}"
            return False
        why = self.protocol.refuse(reg) if self.protocol is not None else None
        if why is not None:  # logged once per advertised protocol by the guard
            self._errors[request.request_id] = f"transfer protocol mismatch: {why}"
            return False
        self._pending[request.request_id] = (request, reg)
        return True

    def take_sends(self, scheduled: Mapping[str, int], block_ids: Callable[[str], Sequence[int] | None]
                   ) -> list[SendJob | LateSendJob]:
        """Requests whose prompt finishes computing in this step (``scheduled``: tokens per
        request), with their prefill blocks (``block_ids``: a request's blocks, None if
        unknown): sends to registered decodes, and late sends (the workers claim first)."""
        jobs: list[SendJob | LateSendJob] = []
        for rid, (req, reg) in list(self._pending.items()):
            n = scheduled.get(rid, 0)
            if not n or req.num_computed_tokens + n < req.num_prompt_tokens:
                continue
            del self._pending[rid]
            mine = block_ids(rid)
            if isinstance(reg, ClaimTicket):
                if mine is None:
                    log.error("remote-d2h: no KV cache manager bound; cannot send %s", rid)
                    self._errors[rid] = "prefill could not send its KV to decode (see the prefill's log)"
                    continue
                log.debug("remote-d2h: %s prefill completes this step; %d blocks, decode not claimed yet",
                          rid, len(mine))
                jobs.append(LateSendJob.of(rid, mine, reg))
                self._sending.add(rid)
                continue
            try:
                job = send_job(rid, reg, mine)
            except ParamsError as exc:
                log.error("remote-d2h: %s", exc)
                self._errors[rid] = "prefill could not send its KV to decode (see the prefill's log)"
                continue
            log.debug("remote-d2h: %s prefill completes this step; %d blocks -> decode %s:%d as %s",
                      rid, len(job.block_ids), job.host, job.kv_port, job.remote_request_id)
            jobs.append(job)
            self._sending.add(rid)
        return jobs

    def request_finished(self, request_id: str) -> bool:
        """vLLM finished the request; True: its blocks must wait (decode still reads them)."""
        self._pending.pop(request_id, None)
        self._tickets.pop(request_id, None)
        self.claims.cancel(request_id)  # if it was aborted while it waited for its decode
        return request_id in self._sending

    def take_error(self, request_id: str) -> dict[str, str] | None:
        """The ``kv_transfer_params`` to return for a finished request this side refused."""
        err = self._errors.pop(request_id, None)
        return {ERROR_KEY: err} if err is not None else None

    def workers_done(self, request_ids: Iterable[str]) -> None:
        """Workers reported decode answered for these requests (or gave up on it)."""
        self._sending.difference_update(request_ids)

    def close(self) -> None:
        """Cancel the claims in flight (shutdown)."""
        self.claims.close()
