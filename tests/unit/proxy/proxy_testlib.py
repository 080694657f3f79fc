"""Helpers for proxy tests: fake backends + a proxy on free loopback ports, in one event loop."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from ascend_offload.harness.fake_backends import FakeBackend
from proxy.config import ProxyConfig
from proxy.server import ProxyServer, bound_port

HANG_GUARD_S = 60.0  # a deadlock guard for each test, not a performance threshold


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, HANG_GUARD_S))


def dead_port() -> int:
    """A loopback port nothing listens on (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Stack:
    server: ProxyServer
    prefills: list[FakeBackend]
    decodes: list[FakeBackend]
    client: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return self.server.url

    async def post(
        self, path: str, body: Any, raw: bytes | None = None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        data = raw if raw is not None else json.dumps(body).encode()
        async with self.client.post(
            self.url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}
        ) as r:
            text = await r.text()
            ctype = r.headers.get("Content-Type", "")
        if ctype.startswith("text/event-stream"):
            return r.status, parse_sse(text)
        try:
            return r.status, json.loads(text)
        except json.JSONDecodeError:
            return r.status, text

    async def get(self, path: str) -> tuple[int, str]:
        async with self.client.get(self.url + path) as r:
            return r.status, await r.text()


def parse_sse(text: str) -> list[Any]:
    """SSE payloads in order; '[DONE]' kept as the string."""
    out: list[Any] = []
    for event in text.split("\n\n"):
        for line in event.split("\n"):
            if line.startswith("data: "):
                payload = line[6:]
                out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


@asynccontextmanager
async def stack(
    n_prefill: int = 1,
    n_decode: int = 1,
    prefill_kw: dict[str, Any] | None = None,
    decode_kw: dict[str, Any] | None = None,
    dead_prefills: int = 0,
    dead_decodes: int = 0,
    **cfg: Any,
) -> AsyncIterator[Stack]:
    prefills = [FakeBackend("prefill", **(prefill_kw or {})) for _ in range(n_prefill)]
    dkw = {"wait_kv": True, **(decode_kw or {})}
    decodes = [FakeBackend("decode", **dkw) for _ in range(n_decode)]
    for b in (*prefills, *decodes):
        await b.start()
    server = ProxyServer(
        ProxyConfig(
            prefillers=[("127.0.0.1", b.port) for b in prefills]
            + [("127.0.0.1", dead_port()) for _ in range(dead_prefills)],
            decoders=[("127.0.0.1", b.port) for b in decodes]
            + [("127.0.0.1", dead_port()) for _ in range(dead_decodes)],
            port=0,
            **cfg,
        )
    )
    await server.start()
    try:
        async with aiohttp.ClientSession() as client:
            yield Stack(server, prefills, decodes, client)
    finally:
        await server.stop()
        for b in (*prefills, *decodes):
            await b.stop()


async def until(pred: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Poll ``pred`` until true; False after ``timeout`` (the assertion names what failed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        await asyncio.sleep(0.01)
    return pred()


@asynccontextmanager
async def serve_app(app: web.Application) -> AsyncIterator[int]:
    """Run a hand-written backend on a free loopback port; yields the port."""
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield bound_port(site)
    finally:
        await runner.cleanup()


@asynccontextmanager
async def proxy_for(prefill_ports: list[int], decode_ports: list[int], **cfg: Any) -> AsyncIterator[ProxyServer]:
    """A proxy in front of the given backends (port 0: a free one)."""
    server = ProxyServer(
        ProxyConfig(
            prefillers=[("127.0.0.1", p) for p in prefill_ports],
            decoders=[("127.0.0.1", p) for p in decode_ports],
            port=0,
            **cfg,
        )
    )
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def raw_request(
    port: int, path: str, headers: dict[str, str], body: bytes = b""
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Open a connection and send a request head (and ``body``) as is, e.g. to stall its upload."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    writer.write(head.encode() + body)
    await writer.drain()
    return reader, writer
