"""Prefill -> proxy metaserver claims: an early-dispatched prefill fetches decode's registration.

With early dispatch the proxy sends the prefill request together with the decode
request, before the decode registered, so the prefill's HTTP ingress overlaps the
decode's ingress and registration instead of following them. Such a request's
``kv_transfer_params`` carry a ``claim_url``, the ``proxy_request_id`` and a
``claim_token``; the prefill POSTs the id and the token there and the proxy holds
the answer until the decode registered, then returns
``{"kv_transfer_params": <DecodeRegistration>}``. The request must not be scheduled
before: its blocks would be computed with nowhere to send them.

Why one asyncio loop and not a thread pool: a claim waits until its decode
registers, and a decode registers a request only when its own scheduler takes it.
Claims of requests still queued at the decode could occupy every worker of a
bounded pool and starve the claims of requests the decode already registered: a
deadlock until the deadlines. One background thread runs an event loop with one
task per claim and an HTTP client without a connection cap, so every claim waits
on its own connection and costs a socket and a task, not a thread.

Everything is bounded: a claim has one deadline (``timeout_s``) over all its
attempts, the answer body read is capped (``max_answer_bytes``), and a claim is
cancelled when its request ends (:meth:`Claims.cancel`) or the connector shuts
down (:meth:`Claims.close`). The answer comes from an untrusted peer: it is parsed
into a fixed schema (unknown keys, wrong types refused, naming them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Annotated, Any

import httpx
import msgspec

from ascend_offload.errors import AscendOffloadError
from ascend_offload.pd.protocol import MAX_NAME
from ascend_offload.pd.registration import MIN_ATTEMPT_S, ROLE_FLAGS, DecodeRegistration

log = logging.getLogger(__name__)

# A registration's fixed part (five ids of at most 512 characters, the keys, the small
# ints, room for escapes and whitespace) and one block id in the JSON list (up to 10
# digits, a comma and a space): the proxy bounds a registration the same way.
ANSWER_OVERHEAD = 16 * 1024
ANSWER_BYTES_PER_BLOCK = 12
ERROR_BODY_BYTES = 4096  # of a refusal's body, for its message
RETRY_STATUSES = frozenset({408, 429})  # 4xx worth another attempt (besides 5xx)
MAX_URL = 2048
MAX_BLOCKS = 1 << 20  # what a read_ready item can carry (protocol.ReadReady.src_blocks)
# Only the raw body is read (capped); no transfer encoding may expand it.
_HEADERS = {"accept-encoding": "identity"}
# The attempt's deadline bounds the long-poll; a connect that hangs is retried sooner.
_CLIENT_TIMEOUT = httpx.Timeout(None, connect=10.0)


def answer_max_bytes(max_blocks: int) -> int:
    """The largest claim answer worth reading: a registration of ``max_blocks`` blocks.

    Why derived: the prefill refuses a registration of more blocks anyway, so a larger
    body is not an answer and must not cost more memory than the largest one."""
    return ANSWER_OVERHEAD + ANSWER_BYTES_PER_BLOCK * max_blocks


class ClaimError(AscendOffloadError, RuntimeError):
    """A claim failed for good: refused, malformed, or unanswered before its deadline."""


class ClaimTicket(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What the proxy puts in an early-dispatched prefill's ``kv_transfer_params``."""

    claim_url: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_URL)]
    proxy_request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME)]
    claim_token: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME)]

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> ClaimTicket:
        """Parse the params (role flags aside); ClaimError names what is wrong."""
        body = {k: v for k, v in params.items() if k not in ROLE_FLAGS}
        try:
            ticket = msgspec.convert(body, cls)
        except msgspec.ValidationError as exc:
            raise ClaimError(f"kv_transfer_params of an early-dispatched prefill: {exc}") from None
        if not ticket.claim_url.startswith(("http://", "https://")):
            raise ClaimError(f"claim_url={ticket.claim_url[:80]!r}: must be an http(s) URL")
        return ticket


def wants_claim(params: Mapping[str, Any] | None) -> bool:
    """The proxy dispatched this prefill early: decode's registration is to be claimed."""
    return bool(params and params.get("do_remote_decode") and "claim_url" in params)


