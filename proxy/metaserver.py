"""Requests waiting for (or past) their decode instance's registration.

A ``Pending`` lives from the moment the proxy forwards a sub-request to a
decode until that sub-request finishes. It owns the registration deadline
and, once the decode registered, the prefill dispatch. Failures before the
decode produced any output cancel the task that serves the client, which then
answers with the error and closes the decode connection; failures after
that only get logged (the decode already has what it needs).

Each ``Pending`` carries a fresh ``secrets.token_urlsafe`` token that only the
decode it was forwarded to receives; a registration must present it (with
early prefill dispatch a second one goes only to the prefill, which presents it
to claim the registration). The table
is bounded: an entry lives only as long as its client request (the
registration deadline fails that request when the decode stays silent), and
beyond ``cap`` entries new sub-requests are refused with 503.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import TYPE_CHECKING, Any

from proxy.errors import ProxyError

if TYPE_CHECKING:
    from proxy.bodies import SharedBody

log = logging.getLogger("proxy.metaserver")


class Pending:
    """Registration and prefill state of one decode sub-request."""

    __slots__ = (
        "_deadline",
        "auth",
        "body",
        "claim_token",
        "dispatched",
        "done",
        "error",
        "id",
        "owner",
        "params",
        "path",
        "prefill_task",
        "registered_params",
        "shared",
        "started",
        "token",
        "weight",
    )

    def __init__(self, request_id: str, path: str, body: dict[str, Any], weight: int) -> None:
        self.id = request_id
        self.path = path
        self.body = body
        self.weight = weight
        self.auth: str | None = None  # the client's Authorization header, passed on
        # Handed only to the decode this sub-request goes to; required to register.
        self.token = secrets.token_urlsafe(24)
        # Early dispatch only: handed to the prefill, required to claim the registration.
        self.claim_token: str | None = None
        # Early dispatch only: resolved with the params when the decode registers.
        self.registered_params: asyncio.Future[dict[str, Any]] | None = None
        self.shared: SharedBody | None = None  # the encoded body, shared with sibling sub-requests
        self.params: dict[str, Any] | None = None
        self.dispatched: asyncio.Future[bool] | None = None
        self.prefill_task: asyncio.Task[None] | None = None
        self.owner: asyncio.Task[Any] | None = None
        self.error: ProxyError | None = None
        self.started = False
        self.done = False
        self._deadline: asyncio.TimerHandle | None = None

    def arm_deadline(self, loop: asyncio.AbstractEventLoop, seconds: float) -> None:
        """Fail with 504 unless the decode registers or answers within ``seconds``."""
        self._deadline = loop.call_later(seconds, self._expire, seconds)

    def disarm_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self, seconds: float) -> None:
        self._deadline = None
        self.fail(
            ProxyError(
                504,
                f"decode did not register with the metaserver nor answer within {seconds:g} s",
                "register_timeout",
            )
        )

    def fail(self, err: ProxyError) -> bool:
        """Abort the client-facing task with ``err``; False if too late to matter."""
        if self.done or self.error is not None:
            return False
        if self.started:
            log.warning("request %s: %s (decode output already started; not aborting)", self.id, err.message)
            return False
        self.error = err
        if self.owner is not None:
            self.owner.cancel()
        return True

    def registered(self) -> bool:
        return self.params is not None


class PendingTable:
    """proxy_request_id -> Pending, for the metaserver endpoint's lookups."""

    def __init__(self, cap: int = 16384) -> None:
        self.cap = cap
        self._items: dict[str, Pending] = {}

    def room(self, count: int) -> None:
        """Raise 503 unless ``count`` more entries fit (checked before a request starts)."""
        if len(self._items) + count > self.cap:
            raise ProxyError(
                503,
                f"the proxy has {len(self._items)} sub-requests in flight (limit {self.cap}); retry later",
                "overloaded",
                retry_after=1,
            )

    def add(self, p: Pending) -> None:
        if p.id in self._items:
            raise KeyError(f"duplicate proxy_request_id {p.id!r}")
        self.room(1)
        self._items[p.id] = p

    def get(self, request_id: str) -> Pending | None:
        return self._items.get(request_id)

    def finish(self, p: Pending) -> None:
        """Forget ``p``: later registrations for it get 404; waiters are released."""
        p.done = True
        p.disarm_deadline()
        self._items.pop(p.id, None)
        for fut in (p.dispatched, p.registered_params):
            if fut is not None and not fut.done():
                fut.set_exception(ProxyError(404, f"request {p.id} already finished", "finished"))
                fut.exception()  # mark retrieved: nobody may be waiting any more

    def __len__(self) -> int:
        return len(self._items)
