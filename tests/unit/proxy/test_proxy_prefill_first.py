"""Prefill-first dispatch: prefill and decode sent at once, the prefill fetches the registration."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from proxy_testlib import proxy_for, run, serve_app, stack, until
from test_proxy_registration import CMPL, GatedDecode, real_params

from ascend_offload.harness.fake_backends import FakeBackend, expected_texts
from proxy.config import ProxyConfig

HDR = "X-Registration-Token"


def test_flow_streamed_whole_and_fanned_out() -> None:
    """The prefill gets a fetch ticket (its own token, no registration), fetches the decode's
    registration and delivers; every answer equals decode-first's; nothing is left pending."""

    async def go() -> None:
        async with stack(dispatch="prefill_first") as s:
            body = {"prompt": "hello", "max_tokens": 8}
            status, whole = await s.post(CMPL, body)
            assert status == 200, whole
            assert whole["choices"][0]["text"] == "".join(expected_texts(body, 8))
            status, events = await s.post(CMPL, {**body, "stream": True})
            assert status == 200 and events[-1] == "[DONE]"
            status, fan = await s.post(CMPL, {"prompt": ["a", "b"], "n": 2, "max_tokens": 4, "seed": 1})
            assert status == 200 and len(fan["choices"]) == 4
            pre, dec = s.prefills[0], s.decodes[0]
            assert pre.stats["fetched"] == 6 and dec.stats["registered"] == 6
            ticket = pre.received[0]["kv_transfer_params"]
            assert set(ticket) == {"do_remote_decode", "do_remote_prefill", "metaserver",
                                   "proxy_request_id", "registration_token"}
            assert ticket["registration_token"] != dec.received[0]["kv_transfer_params"]["registration_token"]
            assert await until(lambda: len(s.server.proxy.pending) == 0)
            metrics = (await s.get("/metrics"))[1]
            assert 'metaserver_fetches_total{result="answered"} 6.0' in metrics
            assert 'metaserver_registrations_total{result="registered"} 6.0' in metrics

    run(go())


def test_fetch_boundary_and_a_request_that_ends_while_fetched() -> None:
    """Bad or missing id and token, the decode's token, a malformed registration: refused alone;
    a fetch waiting when its request ends gets 404; the right one gets the parsed params."""

    async def go() -> None:
        dec = GatedDecode()
        pre = FakeBackend("prefill")
        pre.register_timeout_s = 0.0  # the test fetches itself: the fake prefill must not
        await pre.start()
        try:
            async with serve_app(dec.app) as dport, \
                    proxy_for([pre.port], [dport], dispatch="prefill_first") as server, \
                    aiohttp.ClientSession() as http:
                answer = asyncio.get_running_loop().create_task(
                    http.post(server.url + CMPL, json={"prompt": "p", "max_tokens": 4}))
                await dec.got_request.wait()
                assert await until(lambda: len(pre.received) == 1)
                kv = dec.received[0]["kv_transfer_params"]
                meta, rid = kv["metaserver"], kv["proxy_request_id"]
                ticket = pre.received[0]["kv_transfer_params"]
                assert ticket["proxy_request_id"] == rid and ticket["metaserver"] == meta

                async def fetch(params: dict[str, str], headers: dict[str, str]) -> tuple[int, Any]:
                    async with http.get(meta, params=params, headers=headers) as r:
                        return r.status, await r.json()

                good = {"proxy_request_id": rid}
                assert (await fetch({}, {HDR: ticket["registration_token"]}))[0] == 400
                assert (await fetch(good, {}))[0] == 400
                assert (await fetch({"proxy_request_id": "x" * 600}, {HDR: "t"}))[0] == 400
                assert (await fetch({"proxy_request_id": "nope"}, {HDR: "t"}))[0] == 404
                assert (await fetch(good, {HDR: "guess"}))[0] == 403
                assert (await fetch(good, {HDR: kv["registration_token"]}))[0] == 403  # the decode's
                waiting = asyncio.get_running_loop().create_task(
                    fetch(good, {HDR: ticket["registration_token"]}))
                async with http.post(meta, json={"proxy_request_id": rid, "registration_token":
                                                 kv["registration_token"], "kv_transfer_params":
                                                 {**real_params(dport), "remote_port": "x"}}) as r:
                    assert r.status == 400  # malformed: refused, the fetch keeps waiting
                assert not waiting.done()
                async with http.post(meta, json={"proxy_request_id": rid, "registration_token":
                                                 kv["registration_token"],
                                                 "kv_transfer_params": real_params(dport)}) as r:
                    assert (r.status, await r.json()) == (200, {"status": "registered"})
                status, params = await waiting
                assert status == 200 and params == {"remote_tp_size": 1, "remote_dp_rank": 0,
                                                    "remote_block_offset": 0, "transfer_protocol": "",
                                                    **real_params(dport)}
                # a second request whose client goes away while its prefill's fetch waits
                second = asyncio.get_running_loop().create_task(
                    http.post(server.url + CMPL, json={"prompt": "q", "max_tokens": 4}))
                assert await until(lambda: len(pre.received) == 2)
                t2 = pre.received[1]["kv_transfer_params"]
                waiting = asyncio.get_running_loop().create_task(
                    fetch({"proxy_request_id": t2["proxy_request_id"]}, {HDR: t2["registration_token"]}))
                assert await until(lambda: server.proxy.pending.get(t2["proxy_request_id"]) is not None
                                   and server.proxy.pending.get(t2["proxy_request_id"]).fetchers == 1)
                second.cancel()
                await asyncio.gather(second, return_exceptions=True)
                status, body = await waiting
                assert status == 404, body
                dec.kv_ready.set()
                resp = await answer
                assert resp.status == 200
                resp.release()
                assert await until(lambda: len(server.proxy.pending) == 0)
        finally:
            await pre.stop()

    run(go())


def test_dispatch_is_validated() -> None:
    with pytest.raises(ValueError, match="dispatch must be one of"):
        ProxyConfig(prefillers=[("h", 1)], decoders=[("h", 2)], dispatch="sideways")  # type: ignore[arg-type]
