"""Early prefill dispatch (``prefill_dispatch="early"``): the prefill leaves with the decode
request and claims the decode's registration at ``/v1/metaserver/claim``. Against fake
backends over real loopback HTTP (one process, one loop)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from proxy_testlib import run, stack, until

from ascend_offload.harness.fake_backends import expected_texts
from proxy.bodies import COMPLETIONS, SharedBody
from proxy.config import ProxyConfig
from proxy.metaserver import Pending

CMPL = "/v1/completions"
CLAIM = "/v1/metaserver/claim"
META = "/v1/metaserver"


def _reg(rid: str, token: str) -> dict[str, Any]:
    kv = {"remote_host": "127.0.0.1", "remote_port": 1, "remote_request_id": "r", "remote_block_ids": [0, 4]}
    return {"proxy_request_id": rid, "registration_token": token, "kv_transfer_params": kv}


def _idle(st: Any) -> bool:
    proxy = st.server.proxy
    return (len(proxy.pending) == 0 and proxy.admission.requests == 0 and proxy.meta_admission.requests == 0
            and proxy.claim_admission.requests == 0 and proxy.claim_admission.bytes == 0)


def test_config_and_cli_refuse_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match="prefill_dispatch must be one of registered, early, got 'soon'"):
        ProxyConfig(prefillers=[("127.0.0.1", 1)], decoders=[("127.0.0.1", 2)], prefill_dispatch="soon")


@pytest.mark.parametrize("stream", [False, True])
def test_prefill_leaves_with_the_decode_request_and_claims_the_registration(stream: bool) -> None:
    async def go() -> None:
        async with stack(prefill_dispatch="early") as st:
            status, body = await st.post(CMPL, {"prompt": "hello there", "max_tokens": 8, "stream": stream})
            assert status == 200, body
            (dec,) = st.decodes
            (pre,) = st.prefills
            kv = dec.received[0]["kv_transfer_params"]
            got = pre.received[0]
            assert got["max_tokens"] == 1 and got["stream"] is False
            # the prefill carries a claim, not the registration: it was sent before the decode registered
            pkv = got["kv_transfer_params"]
            assert pkv["do_remote_decode"] is True and pkv["do_remote_prefill"] is False
            assert pkv["claim_url"] == st.url + CLAIM
            assert pkv["proxy_request_id"] == kv["proxy_request_id"]
            assert pkv["claim_token"] and pkv["claim_token"] != kv["registration_token"]
            assert "remote_host" not in pkv and "registration_token" not in pkv
            assert "claim_token" not in kv  # each token reaches one side only
            assert pre.stats["claimed"] == 1 and dec.stats["registered"] == 1 and dec.stats["kv_notified"] == 1
            if stream:
                texts = "".join(e["choices"][0]["text"] for e in body if e != "[DONE]")
            else:
                texts = body["choices"][0]["text"]
            assert texts == "".join(expected_texts({"prompt": "hello there"}, 8))
            assert await until(lambda: _idle(st))
            _, metrics = await st.get("/metrics")
            assert 'ascend_offload_proxy_metaserver_claims_total{result="ok"} 1.0' in metrics
            assert 'ascend_offload_proxy_metaserver_registrations_total{result="registered"} 1.0' in metrics

    run(go())


def test_fanout_each_sub_request_claims_its_own_registration() -> None:
    async def go() -> None:
        async with stack(n_decode=2, n_prefill=2, prefill_dispatch="early") as st:
            status, body = await st.post(CMPL, {"prompt": ["a", "bb", "ccc"], "n": 2, "max_tokens": 4})
            assert status == 200, body
            assert len(body["choices"]) == 6
            assert sum(p.stats["claimed"] for p in st.prefills) == 6
            assert sum(d.stats["registered"] for d in st.decodes) == 6
            assert await until(lambda: _idle(st))

    run(go())


def test_claim_waits_for_the_registration_then_answers_its_params() -> None:
    async def go() -> None:
        async with stack(prefill_dispatch="early") as st:
            proxy = st.server.proxy
            p = Pending("early-1", COMPLETIONS, {"prompt": "p"}, 1)
            p.shared = SharedBody(p.body, COMPLETIONS)
            p.claim_token = "claim-secret-0123456789"
            p.registered_params = asyncio.get_running_loop().create_future()
            proxy.pending.add(p)
            claim = {"proxy_request_id": "early-1", "claim_token": p.claim_token}
            waiting = [asyncio.ensure_future(st.post(CLAIM, claim)) for _ in range(2)]  # a retry joins
            assert await until(lambda: proxy.claim_admission.requests == 2)
            assert not any(t.done() for t in waiting)
            status, body = await st.post(META, _reg("early-1", p.token))
            assert (status, body) == (200, {"status": "registered"})
            for status, body in await asyncio.gather(*waiting):
                assert status == 200, body
                kv = body["kv_transfer_params"]
                assert kv["remote_block_ids"] == [0, 4] and kv["remote_request_id"] == "r"
            # a repeated registration is idempotent; a claim after it answers at once
            assert await st.post(META, _reg("early-1", p.token)) == (200, {"status": "registered"})
            status, body = await st.post(CLAIM, claim)
            assert status == 200 and body["kv_transfer_params"]["remote_host"] == "127.0.0.1"
            assert st.prefills[0].received == []  # a hand-made entry: the proxy dispatched nothing
            proxy.pending.finish(p)
            status, body = await st.post(CLAIM, claim)
            assert status == 404
            assert await until(lambda: _idle(st))
            _, metrics = await st.get("/metrics")
            assert 'ascend_offload_proxy_metaserver_claims_total{result="ok"} 3.0' in metrics
            assert 'ascend_offload_proxy_metaserver_registrations_total{result="duplicate"} 1.0' in metrics

    run(go())


def test_claim_refusals_each_final_and_the_proxy_keeps_serving() -> None:
    async def go() -> None:
        async with stack(prefill_dispatch="early") as st:
            proxy = st.server.proxy
            status, body = await st.post(CLAIM, None, raw=b"{not json")
            assert status == 400 and "malformed claim" in body["error"]["message"]
            status, body = await st.post(CLAIM, {"proxy_request_id": "x"})
            assert status == 400 and "`claim_token`" in body["error"]["message"]
            status, body = await st.post(CLAIM, {"proxy_request_id": "x", "claim_token": "t", "more": 1})
            assert status == 400 and "more" in body["error"]["message"]
            status, body = await st.post(CLAIM, None, raw=b"x" * 5000)
            assert status == 413
            status, body = await st.post(CLAIM, {"proxy_request_id": "nope", "claim_token": "t"})
            assert status == 404 and "nope" in body["error"]["message"]
            p = Pending("early-2", COMPLETIONS, {"prompt": "p"}, 1)
            p.claim_token = "right-token"
            p.registered_params = asyncio.get_running_loop().create_future()
            proxy.pending.add(p)
            status, body = await st.post(CLAIM, {"proxy_request_id": "early-2", "claim_token": "wrong"})
            assert status == 403 and "early-2" in body["error"]["message"]
            # the registration token is not a claim token
            status, body = await st.post(CLAIM, {"proxy_request_id": "early-2", "claim_token": p.token})
            assert status == 403
            q = Pending("registered-1", COMPLETIONS, {"prompt": "p"}, 1)  # dispatched after registration
            proxy.pending.add(q)
            status, body = await st.post(CLAIM, {"proxy_request_id": "registered-1", "claim_token": q.token})
            assert status == 409 and "not dispatched early" in body["error"]["message"]
            for x in (p, q):
                proxy.pending.finish(x)
            status, body = await st.post(CMPL, {"prompt": "still alive"})
            assert status == 200, body
            assert await until(lambda: _idle(st))
            _, metrics = await st.get("/metrics")
            for result, n in (("malformed", 4), ("unknown", 1), ("forbidden", 2), ("conflict", 1)):
                assert f'ascend_offload_proxy_metaserver_claims_total{{result="{result}"}} {n}.0' in metrics

    run(go())


def test_decode_never_registers_504_prefill_aborted_and_its_claim_ended() -> None:
    async def go() -> None:
        async with stack(prefill_dispatch="early", decode_kw={"fault": "hang"}, register_timeout_s=0.5) as st:
            status, body = await st.post(CMPL, {"prompt": "p"})
            assert status == 504 and "register" in body["error"]["message"]
            (pre,) = st.prefills
            assert len(pre.received) == 1  # it left with the decode request
            assert await until(lambda: st.decodes[0].stats["aborted"] == 1)
            # its claim ended with the request (404) or its connection was closed first
            assert await until(lambda: pre.stats["aborted"] + pre.stats["completed"] == 1)
            assert pre.stats["claimed"] == 0
            assert await until(lambda: _idle(st))

    run(go())


@pytest.mark.parametrize("fault,status", [("500", 502), ("hang", 504)])
def test_prefill_failure_aborts_the_decode(fault: str, status: int) -> None:
    async def go() -> None:
        async with stack(prefill_dispatch="early", prefill_kw={"fault": fault}, timeout_s=0.5) as st:
            got, body = await st.post(CMPL, {"prompt": "p", "stream": True})
            assert got == status, body
            assert await until(lambda: st.decodes[0].stats["aborted"] == 1)
            assert await until(lambda: _idle(st))

    run(go())


def test_no_prefill_reachable_503_and_decode_aborted() -> None:
    async def go() -> None:
        async with stack(prefill_dispatch="early", n_prefill=0, dead_prefills=1) as st:
            status, body = await st.post(CMPL, {"prompt": "p"})
            assert status == 503 and "prefill" in body["error"]["message"], body
            (dec,) = st.decodes  # the refusal may come before the decode request is on the wire
            assert await until(lambda: dec.stats["aborted"] == dec.stats["requests"] and not dec.stats["completed"])
            assert await until(lambda: _idle(st))

    run(go())


def test_client_disconnect_aborts_both_backends_and_the_claim() -> None:
    async def go() -> None:
        async with stack(prefill_dispatch="early", decode_kw={"fault": "hang"}) as st:
            task = asyncio.ensure_future(st.post(CMPL, {"prompt": "p", "stream": True}))
            (pre,) = st.prefills
            assert await until(lambda: pre.stats["claim_attempts"] == 1)  # waiting in its claim
            task.cancel()
            assert await until(lambda: st.decodes[0].stats["aborted"] == 1)
            # its claim ended with the request (404) or its connection was closed first
            assert await until(lambda: pre.stats["aborted"] + pre.stats["completed"] == 1)
            assert pre.stats["claimed"] == 0
            assert await until(lambda: _idle(st))
            _, health = await st.get("/health")
            assert json.loads(health)["inflight_claims"] == 0

    run(go())
