"""The metaserver routes: decodes register (``/v1/metaserver``), early-dispatched
prefills claim those registrations (``/v1/metaserver/claim``).

Their own module because they are the proxy's one inbound peer protocol besides
clients: each has an admission budget of its own (neither a flood of
registrations nor waiting claims can refuse the other, nor client requests),
and every input is parsed into ``registration.py``'s schemas before use.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from proxy.backend import JSON_HEADERS, json_error
from proxy.config import ProxyConfig
from proxy.errors import ProxyError
from proxy.limits import MB, Admission, read_body
from proxy.metaserver import Pending, PendingTable
from proxy.metrics import ProxyMetrics
from proxy.registration import (
    CLAIM_MAX_BYTES,
    parse_claim,
    parse_envelope,
    parse_params,
    token_matches,
)

log = logging.getLogger("proxy")

_encode = msgspec.json.encode
_DISPATCHED = _encode({"status": "dispatched"})
_REGISTERED = _encode({"status": "registered"})


class MetaserverRoutes:
    """Registration and claim handling over the proxy's table of pending sub-requests."""

    def __init__(self, cfg: ProxyConfig, pending: PendingTable, metrics: ProxyMetrics,
                 dispatch: Callable[[Pending, dict[str, Any]], None]) -> None:
        """``dispatch``: sends a registered request's prefill (the proxy's step 4)."""
        self.cfg = cfg
        self.pending = pending
        self.metrics = metrics
        self._dispatch = dispatch
        # Registrations on a budget of their own (a decode retries the 503 it gets when
        # full): at most one per registry entry in flight, bodies of a legitimate size.
        self.meta_admission = Admission(cfg.max_pending, cfg.max_inflight_mb * MB, cfg.registration_max_bytes,
                                        what="registration", busy_status=503)
        # Claims wait until their decode registers: a budget apart from registrations,
        # so waiting claims can never refuse the registrations that end them.
        self.claim_admission = Admission(cfg.max_pending, cfg.max_inflight_mb * MB, CLAIM_MAX_BYTES,
                                         what="claim", busy_status=503)

    async def handle_metaserver(self, request: web.Request) -> web.Response:
        """Step 3: a decode registers; dispatch the prefill, 200 once it is on the wire
        (early dispatch: the prefill is already on its way; 200 once the params are
        stored for its claim).

        Checked in this order, each a final answer: admission (503 with Retry-After,
        413 above ``registration_max_bytes``), the body's deadline (408), the
        envelope's shape (400), the request id (404), the token (403, constant-time),
        then the params (400).
        """
        return await self._admitted(self.meta_admission, request, self._registration, self._meta_reject)

    async def _registration(self, request: web.Request) -> web.Response:
        try:
            raw = await read_body(request, self.cfg.registration_max_bytes, self.cfg.body_timeout_s)
            env = parse_envelope(raw)
        except ProxyError as e:
            return self._meta_reject(e, "malformed")
        del raw
        p = self.pending.get(env.proxy_request_id)
        if p is None:
            self.metrics.registration("unknown")
            return json_error(
                ProxyError(404, f"metaserver: unknown or finished proxy_request_id {env.proxy_request_id!r}")
            )
        if not token_matches(p.token, env.registration_token):
            return self._meta_reject(
                ProxyError(403, f"metaserver: wrong registration_token for {p.id!r}", "forbidden"), "forbidden"
            )
        first = p.params is None  # else a retry after a lost answer: idempotent
        if first:
            try:
                p.params = msgspec.to_builtins(parse_params(env))
            except ProxyError as e:
                return self._meta_reject(e, "malformed")
            p.disarm_deadline()  # from here the prefill's own deadline applies
        assert p.params is not None
        if p.registered_params is not None:  # early dispatch: the prefill claims the params
            if first:
                p.registered_params.set_result(p.params)
            self.metrics.registration("registered" if first else "duplicate")
            return web.Response(body=_REGISTERED, headers=JSON_HEADERS)
        if first:
            self._dispatch(p, p.params)
        result = "dispatched" if first else "duplicate"
        assert p.dispatched is not None  # set by the dispatch
        try:
            await asyncio.shield(p.dispatched)
        except ProxyError as e:
            self.metrics.registration("failed")
            return json_error(e)
        self.metrics.registration(result)
        return web.Response(body=_DISPATCHED, headers=JSON_HEADERS)

    def _meta_reject(self, err: ProxyError, result: str) -> web.Response:
        log.warning("%s", err.message)
        self.metrics.registration(result)
        return json_error(err)

    async def handle_claim(self, request: web.Request) -> web.Response:
        """Early dispatch: a prefill claims its decode's registration; answered once it exists.

        Checked in this order, each a final answer: admission (503 with Retry-After,
        413 above ``CLAIM_MAX_BYTES``), the body's deadline (408), the envelope (400),
        the request id (404), a request not dispatched early (409), the token (403,
        constant-time). The wait ends with the params (200), the request's end (404:
        its decode never registered, or the client left) or ``register_timeout_s`` (504).
        """
        return await self._admitted(self.claim_admission, request, self._claim, self._claim_reject)

    @staticmethod
    async def _admitted(
        admission: Admission,
        request: web.Request,
        serve: Callable[[web.Request], Awaitable[web.Response]],
        reject: Callable[[ProxyError, str], web.Response],
    ) -> web.Response:
        """``serve`` within ``admission``'s budget; a refusal goes to ``reject`` (503 is
        ``overloaded``, 413 ``malformed``), and the budget is given back on every path."""
        try:
            reserved = admission.enter(request.content_length)
        except ProxyError as e:
            return reject(e, "overloaded" if e.status == 503 else "malformed")
        try:
            return await serve(request)
        finally:
            admission.leave(reserved)

    async def _claim(self, request: web.Request) -> web.Response:
        try:
            env = parse_claim(await read_body(request, CLAIM_MAX_BYTES, self.cfg.body_timeout_s))
        except ProxyError as e:
            return self._claim_reject(e, "malformed")
        p = self.pending.get(env.proxy_request_id)
        if p is None:
            self.metrics.claim("unknown")
            return json_error(
                ProxyError(404, f"metaserver: unknown or finished proxy_request_id {env.proxy_request_id!r}")
            )
        if p.claim_token is None or p.registered_params is None:
            return self._claim_reject(
                ProxyError(409, f"metaserver: request {p.id!r} was not dispatched early; nothing to claim",
                           "conflict"), "conflict"
            )
        if not token_matches(p.claim_token, env.claim_token):
            return self._claim_reject(
                ProxyError(403, f"metaserver: wrong claim_token for {p.id!r}", "forbidden"), "forbidden"
            )
        try:
            async with asyncio.timeout(self.cfg.register_timeout_s):
                params = await asyncio.shield(p.registered_params)
        except TimeoutError:
            self.metrics.claim("timeout")
            return json_error(ProxyError(
                504, f"metaserver: the decode of {p.id!r} did not register within "
                f"{self.cfg.register_timeout_s:g} s", "register_timeout"
            ))
        except ProxyError as e:
            self.metrics.claim("finished")
            return json_error(e)
        self.metrics.claim("ok")
        return web.Response(body=_encode({"kv_transfer_params": params}), headers=JSON_HEADERS)

    def _claim_reject(self, err: ProxyError, result: str) -> web.Response:
        log.warning("%s", err.message)
        self.metrics.claim(result)
        return json_error(err)
