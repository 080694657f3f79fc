"""Metaserver registration: the per-request token, the typed params, the registry's bound, its own listener."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from aiohttp import web
from proxy_testlib import proxy_for, run, serve_app, stack, until

from ascend_offload.harness.fake_backends import FakeBackend

CMPL = "/v1/completions"


class GatedDecode:
    """A decode that records its request, then answers only once the prefill delivered KV.

    The test itself registers (as the decode's connector would), so it can
    interleave a third party's attempts with the real registration.
    """

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        self.got_request = asyncio.Event()
        self.kv_ready = asyncio.Event()
        self.app = web.Application()
        self.app.router.add_post(CMPL, self.completions)
        self.app.router.add_post("/_fake/kv_ready", self.ready)

    async def completions(self, request: web.Request) -> web.Response:
        self.received.append(await request.json())
        self.got_request.set()
        await self.kv_ready.wait()
        return web.json_response({"id": "cmpl-x", "object": "text_completion", "model": "m",
                                  "choices": [{"index": 0, "text": "real answer", "finish_reason": "length"}]})

    async def ready(self, request: web.Request) -> web.Response:
        self.kv_ready.set()
        return web.json_response({})


def real_params(decode_port: int) -> dict[str, Any]:
    return {"remote_engine_id": "D0", "remote_host": "127.0.0.1", "remote_port": decode_port,
            "remote_request_id": "dec-1", "remote_block_ids": [4, 5, 6]}


def test_hijack_with_a_guessed_id_is_refused_and_the_real_registration_wins() -> None:
    """A third party that learned the request id cannot register it; the prefill gets the decode's params."""

    async def go() -> None:
        dec = GatedDecode()
        pre = FakeBackend("prefill")
        await pre.start()
        try:
            async with serve_app(dec.app) as dport, proxy_for([pre.port], [dport]) as server, \
                    aiohttp.ClientSession() as http:

                async def client() -> tuple[int, Any]:
                    async with http.post(server.url + CMPL, json={"prompt": "p", "max_tokens": 4}) as r:
                        return r.status, await r.json()

                answer = asyncio.get_running_loop().create_task(client())
                await dec.got_request.wait()
                kv = dec.received[0]["kv_transfer_params"]
                meta, rid = kv["metaserver"], kv["proxy_request_id"]

                async def register(msg: dict[str, Any]) -> tuple[int, Any]:
                    async with http.post(meta, json=msg) as r:
                        return r.status, await r.json()

                hijack = {"do_remote_decode": False, "remote_host": "203.0.113.9", "remote_port": "not-a-port"}
                # The attack: a third party registers the leaked id (it has no token).
                status, body = await register({"proxy_request_id": rid, "kv_transfer_params": hijack})
                assert status == 400 and "registration_token" in body["error"]["message"], (status, body)
                token = kv["registration_token"]
                assert len(token) >= 32  # token_urlsafe(24): 192 random bits
                # A guessed token, with off-schema and with well-formed params: 403 either way.
                for params in (hijack, {**real_params(dport), "remote_host": "203.0.113.9"}):
                    status, body = await register(
                        {"proxy_request_id": rid, "registration_token": "guess-" + token[6:],
                         "kv_transfer_params": params})
                    assert status == 403 and body["error"]["type"] == "PermissionDeniedError", body
                # Even the right token cannot set the proxy's own keys.
                status, body = await register({"proxy_request_id": rid, "registration_token": token,
                                               "kv_transfer_params": {**real_params(dport),
                                                                      "do_remote_decode": False}})
                assert status == 400 and "do_remote_decode" in body["error"]["message"]
                assert pre.received == []  # nothing was dispatched so far
                # The real decode registers and its request is served.
                status, body = await register({"proxy_request_id": rid, "registration_token": token,
                                               "kv_transfer_params": real_params(dport)})
                assert (status, body) == (200, {"status": "dispatched"})
                status, body = await answer
                assert status == 200 and body["choices"][0]["text"] == "real answer"
                (sent,) = pre.received
                assert sent["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                                      "remote_tp_size": 1, "remote_dp_rank": 0,
                                                      "remote_block_offset": 0, "transfer_protocol": "",
                                                      **real_params(dport)}
                metrics = await (await http.get(server.url + "/metrics")).text()
                assert 'registrations_total{result="forbidden"} 2.0' in metrics
                assert 'registrations_total{result="dispatched"} 1.0' in metrics
                assert len(server.proxy.pending) == 0
        finally:
            await pre.stop()

    run(go())


def test_each_sub_request_gets_its_own_token() -> None:
    async def go() -> None:
        async with stack() as st:
            status, body = await st.post(CMPL, {"prompt": ["a", "b"], "n": 2, "max_tokens": 2})
            assert status == 200, body
            kvs = [r["kv_transfer_params"] for r in st.decodes[0].received]
            assert len({kv["registration_token"] for kv in kvs}) == len({kv["proxy_request_id"] for kv in kvs}) == 4
            assert st.decodes[0].stats["registered"] == 4
            # The prefill never sees a token.
            assert all("registration_token" not in r["kv_transfer_params"] for r in st.prefills[0].received)

    run(go())


def test_pending_registry_is_capped_with_503() -> None:
    async def go() -> None:
        async with stack(max_pending=2, decode_kw={"fault": "hang"}) as st:
            proxy = st.server.proxy
            first = asyncio.get_running_loop().create_task(st.post(CMPL, {"prompt": "a"}))
            assert await until(lambda: len(proxy.pending) == 1)
            # A fan-out that would not fit is refused up front, before any backend sees it.
            async with st.client.post(st.url + CMPL, json={"prompt": "b", "n": 2}) as r:
                assert r.status == 503 and r.headers["Retry-After"] == "1"
                body = await r.json()
            assert body["error"]["type"] == "ServiceUnavailableError" and "limit 2" in body["error"]["message"]
            assert len(st.decodes[0].received) == 1
            first.cancel()
            assert await until(lambda: len(proxy.pending) == 0)

    run(go())


def test_unregistered_entries_expire_at_their_deadline() -> None:
    async def go() -> None:
        async with stack(register_timeout_s=0.2, decode_kw={"fault": "hang"}) as st:
            status, body = await st.post(CMPL, {"prompt": ["a", "b", "c"]})
            assert status == 504 and "register" in body["error"]["message"]
            assert len(st.server.proxy.pending) == 0

    run(go())


def test_metaserver_on_its_own_listener() -> None:
    async def go() -> None:
        async with stack(metaserver_port=0, metaserver_host="127.0.0.1") as st:
            server = st.server
            assert server.metaserver_port not in (None, server.port)
            assert server.proxy.metaserver_url == f"http://127.0.0.1:{server.metaserver_port}/v1/metaserver"
            status, body = await st.post(CMPL, {"prompt": "hello", "stream": True})
            assert status == 200 and body[-1] == "[DONE]"
            assert st.decodes[0].received[0]["kv_transfer_params"]["metaserver"] == server.proxy.metaserver_url
            assert st.decodes[0].stats["registered"] == 1
            # Not reachable on the public listener any more; clients' routes not on the internal one.
            msg = {"proxy_request_id": "x", "registration_token": "t", "kv_transfer_params": {}}
            status, _ = await st.post("/v1/metaserver", msg)
            assert status in (404, 405)
            async with st.client.post(f"http://127.0.0.1:{server.metaserver_port}{CMPL}",
                                      data=json.dumps({"prompt": "x"})) as r:
                assert r.status in (404, 405)

    run(go())
