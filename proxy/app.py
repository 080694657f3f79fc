"""The proxy's HTTP side: routes, the decode-first flow and backend I/O.

One request (after fan-out, see ``bodies.py``) goes:

1. to the least-loaded decode, with ``do_remote_prefill`` and our metaserver URL;
2. the decode's connector POSTs ``/v1/metaserver`` with the request's
   registration token; we dispatch the prefill (``max_tokens=1``) to the
   least-loaded prefill and answer 200 once the prefill request is on the wire;
3. the decode's answer is relayed; a single stream byte for byte.

With ``prefill_dispatch="early"`` the prefill leaves in step 1, together with
the decode request, carrying a claim (``claim_url``, ``proxy_request_id``, a
``claim_token`` only it receives) instead of the registered params; its
connector POSTs ``/v1/metaserver/claim``, which answers with the params as soon
as the decode registered. The prefill's HTTP ingress then overlaps the decode's
ingress and registration instead of following them.

Why aiohttp for both sides: its client keeps one pool per (host, port) and
hands out idle connections from a deque (no scan over queued requests, which
is where an httpx/httpcore proxy spends most of its CPU), and its server has
a thinner per-request path than FastAPI/Starlette. The numbers behind this
choice are in ``docs/bench-proxy.md``.

Failure rules: a backend that refuses connections is skipped for a cooldown
and the next instance is tried (nothing was sent, so this is safe); any other
failure before the decode produced output aborts the sub-request (decode
connection closed, prefill request cancelled) and the client gets an
OpenAI-style JSON error: 503 nothing reachable, 502 a backend failed or
answered an error (or an answer a fan-out cannot merge), 504 a deadline
passed. What a client or a registering peer may cost (requests, body memory,
upload and read speed) is bounded in ``limits.py``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from proxy.backend import (
    CONNECT_ERRORS,
    JSON_HEADERS,
    JSON_TYPE,
    DecodeResponse,
    backend_headers,
    json_error,
    on_headers_sent,
    snippet,
    uncancel,
)
from proxy.balancer import Balancer, Instance
from proxy.bodies import (
    CHAT,
    COMPLETIONS,
    SegmentsPayload,
    SharedBody,
    SubRequest,
    claim_params,
    decode_params,
    split_request,
)
from proxy.config import ProxyConfig
from proxy.errors import ProxyError, sse_error_event
from proxy.limits import (
    MB,
    Admission,
    ClientStalled,
    finish_within,
    read_answer,
    read_body,
    respond,
    write_within,
)
from proxy.meta_routes import MetaserverRoutes
from proxy.metaserver import Pending, PendingTable
from proxy.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from proxy.metrics import ProxyMetrics
from proxy.prefill import send_prefill
from proxy.relay import SSESplitter, StreamMerger, merge_responses

log = logging.getLogger("proxy")

_decode = msgspec.json.decode
_encode = msgspec.json.encode

_SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


class Proxy:
    """Request handling; one instance per server (tests run several in one process)."""

    def __init__(self, cfg: ProxyConfig) -> None:
        self.cfg = cfg
        self.decoders = Balancer("decode", cfg.decoders, cfg.cooldown_s)
        self.prefillers = Balancer("prefill", cfg.prefillers, cfg.cooldown_s)
        self.pending = PendingTable(cfg.max_pending)
        self.admission = Admission(cfg.max_inflight, cfg.max_inflight_mb * MB, cfg.max_body_mb * MB)
        self.early = cfg.prefill_dispatch == "early"
        # No sub-stream of a fan-out stays silent longer than its own deadlines allow
        # (connects to each decode, the registration, the response head, a read); past
        # their sum the merge stops waiting: a backstop, so a lost sub-stream costs a 504.
        self.fanout_idle_s = (cfg.connect_timeout_s * len(cfg.decoders) + cfg.register_timeout_s
                              + 2 * cfg.timeout_s)
        self.metrics = ProxyMetrics([self.prefillers, self.decoders], lambda: len(self.pending))
        self.meta = MetaserverRoutes(cfg, self.pending, self.metrics, self._dispatch_prefill)
        self.meta_admission = self.meta.meta_admission
        self.claim_admission = self.meta.claim_admission
        self.metaserver_url = cfg.metaserver_url or ""
        self._id_prefix = secrets.token_hex(6)
        self._ids = itertools.count()
        self._bg: set[asyncio.Task[Any]] = set()
        self._dsession: aiohttp.ClientSession | None = None
        self._psession: aiohttp.ClientSession | None = None

    # ------------------------------------------------------------------ lifecycle

    def app(self, metaserver: bool = True) -> web.Application:
        """The public application; ``metaserver=False`` when registrations have their own listener."""
        app = web.Application(client_max_size=self.cfg.max_body_mb * MB)
        app.router.add_post(COMPLETIONS, self.handle_completions)
        app.router.add_post(CHAT, self.handle_chat)
        if metaserver:
            app.router.add_post("/v1/metaserver", self.meta.handle_metaserver)
            app.router.add_post("/v1/metaserver/claim", self.meta.handle_claim)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/metrics", self.handle_metrics)
        app.router.add_get("/v1/models", self.handle_models)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    def metaserver_app(self) -> web.Application:
        """Registrations only, for a listener on an internal interface (``--metaserver-port``)."""
        app = web.Application(client_max_size=self.cfg.registration_max_bytes)
        app.router.add_post("/v1/metaserver", self.meta.handle_metaserver)
        app.router.add_post("/v1/metaserver/claim", self.meta.handle_claim)
        return app

    def _connector(self) -> aiohttp.TCPConnector:
        return aiohttp.TCPConnector(
            limit=0,
            limit_per_host=self.cfg.max_connections,
            keepalive_timeout=self.cfg.keepalive_s,
            ttl_dns_cache=None,
        )

    async def _startup(self, app: web.Application) -> None:
        cfg = self.cfg
        self._dsession = aiohttp.ClientSession(
            connector=self._connector(),
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=cfg.connect_timeout_s, sock_read=cfg.timeout_s
            ),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )
        trace = aiohttp.TraceConfig()
        trace.on_request_headers_sent.append(on_headers_sent)
        self._psession = aiohttp.ClientSession(
            connector=self._connector(),
            timeout=aiohttp.ClientTimeout(total=cfg.timeout_s, sock_connect=cfg.connect_timeout_s),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
            trace_configs=[trace],
        )

    async def _cleanup(self, app: web.Application) -> None:
        for t in list(self._bg):
            t.cancel()
        if self._bg:
            await asyncio.gather(*self._bg, return_exceptions=True)
        for s in (self._dsession, self._psession):
            if s is not None:
                await s.close()

    def _next_id(self) -> str:
        return f"{self._id_prefix}-{next(self._ids)}"

    # ------------------------------------------------------------------ routes

    async def handle_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle_generate(request, COMPLETIONS)

    async def handle_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle_generate(request, CHAT)

    async def handle_health(self, request: web.Request) -> web.Response:
        body = {
            "status": "ok",
            "pending": len(self.pending),
            "inflight_requests": self.admission.requests,
            "inflight_body_bytes": self.admission.bytes,
            "inflight_registrations": self.meta_admission.requests,
            "inflight_registration_bytes": self.meta_admission.bytes,
            "inflight_claims": self.claim_admission.requests,
            "prefillers": self.prefillers.snapshot(),
            "decoders": self.decoders.snapshot(),
        }
        return web.Response(body=_encode(body), headers=JSON_HEADERS)

    async def handle_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def handle_models(self, request: web.Request) -> web.Response:
        assert self._dsession is not None
        tried: list[Instance] = []
        while (inst := self.decoders.pick(tried)) is not None:
            tried.append(inst)
            try:
                auth = request.headers.get("Authorization")
                headers = {"Authorization": auth} if auth else None
                async with self._dsession.get(inst.url + "/v1/models", headers=headers) as resp:
                    data = await resp.read()
                    return web.Response(
                        status=resp.status,
                        body=data,
                        headers={"Content-Type": resp.headers.get("Content-Type", JSON_TYPE)},
                    )
            except CONNECT_ERRORS:
                self.decoders.mark_down(inst)
            except (aiohttp.ClientError, TimeoutError) as e:
                return json_error(ProxyError(502, f"decode {inst.name} failed: {e!r}"))
        return json_error(ProxyError(503, "no decode instance reachable"))

    def _dispatch_prefill(self, p: Pending, params: dict[str, Any]) -> None:
        """Step 4 as a task of its own: the prefill's answer is awaited apart from the client's."""
        loop = asyncio.get_running_loop()
        p.dispatched = loop.create_future()
        assert self._psession is not None
        task = loop.create_task(
            send_prefill(p, params, self._psession, self.prefillers, self.metrics, self.cfg.timeout_s)
        )
        p.prefill_task = task
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    # ------------------------------------------------------------------ generate

    async def _handle_generate(self, request: web.Request, path: str) -> web.StreamResponse:
        t0 = time.perf_counter()
        status = 500
        reserved: int | None = None
        try:
            reserved = self.admission.enter(request.content_length)
            raw = await read_body(request, self.cfg.max_body_mb * MB, self.cfg.body_timeout_s)
            try:
                body = _decode(raw)
            except msgspec.DecodeError as e:
                raise ProxyError(400, f"invalid request: body is not valid JSON: {e}", "bad_request") from None
            del raw
            subs = split_request(body, path, self.cfg.max_fanout)
            self.pending.room(len(subs))
            shared = SharedBody(body, path)
            stream = body.get("stream") is True
            if len(subs) == 1:
                resp = await self._single(request, path, subs[0], shared, stream)
            else:
                resp = await self._fanout(request, path, subs, shared, stream)
            status = resp.status
            return resp
        except ProxyError as e:
            status = e.status
            if e.status >= 500:
                log.warning("%s %s: %s", path, e.status, e.message)
            return json_error(e)
        except ClientStalled as e:
            status = 499
            log.warning("%s: %s; connection closed", path, e)
            raise asyncio.CancelledError from None  # the connection is gone: nothing to answer
        except asyncio.CancelledError:
            status = 499  # client went away
            raise
        finally:
            if reserved is not None:
                self.admission.leave(reserved)
            self.metrics.request(path, status)
            self.metrics.latency.observe(time.perf_counter() - t0)

    def _new_pending(self, path: str, sub: SubRequest, shared: SharedBody, auth: str | None) -> Pending:
        p = Pending(self._next_id(), path, sub.body, sub.weight)
        p.auth = auth
        p.shared = shared
        p.owner = asyncio.current_task()
        self.pending.add(p)
        loop = asyncio.get_running_loop()
        if self.early:
            p.claim_token = secrets.token_urlsafe(24)
            p.registered_params = loop.create_future()
        p.arm_deadline(loop, self.cfg.register_timeout_s)
        return p

    def _end(self, p: Pending, d: DecodeResponse | None, ok: bool) -> None:
        """Release everything a sub-request holds; on failure abort both backends."""
        self.pending.finish(p)
        if d is not None:
            d.close(ok)
        t = p.prefill_task
        if t is not None and not t.done() and not ok:
            t.cancel()  # closes the prefill connection: vLLM aborts the request

    async def _open_decode(self, path: str, payload: SegmentsPayload, headers: dict[str, str]) -> DecodeResponse:
        assert self._dsession is not None
        tried: list[Instance] = []
        while True:
            inst = self.decoders.pick(tried)
            if inst is None:
                names = ", ".join(i.name for i in tried)
                raise ProxyError(503, f"no decode instance reachable (tried {names})", "decode_down")
            tried.append(inst)
            Balancer.acquire(inst)
            try:
                resp = await self._dsession.post(inst.url + path, data=payload, headers=headers)
            except CONNECT_ERRORS as e:
                Balancer.release(inst)
                self.decoders.mark_down(inst)
                self.metrics.backend_error("decode", "connect")
                log.warning("decode %s unreachable: %s", inst.name, e)
                continue
            except BaseException:
                Balancer.release(inst)
                raise
            if inst.down_until:
                Balancer.mark_up(inst)
            return DecodeResponse(resp, inst)

    async def _begin(self, p: Pending, stream: bool) -> DecodeResponse:
        """Forward to a decode and wait for its first output (or its whole answer)."""
        assert p.shared is not None
        payload = p.shared.decode_payload(p.body, decode_params(self.metaserver_url, p.id, p.token))
        if p.claim_token is not None:  # early dispatch: the prefill leaves with the decode request
            self._dispatch_prefill(p, claim_params(self.metaserver_url + "/claim", p.id, p.claim_token))
        d: DecodeResponse | None = None
        try:
            d = await self._open_decode(p.path, payload, backend_headers(p))
            if stream and d.status == 200:
                d.data = await d.resp.content.readany()
                if not d.data:
                    raise ProxyError(
                        502, f"decode {d.inst.name} ended the stream without data", "decode_eof"
                    )
            else:
                d.data = await read_answer(d.resp.content, self.cfg.max_answer_mb * MB, d.inst.name)
            p.started = True
            p.disarm_deadline()
            return d
        except asyncio.CancelledError:
            if d is not None:
                d.close(False)
            if p.error is None:
                raise  # the client went away
            uncancel()
            raise p.error from None
        except ProxyError:
            if d is not None:
                d.close(False)
            raise
        except TimeoutError:
            if d is not None:
                d.close(False)
            self.metrics.backend_error("decode", "timeout")
            raise ProxyError(
                504, f"decode did not answer within {self.cfg.timeout_s:g} s", "decode_timeout"
            ) from None
        except aiohttp.ClientError as e:
            name = d.inst.name if d is not None else "?"
            if d is not None:
                d.close(False)
            self.metrics.backend_error("decode", "error")
            raise ProxyError(502, f"decode {name} failed: {type(e).__name__}: {e}", "decode_error") from None

    async def _single(
        self, request: web.Request, path: str, sub: SubRequest, shared: SharedBody, stream: bool
    ) -> web.StreamResponse:
        p = self._new_pending(path, sub, shared, request.headers.get("Authorization"))
        d: DecodeResponse | None = None
        ok = False
        wt = self.cfg.write_timeout_s
        try:
            d = await self._begin(p, stream)
            if not stream or d.status != 200:
                ok = d.status == 200
                return await respond(request, d.status, d.data, d.ctype, wt)
            # Relayed as is: the decode's own content type, its bytes untouched.
            headers = dict(_SSE_HEADERS)
            headers["Content-Type"] = d.ctype
            out = web.StreamResponse(status=200, headers=headers)
            await out.prepare(request)
            await write_within(request, out, d.data, wt)
            content = d.resp.content
            while True:
                # Only reads are guarded: a failed write is the client's side
                # (aiohttp reports it as a ClientError too) and must propagate.
                try:
                    chunk = await content.readany()
                except (aiohttp.ClientError, TimeoutError) as e:
                    self.metrics.backend_error("decode", "stream_broken")
                    log.warning("decode %s broke the stream of %s: %r", d.inst.name, p.id, e)
                    err = sse_error_event(502, f"decode {d.inst.name} failed mid-stream: {e!r}")
                    await write_within(request, out, err, wt)
                    break
                if not chunk:
                    ok = True
                    break
                await write_within(request, out, chunk, wt)
            await finish_within(request, out, wt)
            return out
        finally:
            self._end(p, d, ok)

    # ------------------------------------------------------------------ fan-out

    async def _sub_whole(self, path: str, sub: SubRequest, shared: SharedBody, auth: str | None) -> DecodeResponse:
        p = self._new_pending(path, sub, shared, auth)
        d: DecodeResponse | None = None
        try:
            d = await self._begin(p, stream=False)
            return d
        finally:
            self._end(p, d, d is not None and d.status == 200)

    async def _sub_stream(
        self,
        path: str,
        sub: SubRequest,
        shared: SharedBody,
        auth: str | None,
        queue: asyncio.Queue[tuple[str, SubRequest, Any]],
    ) -> None:
        """Feed one sub-stream into the bounded ``queue``; a full queue pauses this decode's reads.

        Every path but cancellation ends with an ``end`` item (after a ``fail`` or
        ``answer`` one when it did not succeed), including a registry that refuses the
        sub-request: the merge counts ``end`` items to know when it is done. Cancelled
        only once the merging side is gone, so nothing is queued then.
        """
        p: Pending | None = None
        d: DecodeResponse | None = None
        ok = False
        last: tuple[str, SubRequest, Any] | None = None
        try:
            p = self._new_pending(path, sub, shared, auth)
            d = await self._begin(p, stream=True)
            if d.status != 200:
                last = ("answer", sub, d)
            else:
                await queue.put(("data", sub, d.data))
                content = d.resp.content
                while chunk := await content.readany():
                    await queue.put(("data", sub, chunk))
                ok = True
        except ProxyError as e:
            last = ("fail", sub, e)
        except (aiohttp.ClientError, TimeoutError) as e:
            self.metrics.backend_error("decode", "stream_broken")
            last = ("fail", sub, ProxyError(502, f"decode failed mid-stream: {e!r}"))
        except Exception as e:  # a bug here must still end the merge, not hang it
            log.exception("request %s: sub-stream failed", p.id if p is not None else "?")
            last = ("fail", sub, ProxyError(500, f"proxy error in a sub-stream: {e!r}"))
        finally:
            if p is not None:
                self._end(p, d, ok)
        if last is not None:
            await queue.put(last)
        await queue.put(("end", sub, None))

    async def _fanout(
        self, request: web.Request, path: str, subs: list[SubRequest], shared: SharedBody, stream: bool
    ) -> web.StreamResponse:
        rid = ("chatcmpl-" if path == CHAT else "cmpl-") + self._next_id()
        auth = request.headers.get("Authorization")
        loop = asyncio.get_running_loop()
        wt = self.cfg.write_timeout_s
        if not stream:
            tasks = [loop.create_task(self._sub_whole(path, s, shared, auth)) for s in subs]
            try:
                results: list[DecodeResponse] = await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            for d in results:
                if d.status != 200:
                    return await respond(request, d.status, d.data, d.ctype, wt)
            try:
                merged = merge_responses(
                    [(s.index, s.first_of_prompt, d.data) for s, d in zip(subs, results, strict=True)], rid
                )
            except (msgspec.DecodeError, ValueError, TypeError) as e:  # a peer's message: this request fails
                self.metrics.backend_error("decode", "malformed")
                raise ProxyError(502, f"decode answered malformed JSON: {e}", "decode_malformed") from None
            del results
            return await respond(request, 200, merged, JSON_TYPE, wt)

        queue: asyncio.Queue[tuple[str, SubRequest, Any]] = asyncio.Queue(self.cfg.fanout_queue)
        stream_tasks = [loop.create_task(self._sub_stream(path, s, shared, auth, queue))
                        for s in subs]
        max_event = self.cfg.max_answer_mb * MB
        splitters = {id(s): SSESplitter(max_event) for s in subs}
        merger = StreamMerger(rid)
        out: web.StreamResponse | None = None
        remaining = len(subs)
        try:
            while remaining:
                if queue.empty():
                    try:
                        async with asyncio.timeout(self.fanout_idle_s):
                            kind, sub, value = await queue.get()
                    except TimeoutError:
                        err = ProxyError(
                            504, f"no sub-request of the fan-out produced anything within "
                            f"{self.fanout_idle_s:g} s", "fanout_timeout"
                        )
                        return await self._fanout_failed(request, out, rid, err)
                else:
                    kind, sub, value = queue.get_nowait()
                if kind == "end":
                    remaining -= 1
                    # An event the decode ended without its blank line is still an event.
                    events = splitters[id(sub)].finish()
                    if not events:
                        continue
                elif kind == "answer":  # a decode refused the request: relay its answer
                    if out is None:
                        return await respond(request, value.status, value.data, value.ctype, wt)
                    value = ProxyError(502, f"decode answered HTTP {value.status}: {snippet(value.data)}")
                    kind = "fail"
                if kind == "fail":
                    return await self._fanout_failed(request, out, rid, value)
                try:
                    if kind == "data":
                        events = splitters[id(sub)].feed(value)
                    parts = [merger.rewrite(e, sub.index, sub.first_of_prompt) for e in events]
                except (msgspec.DecodeError, ValueError, TypeError) as e:
                    # A peer's message: it fails this request alone.
                    self.metrics.backend_error("decode", "malformed")
                    err = ProxyError(502, f"decode sent a malformed stream chunk: {e}", "decode_malformed")
                    return await self._fanout_failed(request, out, rid, err)
                data = b"".join(x for x in parts if x)
                if out is None:
                    out = web.StreamResponse(status=200, headers=_SSE_HEADERS)
                    await out.prepare(request)
                if data:
                    await write_within(request, out, data, wt)
            if out is None:
                raise ProxyError(502, "decode streams ended without data", "decode_eof")
            await write_within(request, out, merger.finish(), wt)
            await finish_within(request, out, wt)
            return out
        finally:
            for st in stream_tasks:
                st.cancel()
            await asyncio.gather(*stream_tasks, return_exceptions=True)

    async def _fanout_failed(
        self, request: web.Request, out: web.StreamResponse | None, rid: str, err: ProxyError
    ) -> web.StreamResponse:
        """End a fan-out with ``err``: its JSON answer before any output, else an SSE error event.

        Before output the error propagates to ``_handle_generate``, which logs it;
        after, it is logged here.
        """
        if out is None:
            raise err
        log.warning("request %s: %s", rid, err.message)
        wt = self.cfg.write_timeout_s
        await write_within(request, out, sse_error_event(err.status, err.message), wt)
        await finish_within(request, out, wt)
        return out
