from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.bodies import (
    CHAT,
    COMPLETIONS,
    SegmentsPayload,
    SharedBody,
    decode_params,
    split_request,
)
from proxy.errors import ProxyError


def test_single_prompt_is_not_split_and_drops_n() -> None:
    subs = split_request({"prompt": "hi", "n": 1, "max_tokens": 5}, COMPLETIONS)
    assert len(subs) == 1
    assert subs[0].index == 0 and subs[0].first_of_prompt
    assert subs[0].body == {"prompt": "hi", "max_tokens": 5}


def test_token_id_prompt_is_one_prompt() -> None:
    subs = split_request({"prompt": [1, 2, 3]}, COMPLETIONS)
    assert len(subs) == 1 and subs[0].body["prompt"] == [1, 2, 3]


def test_prompt_list_times_n_in_openai_order_with_seeds() -> None:
    subs = split_request({"prompt": [[1], [7, 8]], "n": 3, "seed": 10}, COMPLETIONS)
    assert [s.index for s in subs] == [0, 1, 2, 3, 4, 5]
    assert [s.body["prompt"] for s in subs] == [[1], [1], [1], [7, 8], [7, 8], [7, 8]]
    assert [s.body["seed"] for s in subs] == [10, 11, 12, 10, 11, 12]
    assert [s.first_of_prompt for s in subs] == [True, False, False, True, False, False]
    assert all(s.body["n"] == 1 for s in subs)


def test_chat_n_fans_out_without_prompt_key() -> None:
    subs = split_request({"messages": [{"role": "user", "content": "hey"}], "n": 2}, CHAT)
    assert len(subs) == 2
    assert "prompt" not in subs[0].body and "seed" not in subs[0].body
    assert subs[1].first_of_prompt is False


@pytest.mark.parametrize(
    ("body", "key"),
    [
        ({"prompt": "x", "n": 0}, "'n'"),
        ({"prompt": "x", "n": "2"}, "'n'"),
        ({"prompt": "x", "n": True}, "'n'"),
        ({}, "'prompt'"),
        ({"prompt": []}, "'prompt'"),
        ({"prompt": [[]]}, "'prompt'"),
        ({"prompt": [1, "a"]}, "'prompt'"),
        ({"prompt": ["a", [1, 2]]}, "'prompt'"),
        ({"prompt": 5}, "'prompt'"),
        ({"prompt": "x", "seed": 1.5}, "'seed'"),
        ({"prompt": "x", "use_beam_search": True}, "'use_beam_search'"),
    ],
)
def test_bad_completion_bodies_name_the_key(body: dict, key: str) -> None:
    with pytest.raises(ProxyError) as ei:
        split_request(body, COMPLETIONS)
    assert ei.value.status == 400
    assert key in ei.value.message


def test_bad_chat_and_non_object_bodies() -> None:
    with pytest.raises(ProxyError, match="'messages'"):
        split_request({"messages": []}, CHAT)
    with pytest.raises(ProxyError, match="JSON object"):
        split_request([1, 2], COMPLETIONS)


def test_fanout_limit() -> None:
    with pytest.raises(ProxyError, match="limit 4"):
        split_request({"prompt": ["a", "b"], "n": 3}, COMPLETIONS, max_fanout=4)


def _joined(payload: SegmentsPayload) -> Any:
    data = b"".join(payload._value)
    assert payload.size == len(data)
    return json.loads(data)


def test_decode_body_asks_for_remote_prefill() -> None:
    sub = {"prompt": "x", "kv_transfer_params": {"junk": 1}, "temperature": 0.5}
    body = _joined(SharedBody(sub, COMPLETIONS).decode_payload(sub, decode_params("http://p:1/v1/metaserver",
                                                                                   "id-1", "tok")))
    assert body == {
        "prompt": "x",
        "temperature": 0.5,
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "metaserver": "http://p:1/v1/metaserver",
            "proxy_request_id": "id-1",
            "registration_token": "tok",
        },
    }


def test_prefill_body_one_token_not_streamed_with_registered_params() -> None:
    sub = {"prompt": "x", "max_tokens": 99, "min_tokens": 5, "stream": True,
           "stream_options": {"include_usage": True}, "temperature": 0.0}
    body = _joined(SharedBody(sub, COMPLETIONS).prefill_payload(sub, {"remote_host": "h", "remote_port": 5}))
    assert body["max_tokens"] == 1 and body["stream"] is False
    assert "stream_options" not in body and "min_tokens" not in body and "max_completion_tokens" not in body
    assert body["temperature"] == 0.0 and body["prompt"] == "x"
    assert list(body["kv_transfer_params"].items()) == [
        ("do_remote_decode", True), ("do_remote_prefill", False), ("remote_host", "h"), ("remote_port", 5)
    ]
    assert sub["max_tokens"] == 99  # the decode's body is not modified
    msgs = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 50}
    chat = _joined(SharedBody(msgs, CHAT).prefill_payload(msgs, {}))
    assert chat["max_completion_tokens"] == 1 and chat["max_tokens"] == 1 and chat["messages"] == msgs["messages"]


def test_fanout_sub_requests_share_one_encoding_of_the_prompt() -> None:
    prompt = "word " * 200_000  # ~1 MiB
    body = {"prompt": prompt, "n": 8, "seed": 3, "max_tokens": 4, "logit_bias": {"5": 1.0}}
    subs = split_request(body, COMPLETIONS)
    shared = SharedBody(body, COMPLETIONS)
    decode = [shared.decode_payload(s.body, {"i": s.index}) for s in subs]
    prefill = [shared.prefill_payload(s.body, {"i": s.index}) for s in subs]
    # Every payload carries the same prompt bytes object, not a copy of it.
    big = [[seg for seg in p._value if len(seg) > len(prompt)] for p in decode + prefill]
    assert all(len(b) == 1 for b in big)
    assert len({id(b[0]) for b in big}) == 1
    # ... and the shared tail (everything but prompt/n/seed/kv) is one buffer per backend role.
    tails = {id(p._value[-1].obj) for p in decode if isinstance(p._value[-1], memoryview)}
    assert len(tails) == 1
    for s, p in zip(subs, decode, strict=True):
        got = _joined(p)
        assert got == {**body, "n": 1, "seed": 3 + s.index, "kv_transfer_params": {"i": s.index}}
    for s, p in zip(subs, prefill, strict=True):
        got = _joined(p)
        assert got["seed"] == 3 + s.index and got["max_tokens"] == 1 and "n" not in got
        assert got["prompt"] == prompt and got["logit_bias"] == {"5": 1.0}


def test_segments_payload_is_what_aiohttp_sends() -> None:
    async def go() -> bytes:
        got: list[bytes] = []

        async def handler(request: web.Request) -> web.Response:
            got.append(await request.read())
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_post("/", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            body = {"prompt": [1, 2, 3], "n": 2, "max_tokens": 3}
            shared = SharedBody(body, COMPLETIONS)
            sub = split_request(body, COMPLETIONS)[1]
            async with aiohttp.ClientSession() as s:
                async with s.post(f"http://127.0.0.1:{port}/", data=shared.decode_payload(sub.body, {})) as r:
                    assert r.status == 200
        finally:
            await runner.cleanup()
        return got[0]

    raw = asyncio.run(go())
    assert json.loads(raw) == {"prompt": [1, 2, 3], "n": 1, "max_tokens": 3, "kv_transfer_params": {}}
