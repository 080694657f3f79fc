"""What one client may cost the proxy: deadlines, caps, 429/503 with Retry-After, port checks.

No wall-clock thresholds: deadlines are configured small and each test
asserts the error raised or the connection closed (reading to EOF), with the
module-wide hang guard as the only clock.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from proxy_testlib import proxy_for, raw_request, run, serve_app, stack, until

from proxy.cli import main
from proxy.config import ProxyConfig

CMPL = "/v1/completions"
JSON = {"Content-Type": "application/json"}


async def _answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """Read one HTTP answer up to EOF: the proxy must close the connection after it."""
    raw = await reader.read()  # returns at EOF only
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split()[1]), headers, body


@pytest.mark.parametrize("path", [CMPL, "/v1/metaserver"])
@pytest.mark.parametrize("chunked", [False, True])
def test_stalled_body_gets_408_and_the_connection_closed(path: str, chunked: bool) -> None:
    async def go() -> None:
        async with stack(body_timeout_s=0.2) as st:
            if chunked:
                hdrs, part = {**JSON, "Transfer-Encoding": "chunked"}, b"5\r\n{\"pro\r\n"
            else:
                hdrs, part = {**JSON, "Content-Length": "100"}, b'{"prompt": "'
            reader, writer = await raw_request(st.server.port, path, hdrs, part)
            status, headers, body = await _answer(reader)  # EOF: closed by the proxy
            writer.close()
            assert status == 408 and headers.get("connection") == "close"
            assert json.loads(body)["error"]["type"] == "RequestTimeoutError"
            assert st.server.proxy.admission.requests == 0 and st.server.proxy.admission.bytes == 0
            assert st.decodes[0].received == []

    run(go())


def test_body_above_the_limit_is_413_with_its_openai_type() -> None:
    async def go() -> None:
        async with stack(max_body_mb=1) as st:
            big = json.dumps({"prompt": "x" * (1 << 20)}).encode()
            status, body = await st.post(CMPL, None, raw=big)
            assert status == 413 and body["error"]["type"] == "RequestTooLargeError"
            # Chunked (no Content-Length): counted while reading.
            hdrs = {**JSON, "Transfer-Encoding": "chunked"}
            chunk = b"%x\r\n%s\r\n" % (len(big), big)
            reader, writer = await raw_request(st.server.port, CMPL, hdrs, chunk + b"0\r\n\r\n")
            status, _, raw = await _answer(reader)
            writer.close()
            assert status == 413 and json.loads(raw)["error"]["type"] == "RequestTooLargeError"
            status, _ = await st.post(CMPL, {"prompt": "small"})
            assert status == 200

    run(go())


def test_concurrency_cap_answers_429_with_retry_after() -> None:
    async def go() -> None:
        async with stack(max_inflight=1, body_timeout_s=600) as st:
            admission = st.server.proxy.admission
            # One request holds the only slot (its body never arrives).
            _, holder = await raw_request(st.server.port, CMPL, {**JSON, "Content-Length": "50"})
            assert await until(lambda: admission.requests == 1)
            async with st.client.post(st.url + CMPL, json={"prompt": "p"}) as r:
                assert r.status == 429 and r.headers["Retry-After"] == "1"
                assert (await r.json())["error"]["type"] == "RateLimitError"
            _, health = await st.get("/health")
            assert json.loads(health)["inflight_requests"] == 1
            holder.close()
            assert await until(lambda: admission.requests == 0)
            status, _ = await st.post(CMPL, {"prompt": "p"})
            assert status == 200

    run(go())


def test_body_memory_cap_answers_503_with_retry_after() -> None:
    async def go() -> None:
        async with stack(max_body_mb=1, max_inflight_mb=1, body_timeout_s=600) as st:
            admission = st.server.proxy.admission
            _, holder = await raw_request(st.server.port, CMPL, {**JSON, "Content-Length": str(1 << 20)})
            assert await until(lambda: admission.bytes == 1 << 20)
            async def chunked() -> AsyncIterator[bytes]:
                yield b'{"prompt": "p"}'

            for data in (b'{"prompt": "p"}', chunked()):  # a chunked body reserves max_body_mb
                async with st.client.post(st.url + CMPL, data=data, headers=JSON) as r:
                    assert r.status == 503 and r.headers["Retry-After"] == "1"
                    assert (await r.json())["error"]["type"] == "ServiceUnavailableError"
            holder.close()
            assert await until(lambda: admission.bytes == 0)
            status, _ = await st.post(CMPL, {"prompt": "p"})
            assert status == 200

    run(go())


class EndlessDecode:
    """A decode that streams (or answers with) far more than any socket buffer holds."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()
        self.app = web.Application()
        self.app.router.add_post(CMPL, self.completions)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        event = b"data: " + json.dumps({"id": "x", "choices": [{"index": 0, "text": "y" * 60000}]}).encode()
        try:
            if body.get("stream"):
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                while True:
                    await resp.write(event + b"\n\n")
            big = json.dumps({"id": "x", "choices": [{"index": 0, "text": "y" * (64 << 20)}]}).encode()
            return web.Response(body=big, content_type="application/json")
        finally:
            self.closed.set()


