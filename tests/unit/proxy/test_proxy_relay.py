from __future__ import annotations

import json

import aiohttp
from aiohttp import web
from proxy_testlib import parse_sse, proxy_for, run, serve_app

from proxy.relay import SSESplitter, StreamMerger, merge_responses


def _chunk(text: str, index: int = 0, **extra: object) -> bytes:
    return json.dumps({"id": "x", "choices": [{"index": index, "text": text}], **extra}).encode()


def test_splitter_handles_arbitrary_boundaries() -> None:
    stream = b"data: " + _chunk("a") + b"\n\n: comment\n\ndata: " + _chunk("b") + b"\n\ndata: [DONE]\n\n"
    for cut in range(1, len(stream)):
        sp = SSESplitter()
        got = sp.feed(stream[:cut]) + sp.feed(stream[cut:])
        assert got == [_chunk("a"), _chunk("b"), b"[DONE]"], cut
        assert sp.pending() == b""


def test_splitter_crlf() -> None:
    sp = SSESplitter()
    assert sp.feed(b"data: 1\r\n\r\ndata: 2\r\n\r\n") == [b"1", b"2"]


def test_merger_renumbers_ids_and_sums_usage() -> None:
    m = StreamMerger("cmpl-merged")
    out = m.rewrite(_chunk("a"), 3, True)
    assert out is not None
    ev = json.loads(out[len(b"data: "):])
    assert ev["id"] == "cmpl-merged" and ev["choices"][0]["index"] == 3
    usage1 = json.dumps({"id": "y", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}})
    usage2 = json.dumps({"id": "z", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}})
    assert m.rewrite(usage1.encode(), 0, True) is None
    assert m.rewrite(usage2.encode(), 1, False) is None  # same prompt: prompt tokens once
    assert m.rewrite(b"[DONE]", 0, True) is None
    tail = m.finish().decode()
    events = [e for e in tail.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    usage = json.loads(events[0][6:])
    assert usage["id"] == "cmpl-merged"
    assert usage["usage"] == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}


def test_merger_without_usage_only_done() -> None:
    assert StreamMerger("r").finish() == b"data: [DONE]\n\n"


def test_merge_responses_orders_choices_and_sums_usage() -> None:
    def resp(text: str, pt: int, ct: int) -> bytes:
        return json.dumps({
            "id": "sub", "object": "text_completion", "model": "m",
            "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
            "usage": {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct},
            "kv_transfer_params": {"x": 1},
        }).encode()

    parts = [(2, True, resp("c", 5, 1)), (0, True, resp("a", 3, 2)), (1, False, resp("b", 3, 4))]
    merged = json.loads(merge_responses(parts, "cmpl-1"))
    assert merged["id"] == "cmpl-1"
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [(0, "a"), (1, "b"), (2, "c")]
    assert merged["usage"] == {"prompt_tokens": 8, "completion_tokens": 7, "total_tokens": 15}
    assert "kv_transfer_params" not in merged


def test_splitter_finish_flushes_an_event_without_its_blank_line() -> None:
    sp = SSESplitter()
    assert sp.feed(b'data: {"a": 1}\n\ndata: {"b"') == [b'{"a": 1}']
    assert sp.feed(b": 2}\r\n") == []
    assert sp.finish() == [b'{"b": 2}']
    assert sp.finish() == [] and sp.pending() == b""
    sp.feed(b": keep-alive comment\n")
    assert sp.finish() == []


class TruncatedDecode:
    """Streams two events; the last one ends the stream without its closing blank line."""

    def __init__(self) -> None:
        self.app = web.Application()
        self.app.router.add_post("/v1/completions", self.completions)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        first = {"id": "a", "choices": [{"index": 0, "text": "one "}]}
        last = {"id": "a", "choices": [{"index": 0, "text": "two", "finish_reason": "length"}]}
        await resp.write(b"data: " + json.dumps(first).encode() + b"\n\n")
        await resp.write(b"data: " + json.dumps(last).encode() + b"\n")  # no blank line, no [DONE]
        await resp.write_eof()
        return resp


def test_fanout_stream_keeps_the_last_event_without_its_blank_line() -> None:
    async def go() -> None:
        async with serve_app(TruncatedDecode().app) as dport, proxy_for([1], [dport]) as server, \
                aiohttp.ClientSession() as http:
            body = {"prompt": "p", "n": 2, "stream": True}
            async with http.post(server.url + "/v1/completions", json=body) as r:
                assert r.status == 200
                events = parse_sse(await r.text())
            texts: dict[int, str] = {}
            for ev in events[:-1]:
                for c in ev["choices"]:
                    texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            assert texts == {0: "one two", 1: "one two"} and events[-1] == "[DONE]"

    run(go())