class ClaimAnswer(msgspec.Struct, forbid_unknown_fields=True):
    """The metaserver's 200 answer to a claim."""

    kv_transfer_params: DecodeRegistration


class _TooLarge(AscendOffloadError):
    """An answer body over its cap (internal: :func:`claim` turns it into a ClaimError)."""


async def _read_capped(resp: httpx.Response, cap: int, *, truncate: bool = False) -> bytes:
    """The raw body (no content decoding: a compressed body could expand past any cap
    within one chunk), at most ``cap`` bytes: longer is ``_TooLarge``, or with
    ``truncate`` cut there (an error's text), the rest never read."""
    length = resp.headers.get("content-length")
    if not truncate and length is not None and length.isdigit() and int(length) > cap:
        raise _TooLarge(f"Content-Length {length}")
    out = bytearray()
    async for chunk in resp.aiter_raw():
        out += chunk
        if len(out) > cap:
            if truncate:
                return bytes(out[:cap])
            raise _TooLarge(f"more than {cap} bytes")
    return bytes(out)


def parse_answer(raw: bytes) -> DecodeRegistration:
    """The registration in a claim's 200 answer; ClaimError names what is wrong."""
    try:
        return msgspec.json.decode(raw, type=ClaimAnswer).kv_transfer_params
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ClaimError(f"malformed claim answer: {exc}") from None


def _retry_after(resp: httpx.Response) -> float | None:
    value = resp.headers.get("retry-after", "")
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


async def claim(
    client: httpx.AsyncClient,
    url: str,
    proxy_request_id: str,
    claim_token: str,
    *,
    timeout_s: float,
    max_answer_bytes: int,
    backoff_s: float = 0.05,
    max_backoff_s: float = 2.0,
    clock: Callable[[], float] = time.monotonic,
) -> DecodeRegistration:
    """Long-poll ``url`` until the decode of ``proxy_request_id`` registered; return its registration.

    Transport errors, 5xx, 408 and 429 are retried with capped exponential backoff
    (a ``Retry-After`` is honoured up to ``max_backoff_s``); any other answer is final.
    Everything ends by ``timeout_s`` (at least one attempt is made, given at least
    ``MIN_ATTEMPT_S``). The token is sent, never logged nor put in an error."""
    body = {"proxy_request_id": proxy_request_id, "claim_token": claim_token}
    deadline = clock() + timeout_s
    last = "no attempt made"
    attempts = 0
    while True:
        left = deadline - clock()
        if left <= 0 and attempts:
            break
        attempts += 1
        wait: float | None = None
        try:
            async with asyncio.timeout(max(left, MIN_ATTEMPT_S)):
                async with client.stream("POST", url, json=body, headers=_HEADERS) as resp:
                    status = resp.status_code
                    raw = await (_read_capped(resp, max_answer_bytes) if status == 200
                                 else _read_capped(resp, ERROR_BODY_BYTES, truncate=True))
        except httpx.TransportError as exc:
            last = f"{type(exc).__name__}: {exc}"
        except TimeoutError:
            last = f"no answer within the remaining {max(left, MIN_ATTEMPT_S):.1f}s"
        except _TooLarge as exc:
            raise ClaimError(f"claim answer too large ({exc}; accepted: <= {max_answer_bytes} bytes)"
                             ) from None
        else:
            if status == 200:
                return parse_answer(raw)
            last = f"HTTP {status} {raw[:200].decode('utf-8', 'replace')}"
            if status < 500 and status not in RETRY_STATUSES:
                raise ClaimError(f"metaserver {url} refused the claim of "
                                 f"proxy_request_id={proxy_request_id!r}: {last}")
            wait = _retry_after(resp)
        pause = min(backoff_s * 2 ** min(attempts - 1, 30), max_backoff_s)  # 2**n as a float overflows
        if wait is not None:
            pause = min(max(pause, wait), max_backoff_s)
        pause = min(pause, max(0.0, deadline - clock()))
        log.debug("claim of %r failed (%s); attempt %d in %.2fs", proxy_request_id, last, attempts + 1, pause)
        await asyncio.sleep(pause)
    raise ClaimError(f"metaserver {url}: no registration for proxy_request_id={proxy_request_id!r} "
                     f"within {timeout_s:.1f}s ({attempts} attempt(s)): {last}")


