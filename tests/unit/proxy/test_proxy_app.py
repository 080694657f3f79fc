"""The proxy against fake backends over real loopback HTTP (one process, one loop)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from proxy_testlib import dead_port, run, stack, until

from ascend_offload.harness.fake_backends import expected_texts
from proxy.bodies import COMPLETIONS, SharedBody
from proxy.metaserver import Pending

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"


def _text(body: dict[str, Any]) -> str:
    return "".join(expected_texts(body))


def _stream_texts(events: list[Any], chat: bool = False) -> dict[int, str]:
    texts: dict[int, str] = {}
    for ev in events:
        if ev == "[DONE]":
            continue
        for c in ev["choices"]:
            piece = (c["delta"].get("content") or "") if chat else c["text"]
            texts[c["index"]] = texts.get(c["index"], "") + piece
    return texts


def test_completion_non_stream_follows_the_contract() -> None:
    async def go() -> None:
        async with stack() as st:
            status, body = await st.post(CMPL, {"prompt": "hello there", "max_tokens": 16})
            assert status == 200, body
            assert body["choices"][0]["text"] == _text({"prompt": "hello there"})
            (dec,) = st.decodes
            (pre,) = st.prefills
            sent = dec.received[0]
            kv = sent["kv_transfer_params"]
            assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
            assert kv["metaserver"] == st.url + "/v1/metaserver"
            assert kv["proxy_request_id"]
            got = pre.received[0]
            assert got["max_tokens"] == 1 and got["stream"] is False and got["prompt"] == "hello there"
            pkv = got["kv_transfer_params"]
            assert pkv["do_remote_decode"] is True and pkv["do_remote_prefill"] is False
            assert pkv["remote_port"] == dec.port and pkv["remote_request_id"]
            assert dec.stats["registered"] == 1 and dec.stats["kv_notified"] == 1
            # both engines see the proxy_request_id as their request id (X-Request-Id)
            assert dec.request_ids == [kv["proxy_request_id"]] == pre.request_ids
            assert len(st.server.proxy.pending) == 0

    run(go())


def test_completion_stream_relays_every_chunk() -> None:
    async def go() -> None:
        async with stack() as st:
            status, events = await st.post(CMPL, {"prompt": "a b c", "stream": True})
            assert status == 200
            assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
            assert len(events) == 17
            assert _stream_texts(events) == {0: _text({"prompt": "a b c"})}

    run(go())


def test_chat_stream_and_non_stream() -> None:
    async def go() -> None:
        msgs = [{"role": "user", "content": "hi there"}]
        async with stack() as st:
            status, body = await st.post(CHAT, {"messages": msgs, "max_completion_tokens": 16})
            assert status == 200, body
            assert body["choices"][0]["message"]["content"] == _text({"messages": msgs})
            status, events = await st.post(CHAT, {"messages": msgs, "stream": True})
            assert status == 200
            assert _stream_texts(events, chat=True) == {0: _text({"messages": msgs})}
            for got in st.prefills[0].received:
                assert got["max_tokens"] == 1 and got["max_completion_tokens"] == 1

    run(go())


def test_prompt_list_and_n_merged_non_stream() -> None:
    async def go() -> None:
        prompts = ["one", "two words", "x y z"]
        async with stack(n_decode=2, n_prefill=2) as st:
            status, body = await st.post(CMPL, {"prompt": prompts, "n": 2, "seed": 7})
            assert status == 200, body
            status, ids = await st.post(CMPL, {"prompt": [[5, 6, 7], [8]], "n": 2})
            assert status == 200 and [c["index"] for c in ids["choices"]] == [0, 1, 2, 3]
            choices = body["choices"]
            assert [c["index"] for c in choices] == list(range(6))
            for i, p in enumerate(prompts):
                for j in range(2):
                    assert choices[i * 2 + j]["text"] == _text({"prompt": p, "seed": 7 + j})
            assert body["usage"] == {"prompt_tokens": 1 + 2 + 3, "completion_tokens": 96,
                                     "total_tokens": 102}
            assert sum(d.stats["requests"] for d in st.decodes) == 10
            assert sum(len(p.received) for p in st.prefills) == 10
            assert all(r.get("n", 1) == 1 for d in st.decodes for r in d.received)

    run(go())


def test_prompt_list_and_n_merged_stream_with_usage() -> None:
    async def go() -> None:
        prompts = ["x", "y z"]
        async with stack(n_decode=2) as st:
            status, events = await st.post(
                CMPL, {"prompt": prompts, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
            )
            assert status == 200
            assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
            ids = {ev["id"] for ev in events if ev != "[DONE]"}
            assert len(ids) == 1
            texts = _stream_texts(events)
            assert texts == {
                0: _text({"prompt": "x"}), 1: _text({"prompt": "x"}),
                2: _text({"prompt": "y z"}), 3: _text({"prompt": "y z"}),
            }
            usage = [ev for ev in events if ev != "[DONE]" and ev.get("usage")]
            assert len(usage) == 1 and usage[0] is events[-2]
            assert usage[0]["usage"] == {"prompt_tokens": 3, "completion_tokens": 64, "total_tokens": 67}
            # the prefill never gets stream_options (vLLM rejects it without stream)
            assert all("stream_options" not in r for r in st.prefills[0].received)

    run(go())


def test_chat_n_stream() -> None:
    async def go() -> None:
        msgs = [{"role": "user", "content": "q"}]
        async with stack() as st:
            status, events = await st.post(CHAT, {"messages": msgs, "n": 3, "stream": True, "seed": 1})
            assert status == 200
            texts = _stream_texts(events, chat=True)
            assert texts == {j: _text({"messages": msgs, "seed": 1 + j}) for j in range(3)}

    run(go())


def test_prefill_down_json_error_and_decode_aborted() -> None:
    async def go() -> None:
        async with stack(n_prefill=0, dead_prefills=1, timeout_s=30) as st:
            status, body = await st.post(CMPL, {"prompt": "p", "stream": True})
            assert status == 503, body
            assert body["error"]["code"] == 503 and "prefill" in body["error"]["message"]
            (dec,) = st.decodes
            assert await until(lambda: dec.stats["aborted"] == 1), dec.stats
            assert dec.stats["completed"] == 0
            assert len(st.server.proxy.pending) == 0
            status, body = await st.post(CMPL, {"prompt": "p"})  # and again, still clean
            assert status == 503
            assert await until(lambda: dec.stats["aborted"] == 2), dec.stats

    run(go())


def test_second_prefill_used_when_first_refuses() -> None:
    async def go() -> None:
        async with stack(n_prefill=1, dead_prefills=1) as st:
            for _ in range(4):
                status, body = await st.post(CMPL, {"prompt": "p"})
                assert status == 200, body
            assert len(st.prefills[0].received) == 4
            _, health = await st.get("/health")
            assert [p["healthy"] for p in json.loads(health)["prefillers"]] == [True, False]

    run(go())


def test_prefill_error_502_and_decode_aborted() -> None:
    async def go() -> None:
        async with stack(prefill_kw={"fault": "500"}) as st:
            status, body = await st.post(CMPL, {"prompt": "p"})
            assert status == 502, body
            assert "HTTP 500" in body["error"]["message"]
            assert await until(lambda: st.decodes[0].stats["aborted"] == 1)

    run(go())


def test_prefill_hang_504_both_sides_aborted() -> None:
    async def go() -> None:
        async with stack(prefill_kw={"fault": "hang"}, timeout_s=0.5) as st:
            status, body = await st.post(CMPL, {"prompt": "p", "stream": True})
            assert status == 504, body
            assert body["error"]["type"] == "GatewayTimeoutError"
            assert await until(lambda: st.decodes[0].stats["aborted"] == 1)
            assert await until(lambda: st.prefills[0].stats["aborted"] == 1)

    run(go())


def test_decode_down_503_and_failover() -> None:
    async def go() -> None:
        async with stack(n_decode=0, dead_decodes=1) as st:
            status, body = await st.post(CMPL, {"prompt": "p"})
            assert status == 503 and "decode" in body["error"]["message"]
            assert st.prefills[0].received == []
        async with stack(n_decode=1, dead_decodes=1) as st:
            for _ in range(4):
                status, body = await st.post(CMPL, {"prompt": "p", "stream": True})
                assert status == 200
            assert st.decodes[0].stats["completed"] == 4

    run(go())


def test_decode_error_answer_is_relayed() -> None:
    async def go() -> None:
        async with stack(decode_kw={"fault": "500"}) as st:
            status, body = await st.post(CMPL, {"prompt": "p", "stream": True})
            assert status == 500 and body["error"]["message"] == "fake decode failure"
            assert st.prefills[0].received == []
            assert len(st.server.proxy.pending) == 0

    run(go())


def test_decode_never_registers_504_and_aborted() -> None:
    async def go() -> None:
        async with stack(decode_kw={"fault": "hang"}, register_timeout_s=0.3) as st:
            status, body = await st.post(CMPL, {"prompt": "p"})
            assert status == 504 and "register" in body["error"]["message"]
            assert await until(lambda: st.decodes[0].stats["aborted"] == 1)
            assert st.prefills[0].received == []

    run(go())


def test_decode_drops_connection_502() -> None:
    async def go() -> None:
        async with stack(decode_kw={"fault": "drop"}) as st:
            status, body = await st.post(CMPL, {"prompt": "p", "stream": True})
            assert status == 502, body
            assert body["error"]["code"] == 502

    run(go())


def _reg(rid: str, token: str, **params: Any) -> dict[str, Any]:
    kv = {"remote_host": "127.0.0.1", "remote_port": 1, "remote_request_id": "r", "remote_block_ids": [0]}
    return {"proxy_request_id": rid, "registration_token": token, "kv_transfer_params": {**kv, **params}}


def test_metaserver_rejects_malformed_and_unknown_and_keeps_serving() -> None:
    async def go() -> None:
        async with stack() as st:
            meta = "/v1/metaserver"
            status, body = await st.post(meta, None, raw=b"{not json")
            assert status == 400 and "malformed" in body["error"]["message"]
            status, body = await st.post(meta, [1])
            assert status == 400
            status, body = await st.post(meta, {"kv_transfer_params": {}, "registration_token": "t"})
            assert status == 400 and "`proxy_request_id`" in body["error"]["message"]
            status, body = await st.post(meta, {"proxy_request_id": "x", "kv_transfer_params": {}})
            assert status == 400 and "`registration_token`" in body["error"]["message"]
            status, body = await st.post(meta, _reg("nope", "t"))
            assert status == 404 and "nope" in body["error"]["message"]
            assert body["error"]["type"] == "NotFoundError"
            status, body = await st.post(CMPL, {"prompt": "still alive"})
            assert status == 200
            _, metrics = await st.get("/metrics")
            assert 'ascend_offload_proxy_metaserver_registrations_total{result="malformed"} 4.0' in metrics
            assert 'ascend_offload_proxy_metaserver_registrations_total{result="unknown"} 1.0' in metrics

    run(go())


def test_duplicate_registration_dispatches_once() -> None:
    async def go() -> None:
        async with stack() as st:
            proxy = st.server.proxy
            p = Pending("dup-1", COMPLETIONS, {"prompt": "p"}, 1)
            p.shared = SharedBody(p.body, COMPLETIONS)
            proxy.pending.add(p)
            msg = _reg("dup-1", p.token, remote_port=dead_port())
            results = await asyncio.gather(*(st.post("/v1/metaserver", msg) for _ in range(3)))
            assert [r[0] for r in results] == [200, 200, 200]
            assert all(r[1] == {"status": "dispatched"} for r in results)
            assert await until(lambda: len(st.prefills[0].received) == 1)
            _, metrics = await st.get("/metrics")
            assert 'ascend_offload_proxy_metaserver_registrations_total{result="dispatched"} 1.0' in metrics
            assert 'ascend_offload_proxy_metaserver_registrations_total{result="duplicate"} 2.0' in metrics
            assert st.prefills[0].stats["requests"] == 1
            proxy.pending.finish(p)
            status, _ = await st.post("/v1/metaserver", msg)
            assert status == 404

    run(go())


def test_least_loaded_decode_gets_new_requests() -> None:
    async def go() -> None:
        async with stack(n_decode=2) as st:
            slow, fast = st.decodes
            slow.fault = "hang"
            # two concurrent requests on two idle decodes: one each, one sticks on `slow`
            hung = [asyncio.ensure_future(st.post(CMPL, {"prompt": "h"})) for _ in range(2)]
            assert await until(lambda: slow.stats["requests"] == 1 and fast.stats["completed"] == 1)
            before = fast.stats["requests"]
            for _ in range(10):
                status, _ = await st.post(CMPL, {"prompt": "f"})
                assert status == 200
            assert slow.stats["requests"] == 1  # round robin would have sent it 5 more
            assert fast.stats["requests"] == before + 10
            _, metrics = await st.get("/metrics")
            line = f'ascend_offload_proxy_backend_inflight{{instance="127.0.0.1:{slow.port}",role="decode"}} 1.0'
            assert line in metrics
            for t in hung:
                t.cancel()

    run(go())


def test_client_disconnect_aborts_both_backends() -> None:
    async def go() -> None:
        async with stack(prefill_kw={"fault": "hang"}) as st:
            task = asyncio.ensure_future(st.post(CMPL, {"prompt": "p", "stream": True}))
            assert await until(lambda: len(st.prefills[0].received) == 1)
            task.cancel()
            assert await until(lambda: st.decodes[0].stats["aborted"] == 1)
            assert await until(lambda: st.prefills[0].stats["aborted"] == 1)
            assert await until(lambda: len(st.server.proxy.pending) == 0)

    run(go())


def test_bad_client_body_400() -> None:
    async def go() -> None:
        async with stack(max_body_mb=1) as st:
            status, body = await st.post(CMPL, None, raw=b"nope")
            assert status == 400 and body["error"]["type"] == "BadRequestError"
            status, body = await st.post(CMPL, {"prompt": "x", "n": 0})
            assert status == 400 and "'n'" in body["error"]["message"]
            status, body = await st.post(CMPL, {"prompt": "x" * (2 * 1024 * 1024)})
            assert status == 413 and body["error"]["code"] == 413
            assert st.decodes[0].received == []

    run(go())


def test_health_models_metrics() -> None:
    async def go() -> None:
        async with stack() as st:
            status, text = await st.get("/health")
            assert status == 200 and json.loads(text)["status"] == "ok"
            status, text = await st.get("/v1/models")
            assert status == 200 and json.loads(text)["data"][0]["id"] == "fake-model"
            await st.post(CMPL, {"prompt": "m"})
            status, text = await st.get("/metrics")
            assert status == 200
            assert 'ascend_offload_proxy_requests_total{endpoint="/v1/completions",status="200"} 1.0' in text
            assert "ascend_offload_proxy_request_seconds_count 1.0" in text
            assert "ascend_offload_proxy_pending_requests 0.0" in text

    run(go())


def test_decode_breaks_mid_stream_sse_error_event() -> None:
    async def go() -> None:
        async with stack(decode_kw={"fault": "break"}) as st:
            status, events = await st.post(CMPL, {"prompt": "p", "stream": True})
            assert status == 200  # headers were out before the decode broke
            texts = [e["choices"][0]["text"] for e in events[:-2]]
            assert texts == expected_texts({"prompt": "p"})[:4]
            assert events[-2]["error"]["code"] == 502 and events[-1] == "[DONE]"
            status, body = await st.post(CMPL, {"prompt": "p"})
            assert status == 502 and body["error"]["code"] == 502
            assert len(st.server.proxy.pending) == 0
            _, metrics = await st.get("/metrics")
            assert 'ascend_offload_proxy_backend_errors_total{kind="stream_broken",role="decode"} 1.0' in metrics

    run(go())


def test_fanout_with_a_failing_sub_request() -> None:
    async def go() -> None:
        async with stack(n_decode=2) as st:
            st.decodes[1].fault = "500"
            for stream in (False, True):
                status, body = await st.post(CMPL, {"prompt": ["a", "b", "c", "d"], "stream": stream})
                assert status == 500, body  # the failing decode's own answer
                assert body["error"]["message"] == "fake decode failure"
            assert await until(lambda: len(st.server.proxy.pending) == 0)
        async with stack(n_prefill=0, dead_prefills=1) as st:
            for stream in (False, True):
                status, body = await st.post(CMPL, {"prompt": "q", "n": 3, "stream": stream})
                assert status == 503 and "prefill" in body["error"]["message"]
            assert await until(lambda: st.decodes[0].stats["aborted"] == 6)
            assert st.decodes[0].stats["completed"] == 0

    run(go())


def test_fanout_stream_breaks_after_start() -> None:
    async def go() -> None:
        async with stack(n_decode=2) as st:
            st.decodes[1].fault = "break"
            status, events = await st.post(CMPL, {"prompt": ["a", "b"], "stream": True})
            assert status == 200
            assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
            assert "error" in events[-2]
            assert await until(lambda: len(st.server.proxy.pending) == 0)

    run(go())


def test_metaserver_url_override_and_advertised_host() -> None:
    from proxy.server import advertised_host

    assert advertised_host("10.1.2.3") == "10.1.2.3"
    assert advertised_host("0.0.0.0") not in ("", "0.0.0.0")

    async def go() -> None:
        async with stack(metaserver_url="http://127.0.0.1:1/elsewhere",
                         decode_kw={"register_timeout_s": 0.5}) as st:
            assert st.server.proxy.metaserver_url == "http://127.0.0.1:1/elsewhere"
            status, body = await st.post(CMPL, {"prompt": "p"})
            # the fake decode registers at the advertised URL, which is wrong here
            assert status == 500 and "registration failed" in body["error"]["message"]
            assert st.decodes[0].received[0]["kv_transfer_params"]["metaserver"] == (
                "http://127.0.0.1:1/elsewhere"
            )

    run(go())


def test_nothing_leaks_under_mixed_load_cancellations_and_faults() -> None:
    import random

    async def go() -> None:
        rng = random.Random(7)
        async with stack(n_decode=2, n_prefill=2, register_timeout_s=2, timeout_s=2) as st:
            st.prefills[1].fault = "hang"  # some prefills time out (504), decodes get aborted
            st.decodes[1].fault = "break"  # some streams break mid-way

            async def one(i: int) -> int:
                body: dict[str, Any] = {"prompt": f"p{i}", "stream": rng.random() < 0.5}
                if rng.random() < 0.3:
                    body["prompt"] = [f"a{i}", f"b{i}"]
                    body["n"] = 2
                task = asyncio.ensure_future(st.post(CMPL, body))
                if rng.random() < 0.3:
                    await asyncio.sleep(rng.random() * 0.05)
                    task.cancel()
                try:
                    status, _ = await task
                    return status
                except asyncio.CancelledError:
                    return -1

            statuses = await asyncio.gather(*(one(i) for i in range(60)))
            assert set(statuses) <= {-1, 200, 502, 503, 504}, statuses
            assert 200 in statuses
            proxy = st.server.proxy
            assert await until(lambda: len(proxy.pending) == 0, timeout=15)
            assert await until(lambda: not proxy._bg, timeout=15)
            for b in (proxy.decoders, proxy.prefillers):
                for inst in b.instances:
                    assert inst.inflight == 0 and inst.load == 0, b.snapshot()

    run(go())


def test_authorization_is_passed_to_both_backends() -> None:
    async def go() -> None:
        async with stack() as st:
            auth = {"Authorization": "Bearer sk-test"}
            status, _ = await st.post(CMPL, {"prompt": "p"}, headers=auth)
            assert status == 200
            status, _ = await st.post(CMPL, {"prompt": ["a", "b"], "stream": True}, headers=auth)
            assert status == 200
            status, _ = await st.post(CMPL, {"prompt": "q"})
            assert status == 200
            expected = ["Bearer sk-test"] * 3 + [None]
            assert st.decodes[0].auth_headers == expected
            assert st.prefills[0].auth_headers == expected

    run(go())
