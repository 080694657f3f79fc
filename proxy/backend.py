"""Small pieces of the proxy's backend I/O: an open decode response, the headers of
backend requests, the trace hook that marks a prefill as dispatched, JSON errors."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web

from proxy.balancer import Balancer, Instance
from proxy.errors import ProxyError
from proxy.metaserver import Pending

JSON_TYPE = "application/json"
JSON_HEADERS = {"Content-Type": JSON_TYPE}
# Nothing was sent: safe to try the next instance.
CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)


def uncancel() -> None:
    """Undo a cancellation we delivered ourselves (Pending.fail) so later awaits work."""
    task = asyncio.current_task()
    undo = getattr(task, "uncancel", None)
    if undo is not None:
        undo()


def snippet(data: bytes, limit: int = 300) -> str:
    text = data[:limit].decode("utf-8", "replace")
    return text + ("..." if len(data) > limit else "")


def backend_headers(p: Pending) -> dict[str, str]:
    """Headers of both backend requests of ``p``.

    vLLM takes ``X-Request-Id`` as its request id, so the decode's and the
    prefill's logs carry the proxy_request_id; the client's Authorization is
    passed on so backends started with ``--api-key`` work behind the proxy.
    """
    headers = {"Content-Type": JSON_TYPE, "X-Request-Id": p.id}
    if p.auth is not None:
        headers["Authorization"] = p.auth
    return headers


def json_error(err: ProxyError) -> web.Response:
    """The OpenAI-style answer of ``err``, with ``Retry-After`` / connection close when it says so."""
    headers = JSON_HEADERS
    if err.retry_after is not None:
        headers = {**JSON_HEADERS, "Retry-After": str(err.retry_after)}
    resp = web.Response(status=err.status, body=err.body(), headers=headers)
    if err.close:
        resp.force_close()
    return resp


class DecodeResponse:
    """An open decode response and the instance it came from."""

    __slots__ = ("ctype", "data", "inst", "resp")

    def __init__(self, resp: aiohttp.ClientResponse, inst: Instance) -> None:
        self.resp = resp
        self.inst = inst
        self.data = b""
        self.ctype = resp.headers.get("Content-Type", JSON_TYPE)

    @property
    def status(self) -> int:
        return self.resp.status

    def close(self, ok: bool) -> None:
        """Give the connection back (ok) or drop it, which makes vLLM abort the request."""
        if ok:
            self.resp.release()
        else:
            self.resp.close()
        Balancer.release(self.inst)


async def on_headers_sent(
    session: aiohttp.ClientSession, ctx: Any, params: aiohttp.TraceRequestHeadersSentParams
) -> None:
    p = ctx.trace_request_ctx
    if isinstance(p, Pending) and p.dispatched is not None and not p.dispatched.done():
        p.dispatched.set_result(True)