ClaimOutcome = DecodeRegistration | ClaimError
OnEnd = Callable[[str, ClaimOutcome], None]


@dataclasses.dataclass
class _Claim:
    ticket: object  # this submission (a later one of the same request id is another)
    outcome: ClaimOutcome | None = None
    on_end: OnEnd | None = None  # gets the outcome instead of result()


class Claims:
    """Claims in flight, one asyncio task each on one background thread; polled without blocking.

    The scheduler thread calls :meth:`submit`, :meth:`result`, :meth:`cancel`,
    :meth:`wait`; the loop thread records outcomes. ``counts`` tallies outcomes
    (``claimed``, ``failed``, ``cancelled``)."""

    def __init__(self, *, timeout_s: float = 600.0, max_answer_bytes: int = answer_max_bytes(MAX_BLOCKS),
                 backoff_s: float = 0.05, max_backoff_s: float = 2.0, max_keepalive: int = 32) -> None:
        self.timeout_s = timeout_s
        self.max_answer_bytes = max_answer_bytes
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_keepalive = max_keepalive
        self.counts: Counter[str] = Counter()
        self._cond = threading.Condition()
        self._claims: dict[str, _Claim] = {}  # submitted, outcome not yet taken
        self._live: set[object] = set()  # tickets whose task has not ended
        self._tasks: dict[object, asyncio.Task[None]] = {}  # loop thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client: httpx.AsyncClient | None = None
        self._closed = False

    @property
    def pending(self) -> int:
        """Claims whose task still runs (cancelled ones count until their task ended)."""
        with self._cond:
            return len(self._live)

    def __contains__(self, request_id: object) -> bool:
        """``request_id`` has a claim whose outcome is not taken yet (running or ended)."""
        with self._cond:
            return request_id in self._claims

    def __len__(self) -> int:
        """Claims whose outcome is not taken yet."""
        with self._cond:
            return len(self._claims)

    def submit(self, request_id: str, url: str, proxy_request_id: str, claim_token: str,
               on_end: OnEnd | None = None) -> None:
        """Start claiming decode's registration for ``request_id`` (replaces an earlier claim of it).

        ``on_end``: called once with ``(request_id, outcome)`` when the claim ends, on the
        loop thread (or on this one if the claims are closed), outside the lock; the
        outcome is then not kept for :meth:`result`. Why: a prefill worker publishes the
        layers it already computed the moment the registration arrives, not at its next
        hook. Not called for a cancelled claim."""
        self.cancel(request_id)
        ticket = object()
        with self._cond:
            self._claims[request_id] = _Claim(ticket, on_end=on_end)
            if self._closed:
                call = self._end(request_id, ticket, ClaimError("claims closed (connector shutting down)"))
            else:
                call = None
                loop = self._ensure_loop()
                self._live.add(ticket)
                loop.call_soon_threadsafe(self._start, request_id, ticket, url, proxy_request_id, claim_token)
        if call is not None:
            call()

    def result(self, request_id: str) -> DecodeRegistration | ClaimError | None:
        """None while the claim runs; once it ended, its registration or error (taken: the
        claim is forgotten). KeyError for a request with no claim."""
        with self._cond:
            c = self._claims[request_id]
            if c.outcome is None:
                return None
            del self._claims[request_id]
            return c.outcome

    def cancel(self, request_id: str) -> None:
        """Forget ``request_id``'s claim and stop its task (its request finished or was aborted)."""
        with self._cond:
            c = self._claims.pop(request_id, None)
            if c is None or c.outcome is not None or self._loop is None:
                return
            self.counts["cancelled"] += 1
            self._loop.call_soon_threadsafe(self._cancel_task, c.ticket)

    def wait(self, timeout_s: float, request_id: str) -> bool:
        """Block up to ``timeout_s`` until ``request_id``'s claim ended; True if it has an
        outcome not taken yet (False at the timeout, or when the request has no claim)."""
        with self._cond:
            def ended() -> bool:
                c = self._claims.get(request_id)
                return c is None or c.outcome is not None
            self._cond.wait_for(ended, timeout_s)
            c = self._claims.get(request_id)
            return c is not None and c.outcome is not None

    def close(self) -> None:
        """Cancel every claim, close the client and stop the loop thread."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            loop, thread = self._loop, self._thread
            for rid in list(self._claims):
                if self._claims[rid].outcome is None:
                    self.counts["cancelled"] += 1
            self._claims.clear()
        if loop is None or thread is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout=5)
        except Exception:  # the thread is a daemon: a stuck shutdown must not hang the engine's
            log.exception("claims: shutdown of the claim loop failed")
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)

    # ------------------------------------------------------------------ loop thread

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        """The loop, started on first use (under the lock): a prefill never dispatched
        early runs no thread."""
        if self._loop is None:
            loop = asyncio.new_event_loop()
            started = threading.Event()
            self._thread = threading.Thread(target=self._run_loop, args=(loop, started),
                                            name="pd-claims", daemon=True)
            self._thread.start()
            started.wait()
            self._loop = loop
        return self._loop

    def _run_loop(self, loop: asyncio.AbstractEventLoop, started: threading.Event) -> None:
        asyncio.set_event_loop(loop)
        # no connection cap: each claim long-polls on its own connection (module doc)
        self._client = httpx.AsyncClient(timeout=_CLIENT_TIMEOUT, limits=httpx.Limits(
            max_connections=None, max_keepalive_connections=self.max_keepalive))
        started.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    def _start(self, request_id: str, ticket: object, url: str, proxy_request_id: str, token: str) -> None:
        assert self._loop is not None
        task = self._loop.create_task(self._claim(request_id, ticket, url, proxy_request_id, token))
        self._tasks[ticket] = task
        task.add_done_callback(lambda _t: self._task_ended(ticket))

    async def _claim(self, request_id: str, ticket: object, url: str, proxy_request_id: str,
                     token: str) -> None:
        assert self._client is not None
        outcome: ClaimOutcome
        try:
            outcome = await claim(self._client, url, proxy_request_id, token, timeout_s=self.timeout_s,
                                  max_answer_bytes=self.max_answer_bytes, backoff_s=self.backoff_s,
                                  max_backoff_s=self.max_backoff_s)
        except ClaimError as exc:
            outcome = exc
        except Exception as exc:  # a bug must end the claim (its request runs), not leave it pending
            log.exception("claim of %r failed unexpectedly", proxy_request_id)
            outcome = ClaimError(f"claim failed: {type(exc).__name__}: {exc}")
        with self._cond:
            self._live.discard(ticket)  # ended; the done callback covers cancelled tasks
            call = self._end(request_id, ticket, outcome)
        if call is not None:
            call()

    def _end(self, request_id: str, ticket: object, outcome: ClaimOutcome) -> Callable[[], None] | None:
        """Record ``outcome`` if ``ticket`` is still the request's claim (caller holds the
        lock); returns the claim's ``on_end`` call, to be made outside the lock."""
        c = self._claims.get(request_id)
        if c is None or c.ticket is not ticket:
            return None  # cancelled meanwhile
        self.counts["failed" if isinstance(outcome, ClaimError) else "claimed"] += 1
        if c.on_end is not None:
            del self._claims[request_id]  # handed over: nothing left for result()
            on_end = c.on_end
            return lambda: self._call(on_end, request_id, outcome)
        c.outcome = outcome
        self._cond.notify_all()
        return None

    @staticmethod
    def _call(on_end: OnEnd, request_id: str, outcome: ClaimOutcome) -> None:
        try:
            on_end(request_id, outcome)
        except Exception:  # the loop thread serves every other claim: a failing callback is logged
            log.exception("claims: on_end of %r failed", request_id)

    def _task_ended(self, ticket: object) -> None:
        self._tasks.pop(ticket, None)
        with self._cond:
            self._live.discard(ticket)

    def _cancel_task(self, ticket: object) -> None:
        task = self._tasks.get(ticket)
        if task is not None:
            task.cancel()

    async def _shutdown(self) -> None:
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
