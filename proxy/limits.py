"""What one client may cost the proxy: admission, body-read and write deadlines.

Why: every peer is untrusted. Without these a client that uploads one byte a
minute, or stops reading its answer, holds a connection (and for a stream,
both backends' requests) forever, and a burst of large requests grows memory
without a bound. Each limit turns into an answer the client can act on:
408 (body too slow), 413 (body too large), 429 / 503 with ``Retry-After``
(too many requests / too much body memory held), or a closed connection (a
client that does not read its answer).
"""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from proxy.config import MB
from proxy.errors import AscendOffloadProxyError, ProxyError

__all__ = ["MB", "Admission", "ClientStalled", "finish_within", "read_answer", "read_body", "respond",
           "write_within"]


def _size(n: int) -> str:
    return f"{n // MB} MiB" if n >= MB else f"{n} bytes"


class ClientStalled(AscendOffloadProxyError):
    """A client did not take a write within the write deadline; its connection is closed."""


class Admission:
    """Counts uploads and the body bytes they hold; refuses what would exceed a cap.

    One instance for client requests (429 when too many: the client backs off) and one
    for registrations (503 when too many: a decode retries 5xx with backoff, and a flood
    of registrations cannot take the client requests' budget, nor the reverse).
    """

    def __init__(self, max_requests: int, max_bytes: int, max_body: int, *, what: str = "request",
                 busy_status: int = 429) -> None:
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self.max_body = max_body
        self.what = what
        self.busy_status = busy_status
        self.requests = 0
        self.bytes = 0

    def enter(self, content_length: int | None) -> int:
        """Admit one upload; returns the bytes reserved for its body (give them to ``leave``).

        A body without Content-Length (chunked) reserves the largest size
        allowed, because its size is only known once it is in memory.
        """
        if content_length is not None and content_length > self.max_body:
            raise ProxyError(
                413,
                f"invalid request: body of {content_length} bytes is above the proxy limit "
                f"{_size(self.max_body)}",
                "body_too_large",
                close=True,
            )
        if self.requests >= self.max_requests:
            raise ProxyError(
                self.busy_status,
                f"the proxy is serving its limit of {self.max_requests} {self.what}s; retry later",
                "overloaded",
                retry_after=1,
                close=True,
            )
        need = self.max_body if content_length is None else content_length
        if self.bytes + need > self.max_bytes:
            raise ProxyError(
                503,
                f"the proxy holds {_size(self.bytes)} of {self.what} bodies (limit "
                f"{_size(self.max_bytes)}); retry later",
                "overloaded",
                retry_after=1,
                close=True,
            )
        self.requests += 1
        self.bytes += need
        return need

    def leave(self, reserved: int) -> None:
        self.requests -= 1
        self.bytes -= reserved


async def read_body(request: web.Request, limit: int, timeout_s: float) -> bytes:
    """The whole request body, at most ``limit`` bytes, delivered within ``timeout_s``.

    Read from the stream directly so the cap holds for chunked bodies too and
    a stalled upload ends at our deadline (aiohttp's own read has none).
    """
    if request.content_length is not None and request.content_length > limit:
        raise ProxyError(
            413,
            f"invalid request: body of {request.content_length} bytes is above the limit "
            f"{limit} bytes",
            "body_too_large",
            close=True,
        )
    parts: list[bytes] = []
    size = 0
    content = request.content
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                chunk = await content.readany()
                if not chunk:
                    break
                size += len(chunk)
                if size > limit:
                    raise ProxyError(
                        413, f"invalid request: body is above the limit {limit} bytes", "body_too_large",
                        close=True,
                    )
                parts.append(chunk)
    except TimeoutError:
        raise ProxyError(
            408, f"request body not received within {timeout_s:g} s", "body_timeout", close=True
        ) from None
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def read_answer(content: aiohttp.StreamReader, limit: int, name: str) -> bytes:
    """A backend's whole (non-streamed) answer, refused with 502 above ``limit`` bytes.

    A fan-out holds every sub-request's answer until all are in; unbounded
    reads would let one broken backend exhaust the proxy's memory.
    """
    parts: list[bytes] = []
    size = 0
    while chunk := await content.readany():
        size += len(chunk)
        if size > limit:
            raise ProxyError(
                502, f"decode {name} answered more than the limit {limit // MB} MiB", "decode_too_large"
            )
        parts.append(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def write_within(request: web.Request, out: web.StreamResponse, data: bytes, timeout_s: float) -> None:
    """``out.write(data)``, or close the client's connection if it is not taken within ``timeout_s``.

    aiohttp's write waits (without a deadline) for the client to drain its
    buffer; a client that stops reading would hold the request forever.
    """
    try:
        async with asyncio.timeout(timeout_s):
            await out.write(data)
    except TimeoutError:
        if request.transport is not None:
            request.transport.abort()
        raise ClientStalled(f"client did not read its answer within {timeout_s:g} s") from None


async def finish_within(request: web.Request, out: web.StreamResponse, timeout_s: float) -> None:
    """``out.write_eof()`` under the write deadline (it flushes, so it can wait too)."""
    try:
        async with asyncio.timeout(timeout_s):
            await out.write_eof()
    except TimeoutError:
        if request.transport is not None:
            request.transport.abort()
        raise ClientStalled(f"client did not read its answer within {timeout_s:g} s") from None


async def respond(
    request: web.Request, status: int, body: bytes, content_type: str, timeout_s: float
) -> web.StreamResponse:
    """A whole answer sent under the write deadline (a plain ``web.Response`` has none)."""
    out = web.StreamResponse(status=status, headers={"Content-Type": content_type})
    out.content_length = len(body)
    await out.prepare(request)
    await write_within(request, out, body, timeout_s)
    await finish_within(request, out, timeout_s)
    return out
