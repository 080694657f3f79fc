"""Prefill requests computed before their decode registered: claimed by the worker, published late.

With early dispatch the proxy sends the prefill request before the decode has
allocated its blocks. Holding the request until the scheduler has claimed the
registration puts the decode's HTTP ingress and registration in front of the
prefill's forward; instead (``claim_in_worker``) the prefill computes at once and
each worker rank claims the registration itself while the forward runs
(:class:`~ascend_offload.pd.claims.Claims`, one asyncio task per claim). Every layer
written before the registration arrives is remembered; the moment the claim ends,
those layers are published from the claims' loop thread (the worker's next hook may
be a whole forward later), and later layers are published as they are written.

A failed claim, or a registration this rank refuses (malformed, another transfer
protocol, blocks that do not line up with ours), ends the request's send with
nothing published (:meth:`LateSends.take_failed`): decode recovers by its own
deadline, and vLLM frees the blocks once it finished the request. Every claim is
bounded by the claim deadline and the proxy's registration deadline; the blocks are
held until then, as for any send.

vLLM-free: the worker passes ``start`` (announce a claimed send and publish the
layers already written) and ``publish`` (one more layer of a started send).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable, Sequence

from ascend_offload.pd.claims import MAX_BLOCKS, ClaimError, ClaimOutcome, Claims, answer_max_bytes
from ascend_offload.pd.prefill_requests import LateSendJob, SendJob, check_registration, send_job
from ascend_offload.pd.registration import ParamsError, ProtocolGuard

log = logging.getLogger(__name__)

Start = Callable[[SendJob, Sequence[int]], bool]
Publish = Callable[[SendJob, int], None]


@dataclasses.dataclass
class _Late:
    blocks: tuple[int, ...]
    written: list[int] = dataclasses.field(default_factory=list)  # before the claim ended
    job: SendJob | None = None  # once claimed and started
    complete: bool = False  # its forward ended: no more layers will be written


class LateSends:
    """One worker rank's late sends: claims in flight, layers written before them."""

    def __init__(self, *, start: Start, publish: Publish, transfer_protocol: str = "",
                 claim_timeout_s: float = 600.0, backoff_s: float = 0.05, max_backoff_s: float = 2.0) -> None:
        """``start(job, layers)``: announce the send and publish ``layers``; False if the
        decode it names cannot be served (the send then fails). ``publish(job, layer)``:
        publish one more layer. Both run under this object's lock, on whichever thread
        ended the claim or wrote the layer; they must not block."""
        self._start = start
        self._publish = publish
        self.protocol = ProtocolGuard(transfer_protocol) if transfer_protocol else None
        # a registration of more blocks is refused (check_registration): no larger answer is read
        self.claims = Claims(timeout_s=claim_timeout_s, max_answer_bytes=answer_max_bytes(MAX_BLOCKS),
                             backoff_s=backoff_s, max_backoff_s=max_backoff_s)
        self._lock = threading.Lock()
        self._late: dict[str, _Late] = {}
        self._failed: set[str] = set()  # ended with nothing published; taken by the worker
        self.claimed = 0
        self.failures = 0

    @property
    def waiting(self) -> int:
        """Requests whose claim has not ended yet."""
        with self._lock:
            return sum(1 for late in self._late.values() if late.job is None)

    def __contains__(self, request_id: object) -> bool:
        """``request_id``'s send is neither started nor failed-and-taken yet."""
        with self._lock:
            return request_id in self._late or request_id in self._failed

    def add(self, job: LateSendJob) -> None:
        """Claim the registration of ``job`` (this step computes the rest of its prompt)."""
        with self._lock:
            self._late[job.request_id] = _Late(job.block_ids)
        self.claims.submit(job.request_id, job.claim_url, job.proxy_request_id, job.claim_token,
                           on_end=self._claimed)

    def written(self, layer: int, request_ids: Iterable[str]) -> None:
        """``layer`` of these requests is in memory (published now if claimed, else later)."""
        with self._lock:
            for rid in request_ids:
                late = self._late.get(rid)
                if late is None or late.complete:
                    continue
                if late.job is not None:
                    self._publish(late.job, layer)
                else:
                    late.written.append(layer)

    def end_step(self, request_ids: Iterable[str]) -> None:
        """The forward that wrote these requests ended; started ones are done here."""
        with self._lock:
            for rid in request_ids:
                late = self._late.get(rid)
                if late is None:
                    continue
                late.complete = True
                if late.job is not None:
                    del self._late[rid]

    def take_failed(self) -> set[str]:
        """Requests whose send ended with nothing published since the last call."""
        with self._lock:
            out, self._failed = self._failed, set()
        return out

    def close(self) -> None:
        """Cancel the claims in flight (shutdown)."""
        self.claims.close()

    # ------------------------------------------------------------------ claims' loop thread

    def _claimed(self, rid: str, outcome: ClaimOutcome) -> None:
        with self._lock:
            late = self._late.get(rid)
            if late is None:
                return
            why: str | None = None
            if isinstance(outcome, ClaimError):
                why = f"claim of the decode registration failed: {outcome}"
            else:
                try:
                    check_registration(outcome)
                    refused = self.protocol.refuse(outcome) if self.protocol is not None else None
                    if refused is not None:
                        raise ParamsError(f"transfer protocol mismatch: {refused}")
                    job = send_job(rid, outcome, late.blocks)
                except ParamsError as exc:
                    why = f"invalid decode registration: {exc}"
                else:
                    late.job = job
                    if self._start(job, late.written):
                        self.claimed += 1
                        late.written = []
                        if late.complete:
                            del self._late[rid]
                        return
                    why = f"cannot send to decode {job.host}:{job.kv_port} (see the log above)"
            # logged before the worker can see the failure (and free the blocks)
            log.error("remote-d2h: request %s was computed before its decode registered and %s; "
                      "decode will not get its KV", rid, why)
            del self._late[rid]
            self._failed.add(rid)
            self.failures += 1
