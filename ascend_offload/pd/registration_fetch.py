"""Prefill-first dispatch: the prefill fetches its decode's registration from the proxy.

With the proxy's ``dispatch: prefill_first`` the prefill request arrives at the
same time as the decode's, before the decode registered, carrying a
:class:`FetchTicket` instead of a registration: the metaserver URL, the
``proxy_request_id`` and a fetch token (not the decode's). Each prefill worker
rank long-polls ``GET <metaserver>?proxy_request_id=<id>`` (token in the
``X-Registration-Token`` header); the proxy answers once the decode registered,
with the :class:`DecodeRegistration` it passed through.

:class:`RegistrationFetcher` runs every fetch on one background thread's event
loop (one coroutine per request, so many long-polls cost no thread each); the
worker polls the results without blocking. Everything that arrives is a peer's
input: the answer's size is capped, it is parsed into ``DecodeRegistration``
(unknown keys, wrong types refused), and every fetch ends by its deadline
(retrying connection errors and 5xx until then); a refusal (4xx) is final.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import httpx
import msgspec

from ascend_offload.pd.registration import ROLE_FLAGS, DecodeRegistration, ParamsError

log = logging.getLogger(__name__)

TOKEN_HEADER = "X-Registration-Token"
# A registration carries at most 2^20 block ids (prefill_requests.MAX_BLOCKS) of up to
# 10 digits and a comma each, plus its fixed keys.
MAX_ANSWER_BYTES = 16 * 1024 * 1024
_Id = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]


class FetchTicket(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """What a prefill-first request's ``kv_transfer_params`` carry (besides the role flags)."""

    metaserver: Annotated[str, msgspec.Meta(min_length=1, max_length=2048)]
    proxy_request_id: _Id
    registration_token: _Id

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> FetchTicket:
        body = {k: v for k, v in params.items() if k not in ROLE_FLAGS}
        try:
            ticket = msgspec.convert(body, cls)
        except msgspec.ValidationError as exc:
            raise ParamsError(f"kv_transfer_params of a prefill-first request: {exc}") from None
        if not ticket.metaserver.startswith(("http://", "https://")):
            raise ParamsError(f"metaserver={ticket.metaserver[:80]!r}: must be an http(s) URL")
        return ticket


def is_ticket(params: Mapping[str, Any]) -> bool:
    """A prefill-first request (the proxy sent a fetch ticket, not a registration)."""
    return "metaserver" in params and "remote_host" not in params


@dataclass(frozen=True)
class FetchFailed:
    """A fetch that ended without a usable registration."""

    reason: str
    expired: bool = False  # the deadline passed (no registration arrived in time)


FetchResult = DecodeRegistration | FetchFailed


class RegistrationFetcher:
    """Long-polls registrations on one background thread; results are polled without blocking."""

    def __init__(self, *, max_answer_bytes: int = MAX_ANSWER_BYTES, backoff_s: float = 0.02,
                 max_backoff_s: float = 0.5, clock: Any = time.monotonic) -> None:
        self.max_answer_bytes = max_answer_bytes
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._clock = clock
        self._lock = threading.Lock()
        self._done: dict[str, FetchResult] = {}
        self._futures: dict[str, cf.Future[None]] = {}
        self._loop = asyncio.new_event_loop()
        self._client: httpx.AsyncClient | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="pd-fetch-registration",
                                        daemon=True)
        self._thread.start()

    def __len__(self) -> int:
        return len(self._futures)

    def submit(self, key: str, ticket: FetchTicket, deadline: float) -> None:
        """Fetch ``ticket``'s registration until ``deadline`` (on this fetcher's clock)."""
        self.cancel(key)
        self._futures[key] = asyncio.run_coroutine_threadsafe(self._fetch(key, ticket, deadline), self._loop)

    def poll(self) -> dict[str, FetchResult]:
        """Fetches that ended since the last poll: key -> registration or failure."""
        if not self._done:
            return {}
        with self._lock:
            out, self._done = self._done, {}
        for key in out:
            self._futures.pop(key, None)
        return out

    def cancel(self, key: str) -> None:
        fut = self._futures.pop(key, None)
        if fut is not None:
            fut.cancel()
        with self._lock:
            self._done.pop(key, None)

    def close(self) -> None:
        for key in list(self._futures):
            self.cancel(key)

        async def _shutdown() -> None:
            if self._client is not None:
                await self._client.aclose()

        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(_shutdown(), self._loop).result(timeout=2)
            except (cf.TimeoutError, RuntimeError):
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=2)

    # ------------------------------------------------------------------ loop thread

    async def _fetch(self, key: str, ticket: FetchTicket, deadline: float) -> None:
        try:
            result = await self._until(ticket, deadline)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug or an odd peer: this request alone fails
            result = FetchFailed(f"{type(exc).__name__}: {exc}")
        with self._lock:
            self._done[key] = result

    async def _until(self, ticket: FetchTicket, deadline: float) -> FetchResult:
        if self._client is None:
            self._client = httpx.AsyncClient(limits=httpx.Limits(max_connections=None,
                                                                 max_keepalive_connections=64))
        pause = self.backoff_s
        last = "no attempt made"
        while True:
            left = deadline - self._clock()
            if left <= 0:
                return FetchFailed(f"no registration within the deadline ({last})", expired=True)
            try:
                result = await self._attempt(ticket, left)
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                if not isinstance(result, str):
                    return result
                last = result  # a 5xx or the proxy's own wait bound: retried
            await asyncio.sleep(min(pause, max(0.0, deadline - self._clock())))
            pause = min(pause * 2, self.max_backoff_s)

    async def _attempt(self, ticket: FetchTicket, left: float) -> FetchResult | str:
        """One long-poll; a string is a retryable failure."""
        assert self._client is not None
        timeout = httpx.Timeout(left, connect=min(left, 5.0))
        async with self._client.stream(
            "GET", ticket.metaserver, params={"proxy_request_id": ticket.proxy_request_id},
            headers={TOKEN_HEADER: ticket.registration_token}, timeout=timeout,
        ) as resp:
            body = bytearray()
            async for chunk in resp.aiter_bytes():
                body += chunk
                if len(body) > self.max_answer_bytes:
                    return FetchFailed(f"metaserver answer over {self.max_answer_bytes} bytes")
            status = resp.status_code
        if status >= 500 or status in (408, 429):
            return f"HTTP {status} {bytes(body[:200])!r}"
        if status != 200:
            return FetchFailed(f"metaserver refused the fetch of {ticket.proxy_request_id!r}: "
                               f"HTTP {status} {bytes(body[:200])!r}")
        try:
            return msgspec.json.decode(body, type=DecodeRegistration)
        except msgspec.DecodeError as exc:
            return FetchFailed(f"malformed registration from the metaserver: {exc}")
