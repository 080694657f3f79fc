"""Hostile or broken peers against the proxy: fan-outs that must always end, registrations
bounded like client bodies, and decode answers the merge cannot use.

Each test bounds its own wait (``BOUND_S``) below the module's hang guard, so a hang
reads as a named timeout; none asserts a wall-clock threshold.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from proxy_testlib import parse_sse, proxy_for, raw_request, run, serve_app, stack, until

from proxy.config import ProxyConfig
from proxy.errors import ProxyError
from proxy.metaserver import Pending
from proxy.relay import SSESplitter, StreamMerger, merge_responses

CMPL = "/v1/completions"
META = "/v1/metaserver"
JSON = {"Content-Type": "application/json"}
BOUND_S = 20.0  # a hang guard per request, not a performance threshold


async def _bounded(coro: Any) -> Any:
    try:
        return await asyncio.wait_for(coro, BOUND_S)
    except TimeoutError:
        raise AssertionError(f"no answer within {BOUND_S} s: the request hangs") from None


def _openai_error(obj: Any) -> bool:
    err = obj.get("error") if isinstance(obj, dict) else None
    return isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str)


def _ends_in_openai_error(status: int, body: Any) -> bool:
    """A JSON error answer, or a stream whose last event before ``[DONE]`` is an error."""
    if status != 200:
        return _openai_error(body)
    return isinstance(body, list) and len(body) >= 2 and body[-1] == "[DONE]" and _openai_error(body[-2])


def _idle(proxy: Any) -> bool:
    return (len(proxy.pending) == 0 and proxy.admission.requests == 0 and proxy.admission.bytes == 0
            and proxy.meta_admission.requests == 0 and proxy.meta_admission.bytes == 0)


# ----------------------------------------------------------------- fan-out always ends


def test_fanout_stream_ends_when_a_sub_request_cannot_be_registered() -> None:
    """Two fan-outs can both pass the registry's room check; the later ``add`` then refuses
    one sub-request. That sub-request must end (503) instead of leaving the merge waiting."""
    async def go() -> None:
        async with stack() as st:
            proxy = st.server.proxy
            table = proxy.pending
            real_add = table.add
            calls = 0

            def add(p: Pending) -> None:
                nonlocal calls
                calls += 1
                if calls == 2:
                    raise ProxyError(503, "registry full (injected)", "overloaded", retry_after=1)
                real_add(p)

            table.add = add  # type: ignore[method-assign]
            status, body = await _bounded(st.post(CMPL, {"prompt": "p", "n": 3, "stream": True}))
            assert status == 503 and _openai_error(body), body
            assert "injected" in body["error"]["message"]
            assert await until(lambda: _idle(proxy)), proxy.admission.requests
            table.add = real_add  # type: ignore[method-assign]
            status, _ = await _bounded(st.post(CMPL, {"prompt": "p", "n": 3, "stream": True}))
            assert status == 200

    run(go())


def test_concurrent_fanouts_over_the_registry_cap_all_end() -> None:
    async def go() -> None:
        async with stack(max_pending=4) as st:
            bodies = [{"prompt": f"p{i}", "n": 3, "stream": True} for i in range(8)]
            results = await _bounded(asyncio.gather(*(st.post(CMPL, b) for b in bodies)))
            statuses = [s for s, _ in results]
            assert set(statuses) <= {200, 503}, results
            assert 200 in statuses
            assert all(_openai_error(b) for s, b in results if s == 503)
            assert await until(lambda: _idle(st.server.proxy))

    run(go())


def test_fanout_stream_has_a_deadline_when_a_sub_stream_goes_silent() -> None:
    """A sub-stream that ends without telling the merge (a bug) costs a 504 at the fan-out's
    deadline, not a client held forever."""
    async def go() -> None:
        async with stack(timeout_s=0.3, register_timeout_s=0.3, connect_timeout_s=0.1) as st:
            proxy = st.server.proxy

            async def silent(*args: Any, **kwargs: Any) -> None:
                return None

            proxy._sub_stream = silent  # type: ignore[method-assign]
            status, body = await _bounded(st.post(CMPL, {"prompt": "p", "n": 2, "stream": True}))
            assert status == 504 and _openai_error(body), body
            assert await until(lambda: _idle(proxy))

    run(go())


# ----------------------------------------------------------------- registrations


def _registration(blocks: int, block_id: int = 4_000_000_000) -> bytes:
    """The largest legitimate registration shape: every id as long as a block id gets."""
    kv = {"remote_engine_id": "e" * 64, "remote_host": "decode-0.svc.cluster.local", "remote_port": 65535,
          "remote_tp_size": 8, "remote_dp_rank": 7, "remote_request_id": "r" * 128,
          "remote_block_ids": [block_id] * blocks, "remote_block_offset": 0, "transfer_protocol": "sdma"}
    return json.dumps({"proxy_request_id": "x" * 64, "registration_token": "t" * 32,
                       "kv_transfer_params": kv}).encode()


def test_registration_cap_derives_from_model_length_and_block_size() -> None:
    from proxy.config import registration_max_bytes

    base: dict[str, Any] = {"prefillers": [("h", 1)], "decoders": [("h", 2)]}
    cfg = ProxyConfig(**base, max_model_len=1024, block_size=16)
    cap = registration_max_bytes(1024, 16)
    assert cfg.registration_max_bytes == cap
    assert len(_registration(1024 // 16)) <= cap < 8 << 20
    assert registration_max_bytes(1025, 16) > cap  # a partial block is a block
    for key, value in (("max_model_len", 0), ("block_size", 0)):
        with pytest.raises(ValueError, match=key):
            ProxyConfig(**base, **{key: value})


@pytest.mark.parametrize("separate", [False, True], ids=["public", "metaserver-port"])
def test_registration_above_the_cap_is_413_and_the_largest_legitimate_one_passes(separate: bool) -> None:
    async def go() -> None:
        extra = {"metaserver_port": 0} if separate else {}
        async with stack(max_model_len=1024, block_size=16, **extra) as st:
            port = st.server.metaserver_port if separate else st.server.port
            url = f"http://127.0.0.1:{port}{META}"
            # Under a megabyte, yet far above what 64 blocks need.
            big = _registration(1 << 12)
            assert len(big) > 2 * st.server.proxy.cfg.registration_max_bytes
            async with st.client.post(url, data=big, headers=JSON) as r:
                assert r.status == 413, await r.text()
                assert (await r.json())["error"]["type"] == "RequestTooLargeError"
            # Chunked: counted while reading (no more sent than the proxy reads, so its
            # close cannot reset the connection before the answer is read).
            hdrs = {**JSON, "Transfer-Encoding": "chunked"}
            part = big[:st.server.proxy.cfg.registration_max_bytes + 100]
            reader, writer = await raw_request(port, META, hdrs, b"%x\r\n%s\r\n" % (len(part), part))
            head = await asyncio.wait_for(reader.read(), BOUND_S)
            writer.close()
            assert head.split(b" ", 2)[1] == b"413", head[:200]
            # The largest legitimate one reaches the id check (404: no such request).
            async with st.client.post(url, data=_registration(1024 // 16), headers=JSON) as r:
                assert r.status == 404, await r.text()
            assert await until(lambda: _idle(st.server.proxy))

    run(go())


def test_registrations_are_admitted_and_counted() -> None:
    """Uploads to /v1/metaserver hold memory like client bodies: they are counted and capped
    (503 with Retry-After, which a decode's registration retries), and visible in /health."""
    async def go() -> None:
        async with stack(max_pending=1, body_timeout_s=600) as st:
            proxy = st.server.proxy
            # One registration holds the only slot (its body never arrives).
            _, holder = await raw_request(st.server.port, META, {**JSON, "Content-Length": "200"})
            assert await until(lambda: proxy.meta_admission.requests == 1)
            _, health = await st.get("/health")
            h = json.loads(health)
            assert h["inflight_registrations"] == 1 and h["inflight_registration_bytes"] == 200, h
            assert h["inflight_requests"] == 0  # client admission untouched
            async with st.client.post(st.url + META, data=_registration(4), headers=JSON) as r:
                assert r.status == 503 and r.headers["Retry-After"] == "1", await r.text()
                assert _openai_error(await r.json())
            holder.close()
            assert await until(lambda: proxy.meta_admission.requests == 0 and proxy.meta_admission.bytes == 0)
            async with st.client.post(st.url + META, data=_registration(4), headers=JSON) as r:
                assert r.status == 404
            status, _ = await st.post(CMPL, {"prompt": "still serving"})
            assert status == 200

    run(go())


# ----------------------------------------------------------------- malformed decode output


class OddDecode:
    """A decode (it never registers) whose answers the merge cannot use; ``mode`` says how."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.closed = asyncio.Event()
        self.app = web.Application()
        self.app.router.add_post(CMPL, self.completions)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        good = {"id": "x", "choices": [{"index": 0, "text": "ok"}]}
        bad = {"id": "x", "choices": [{"index": [1], "text": "bad"}]}
        try:
            if not body.get("stream"):
                return web.json_response(bad if self.mode == "index" else good)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            if self.mode == "endless":  # one event that never ends
                await resp.write(b'data: {"id": "x", "choices": [{"index": 0, "text": "')
                while True:
                    await resp.write(b"y" * 65536)
            await resp.write(b"data: " + json.dumps(good).encode() + b"\n\n")
            await resp.write(b"data: " + json.dumps(bad).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            self.closed.set()


async def _post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with http.post(url + CMPL, json=body) as r:
        text = await r.text()
        if r.headers.get("Content-Type", "").startswith("text/event-stream"):
            return r.status, parse_sse(text)
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, text


def test_fanout_stream_event_that_never_ends_fails_that_request() -> None:
    async def go() -> None:
        dec = OddDecode("endless")
        async with serve_app(dec.app) as dport, proxy_for([1], [dport], max_answer_mb=1) as server, \
                aiohttp.ClientSession() as http:
            status, body = await _bounded(_post(http, server.url, {"prompt": "p", "n": 2, "stream": True}))
            assert _ends_in_openai_error(status, body), (status, body)
            assert "above the limit 1048576 bytes" in json.dumps(body)
            await asyncio.wait_for(dec.closed.wait(), BOUND_S)  # the decode's request was dropped
            assert await until(lambda: _idle(server.proxy))

    run(go())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_fanout_choice_index_that_is_not_an_integer_is_an_openai_error(stream: bool) -> None:
    async def go() -> None:
        dec = OddDecode("index")
        async with serve_app(dec.app) as dport, proxy_for([1], [dport]) as server, \
                aiohttp.ClientSession() as http:
            status, body = await _bounded(_post(http, server.url, {"prompt": "p", "n": 2, "stream": stream}))
            assert _ends_in_openai_error(status, body), (status, body)
            assert status == 502 or stream  # a stream's error is an event once output started
            assert "index" in json.dumps(body)
            assert await until(lambda: _idle(server.proxy))
            metrics = server.proxy.metrics.render().decode()
            assert f'ascend_offload_proxy_requests_total{{endpoint="{CMPL}",status="500"}}' not in metrics

    run(go())


# ----------------------------------------------------------------- relay pieces


def test_splitter_refuses_an_event_above_its_limit_and_keeps_boundaries() -> None:
    sp = SSESplitter(max_event=1000)
    assert sp.feed(b"data: 1\n") == []
    assert sp.feed(b"\ndata: 2\r") == [b"1"]
    assert sp.feed(b"\n\r\n") == [b"2"]
    for _ in range(10):
        sp.feed(b"x" * 90)  # 900 bytes pending: under the limit
    with pytest.raises(ValueError, match="1000 bytes"):
        sp.feed(b"x" * 200)
    # Many complete events in one chunk are not one big event.
    sp = SSESplitter(max_event=100)
    assert len(sp.feed(b"data: 12345\n\n" * 200)) == 200


@pytest.mark.parametrize("choice", [{"index": [1]}, {"index": "1"}, {"index": True}, {"index": {}}])
def test_merge_refuses_a_choice_index_that_is_not_an_integer(choice: dict[str, Any]) -> None:
    raw = json.dumps({"id": "x", "choices": [choice]}).encode()
    with pytest.raises(ValueError, match="index"):
        StreamMerger("r").rewrite(raw, 0, True)
    with pytest.raises(ValueError, match="index"):
        merge_responses([(0, True, raw)], "r")


@pytest.mark.parametrize("bad", [{"choices": 5}, {"choices": "abc"}, {"choices": [], "usage": {"prompt_tokens": [1]}},
                                 {"choices": [], "usage": {"completion_tokens": "x"}}])
def test_merge_refuses_off_schema_choices_and_usage(bad: dict[str, Any]) -> None:
    raw = json.dumps({"id": "x", **bad}).encode()
    with pytest.raises(ValueError):
        StreamMerger("r").rewrite(raw, 0, True)
    with pytest.raises(ValueError):
        merge_responses([(0, True, raw)], "r")
