"""Fake prefill/decode OpenAI servers for proxy tests and ``bench proxy``.

They answer instantly (``chunks`` streamed pieces, 16 by default) but follow
the metaserver contract like real vLLM instances with our connector would:

* the fake **decode**, given ``kv_transfer_params.do_remote_prefill`` and a
  ``metaserver`` URL, registers there (retrying connection errors and 5xx
  with backoff, within a deadline) before it answers; with ``wait_kv`` it also
  waits until the fake prefill reports the KV as delivered, as a real decode
  waits for its layers. It counts requests whose client went away (``aborted``);
* the fake **prefill** records every body it receives and, when the body
  names a ``remote_host``/``remote_port``, tells that decode the KV is there.

Faults (``--fault`` or ``POST /_fake/fault {"mode": ...}``): ``none``,
``500`` (answer an OpenAI error), ``hang`` (never answer), ``drop`` (close the
connection without answering), ``break`` (register and start answering, then
cut the connection after a few stream chunks, or before a whole answer). "Down" is simply a server that is not running.

Output text is a pure function of (prompt, seed, chunk index) — see
``expected_texts`` — so tests can check that fanned-out answers were merged
into the right choice indices.

Run one as a process: ``python -m ascend_offload.harness.fake_backends
--role decode --port 8200``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import logging
import signal
import sys
import time
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

log = logging.getLogger("fake_backends")

_enc = msgspec.json.encode
_dec = msgspec.json.decode
_JSON = {"Content-Type": "application/json"}
_SSE = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
MODEL = "fake-model"
FAULTS = ("none", "500", "hang", "drop", "break")


def prompt_tag(body: dict[str, Any]) -> str:
    """A short digest of what determines a fake answer: the prompt (or messages) and seed."""
    key = body.get("messages") if "messages" in body else body.get("prompt")
    raw = _enc([key, body.get("seed")])
    return hashlib.sha1(raw).hexdigest()[:8]


def expected_texts(body: dict[str, Any], chunks: int = 16) -> list[str]:
    """The text pieces a fake backend streams for a one-prompt, n=1 ``body``."""
    tag = prompt_tag(body)
    return [f" {tag}.{i}" for i in range(chunks)]


def _prompt_tokens(body: dict[str, Any]) -> int:
    if "messages" in body:
        return sum(len(str(m.get("content", "")).split()) for m in body["messages"] if isinstance(m, dict))
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return len(prompt)
    return len(str(prompt).split())


class FakeBackend:
    """One fake OpenAI server, prefill or decode role."""

    def __init__(
        self,
        role: str,
        host: str = "127.0.0.1",
        port: int = 0,
        chunks: int = 16,
        fault: str = "none",
        wait_kv: bool = False,
        kv_timeout_s: float = 10.0,
        register_timeout_s: float = 10.0,
        record: bool = True,
    ) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
        if fault not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
        self.role = role
        self.host = host
        self.port = port
        self.chunks = chunks
        self.fault = fault
        self.wait_kv = wait_kv
        self.kv_timeout_s = kv_timeout_s
        self.register_timeout_s = register_timeout_s
        self.record = record
        self.received: list[dict[str, Any]] = []
        self.request_ids: list[str | None] = []  # X-Request-Id headers, as vLLM would use them
        self.auth_headers: list[str | None] = []
        self.stats: dict[str, int] = {
            "requests": 0,
            "completed": 0,
            "aborted": 0,
            "registered": 0,
            "register_failed": 0,
            "register_attempts": 0,
            "kv_notified": 0,
            "claim_attempts": 0,
            "claimed": 0,
        }
        self._kv_ready: dict[str, asyncio.Event] = {}
        self._ids = 0
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    # ------------------------------------------------------------------ lifecycle

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/_fake/state", self._state)
        app.router.add_post("/_fake/fault", self._set_fault)
        app.router.add_post("/_fake/kv_ready", self._kv_ready_handler)
        app.router.add_post("/_fake/reset", self._reset)
        return app

    async def start(self) -> int:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        self._runner = web.AppRunner(
            self.app(), access_log=None, handler_cancellation=True, shutdown_timeout=0.5
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, backlog=2048, reuse_address=True)
        await site.start()
        sockets = getattr(getattr(site, "_server", None), "sockets", None)
        self.port = int(sockets[0].getsockname()[1]) if sockets else self.port
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ------------------------------------------------------------------ control

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(body=b"{}", headers=_JSON)

    async def _models(self, request: web.Request) -> web.Response:
        body = {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": self.role}]}
        return web.Response(body=_enc(body), headers=_JSON)

    async def _state(self, request: web.Request) -> web.Response:
        body = {"role": self.role, "fault": self.fault, "stats": self.stats, "received": self.received}
        return web.Response(body=_enc(body), headers=_JSON)

    async def _set_fault(self, request: web.Request) -> web.Response:
        mode = (await request.json()).get("mode")
        if mode not in FAULTS:
            return web.Response(status=400, body=_enc({"error": f"mode must be one of {FAULTS}"}))
        self.fault = mode
        return web.Response(body=b"{}", headers=_JSON)

    async def _reset(self, request: web.Request) -> web.Response:
        self.received.clear()
        self.request_ids.clear()
        self.auth_headers.clear()
        for k in self.stats:
            self.stats[k] = 0
        return web.Response(body=b"{}", headers=_JSON)

    async def _kv_ready_handler(self, request: web.Request) -> web.Response:
        rid = (await request.json()).get("remote_request_id")
        self._kv_event(str(rid)).set()
        self.stats["kv_notified"] += 1
        return web.Response(body=b"{}", headers=_JSON)

    def _kv_event(self, rid: str) -> asyncio.Event:
        ev = self._kv_ready.get(rid)
        if ev is None:
            ev = self._kv_ready[rid] = asyncio.Event()
        return ev

    # ------------------------------------------------------------------ generate

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        self.stats["requests"] += 1
        body = _dec(await request.read())
        if self.record:
            self.received.append(body)
            self.request_ids.append(request.headers.get("X-Request-Id"))
            self.auth_headers.append(request.headers.get("Authorization"))
        try:
            resp = await self._generate_inner(request, body, chat)
        except asyncio.CancelledError:
            self.stats["aborted"] += 1
            raise
        self.stats["completed"] += 1
        return resp

    async def _generate_inner(
        self, request: web.Request, body: dict[str, Any], chat: bool
    ) -> web.StreamResponse:
        if self.fault == "500":
            err = {"error": {"message": f"fake {self.role} failure", "type": "InternalServerError",
                             "param": None, "code": 500}}
            return web.Response(status=500, body=_enc(err), headers=_JSON)
        if self.fault == "hang":
            await asyncio.sleep(3600)
        if self.fault == "drop":
            if request.transport is not None:
                request.transport.abort()
            return web.Response(status=500)

        self._ids += 1
        rid = f"{self.role}-{self.port}-{self._ids}"
        params = body.get("kv_transfer_params") or {}
        if self.role == "decode" and params.get("do_remote_prefill") and params.get("metaserver"):
            ev = self._kv_event(rid) if self.wait_kv else None
            try:
                reg_err = await self._register(params, rid)
                if reg_err is not None:
                    return web.Response(status=500, body=_enc({"error": {"message": reg_err, "code": 500}}),
                                        headers=_JSON)
                if ev is not None:
                    try:
                        await asyncio.wait_for(ev.wait(), self.kv_timeout_s)
                    except TimeoutError:
                        msg = f"fake decode: KV for {rid} not delivered within {self.kv_timeout_s} s"
                        return web.Response(status=500, body=_enc({"error": {"message": msg, "code": 500}}),
                                            headers=_JSON)
            finally:
                self._kv_ready.pop(rid, None)  # also when the client went away meanwhile
        if self.role == "prefill" and params.get("do_remote_decode") and params.get("claim_url"):
            claimed = await self._claim(params)
            if isinstance(claimed, str):
                return web.Response(status=500, body=_enc({"error": {"message": claimed, "code": 500}}),
                                    headers=_JSON)
            params = {"do_remote_decode": True, "do_remote_prefill": False, **claimed}
        if self.role == "prefill" and params.get("do_remote_decode") and params.get("remote_host"):
            await self._notify_decode(params)

        if self.fault == "break":
            if body.get("stream") is True:
                return await self._stream(request, body, chat, rid, cut_after=4)
            if request.transport is not None:
                request.transport.abort()
            return web.Response(status=500)
        if body.get("stream") is True:
            return await self._stream(request, body, chat, rid)
        texts = expected_texts(body, self._n_chunks(body))
        return web.Response(body=_enc(self._whole(body, chat, rid, "".join(texts), len(texts))),
                            headers=_JSON)

    def _n_chunks(self, body: dict[str, Any]) -> int:
        mt = body.get("max_completion_tokens") or body.get("max_tokens")
        return min(self.chunks, int(mt)) if isinstance(mt, int) and mt > 0 else self.chunks

    async def _register(self, params: dict[str, Any], rid: str) -> str | None:
        """Contract step 3, with the retry rules a real decode connector follows."""
        assert self._session is not None
        msg = {
            "proxy_request_id": params.get("proxy_request_id"),
            "registration_token": params.get("registration_token"),
            "kv_transfer_params": {
                "remote_engine_id": f"fake-decode-{self.port}",
                "remote_host": self.host,
                "remote_port": self.port,
                "remote_block_ids": [0, 1, 2],
                "remote_request_id": rid,
                "remote_tp_size": 1,
            },
        }
        deadline = time.monotonic() + self.register_timeout_s
        delay = 0.02
        last = "no attempt"
        while time.monotonic() < deadline:
            self.stats["register_attempts"] += 1
            try:
                async with self._session.post(params["metaserver"], data=_enc(msg), headers=_JSON) as r:
                    text = await r.read()
                    if r.status == 200:
                        self.stats["registered"] += 1
                        return None
                    last = f"HTTP {r.status}: {text[:200]!r}"
                    if r.status < 500:
                        break
            except (aiohttp.ClientError, TimeoutError) as e:
                last = repr(e)
            await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.5)
        self.stats["register_failed"] += 1
        return f"fake decode: registration failed: {last}"

    async def _claim(self, params: dict[str, Any]) -> dict[str, Any] | str:
        """Early dispatch: claim the decode's registration (the params), or why not."""
        assert self._session is not None
        msg = {"proxy_request_id": params.get("proxy_request_id"), "claim_token": params.get("claim_token")}
        self.stats["claim_attempts"] += 1
        try:
            async with self._session.post(params["claim_url"], data=_enc(msg), headers=_JSON) as r:
                text = await r.read()
                if r.status == 200:
                    self.stats["claimed"] += 1
                    return dict(_dec(text)["kv_transfer_params"])
                return f"fake prefill: claim failed: HTTP {r.status}: {text[:200]!r}"
        except (aiohttp.ClientError, TimeoutError) as e:
            return f"fake prefill: claim failed: {e!r}"

    async def _notify_decode(self, params: dict[str, Any]) -> None:
        assert self._session is not None
        url = f"http://{params['remote_host']}:{params['remote_port']}/_fake/kv_ready"
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with self._session.post(
                url, data=_enc({"remote_request_id": params.get("remote_request_id")}), headers=_JSON
            ) as r:
                await r.read()

    def _whole(self, body: dict[str, Any], chat: bool, rid: str, text: str, n: int) -> dict[str, Any]:
        usage = {"prompt_tokens": _prompt_tokens(body), "completion_tokens": n,
                 "total_tokens": _prompt_tokens(body) + n}
        if chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": "length"}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
            obj = "text_completion"
        out = {"id": f"cmpl-{rid}", "object": obj, "created": int(time.time()), "model": MODEL,
               "choices": [choice], "usage": usage}
        if self.role == "prefill":
            out["kv_transfer_params"] = {"prefill_done": True}
        return out

    async def _stream(
        self, request: web.Request, body: dict[str, Any], chat: bool, rid: str, cut_after: int = -1
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers=_SSE)
        await resp.prepare(request)
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        texts = expected_texts(body, self._n_chunks(body))
        base = {"id": f"cmpl-{rid}", "object": obj, "created": created, "model": MODEL}
        if chat:
            first = dict(base, choices=[{"index": 0, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}])
            await resp.write(b"data: " + _enc(first) + b"\n\n")
        last = len(texts) - 1
        for i, t in enumerate(texts):
            if i == cut_after:
                if request.transport is not None:
                    request.transport.abort()
                return resp
            finish = "length" if i == last else None
            if chat:
                choice: dict[str, Any] = {"index": 0, "delta": {"content": t}, "logprobs": None,
                                          "finish_reason": finish}
            else:
                choice = {"index": 0, "text": t, "logprobs": None, "finish_reason": finish}
            await resp.write(b"data: " + _enc(dict(base, choices=[choice])) + b"\n\n")
        opts = body.get("stream_options") or {}
        if opts.get("include_usage"):
            pt = _prompt_tokens(body)
            usage = {"prompt_tokens": pt, "completion_tokens": len(texts), "total_tokens": pt + len(texts)}
            await resp.write(b"data: " + _enc(dict(base, choices=[], usage=usage)) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


# ---------------------------------------------------------------------- process entry


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="fake prefill/decode OpenAI server")
    ap.add_argument("--role", choices=["prefill", "decode"], required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--fault", choices=list(FAULTS), default="none")
    ap.add_argument("--wait-kv", action="store_true")
    ap.add_argument("--kv-timeout-s", type=float, default=10.0)
    ap.add_argument("--register-timeout-s", type=float, default=10.0)
    ap.add_argument("--no-record", action="store_true", help="do not keep received bodies (benchmarks)")
    return ap


async def _serve(args: argparse.Namespace) -> None:
    fb = FakeBackend(
        args.role, args.host, args.port, args.chunks, args.fault, args.wait_kv,
        args.kv_timeout_s, args.register_timeout_s, record=not args.no_record,
    )
    port = await fb.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    sys.stdout.write(f"fake {args.role} ready on port {port}\n")
    sys.stdout.flush()
    try:
        await stop.wait()
    finally:
        await fb.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        import uvloop
    except ImportError:
        asyncio.run(_serve(args))
    else:
        uvloop.run(_serve(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