def _non_reading_client(port: int, body: dict[str, Any]) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    s.sendall(f"POST {CMPL} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s  # and never read from


@pytest.mark.parametrize("body", [
    {"prompt": "p", "stream": True},
    {"prompt": "p", "stream": True, "n": 2},
    {"prompt": "p"},
], ids=["stream", "fanout-stream", "whole"])
def test_client_that_stops_reading_is_cut_at_the_write_deadline(body: dict[str, Any]) -> None:
    async def go() -> None:
        dec = EndlessDecode()
        async with serve_app(dec.app) as dport, proxy_for([1], [dport], write_timeout_s=0.3) as server:
            proxy = server.proxy
            s = _non_reading_client(server.port, body)
            try:
                assert await until(lambda: proxy.admission.requests == 1)
                # The proxy gives up on the client, releases the request and drops the decode's.
                assert await until(lambda: proxy.admission.requests == 0, timeout=30)
                assert await until(lambda: len(proxy.pending) == 0)
                if body.get("stream"):
                    await asyncio.wait_for(dec.closed.wait(), 30)
                metrics = proxy.metrics.render().decode()
                assert f'ascend_offload_proxy_requests_total{{endpoint="{CMPL}",status="499"}} 1.0' in metrics
            finally:
                s.close()

    run(go())


def test_decode_answer_above_the_limit_is_502() -> None:
    async def go() -> None:
        dec = EndlessDecode()
        async with serve_app(dec.app) as dport, proxy_for([1], [dport], max_answer_mb=1) as server, \
                aiohttp.ClientSession() as http:
            async with http.post(server.url + CMPL, json={"prompt": "p", "n": 2}) as r:
                assert r.status == 502
                body = await r.json()
            assert "limit 1 MiB" in body["error"]["message"] and body["error"]["type"] == "BadGatewayError"
            assert server.proxy.admission.requests == 0 and len(server.proxy.pending) == 0

    run(go())


def test_tight_fanout_queue_still_merges_every_chunk() -> None:
    async def go() -> None:
        async with stack(fanout_queue=1, decode_kw={"chunks": 40}) as st:
            status, events = await st.post(CMPL, {"prompt": "p", "n": 4, "stream": True, "max_tokens": 40})
            assert status == 200 and events[-1] == "[DONE]"
            per_index: dict[int, int] = {}
            for ev in events[:-1]:
                for c in ev["choices"]:
                    per_index[c["index"]] = per_index.get(c["index"], 0) + 1
            assert per_index == {0: 40, 1: 40, 2: 40, 3: 40}

    run(go())


def test_port_is_validated_not_wrapped() -> None:
    base: dict[str, Any] = {"prefillers": [("h", 1)], "decoders": [("h", 2)]}
    for key, value in (("port", 70000), ("port", -1), ("metaserver_port", 65536)):
        with pytest.raises(ValueError, match=key):
            ProxyConfig(**base, **{key: value})
    for key, value in (("timeout_s", float("inf")), ("body_timeout_s", 1e300), ("write_timeout_s", 0)):
        with pytest.raises(ValueError, match=key):
            ProxyConfig(**base, **{key: value})
    with pytest.raises(ValueError, match="max_inflight_mb"):
        ProxyConfig(**base, max_body_mb=64, max_inflight_mb=10)
    assert ProxyConfig(**base, port=0, metaserver_port=65535).port == 0


def test_cli_refuses_port_70000(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--port", "70000", "--prefiller-ports", "1", "--decoder-ports", "2"]) == 2
    assert "port must be an integer in 0..65535, got 70000" in capsys.readouterr().err


def test_cli_passes_the_limits() -> None:
    from proxy.cli import build_parser, config_from_args

    cfg = config_from_args(build_parser().parse_args([
        "--prefiller-ports", "1", "--decoder-ports", "2", "--metaserver-port", "9000",
        "--metaserver-host", "10.0.0.1", "--body-timeout-s", "3", "--write-timeout-s", "4",
        "--max-inflight", "5", "--max-inflight-mb", "600", "--max-pending", "7", "--fanout-queue", "8",
        "--max-answer-mb", "9", "--max-model-len", "4096", "--block-size", "32",
    ]))
    assert (cfg.metaserver_port, cfg.metaserver_host, cfg.body_timeout_s, cfg.write_timeout_s) == (
        9000, "10.0.0.1", 3.0, 4.0)
    assert (cfg.max_inflight, cfg.max_inflight_mb, cfg.max_pending, cfg.fanout_queue, cfg.max_answer_mb) == (
        5, 600, 7, 8, 9)
    assert (cfg.max_model_len, cfg.block_size) == (4096, 32)
    assert cfg.registration_max_bytes == 16 * 1024 + 128 * 12

