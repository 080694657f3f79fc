"""Prefill-first dispatch (``dispatch: prefill_first``): prefill and decode at once.

The decode-first flow sends the prefill only once the decode registered, so the
prefill's HTTP ingress runs after the decode's. Here the proxy sends both at the
same time:

1. the decode gets the same ``kv_transfer_params`` as in decode-first (the
   metaserver URL, the id, its registration token);
2. the prefill gets a *fetch ticket* instead of a registration:
   ``{"do_remote_decode": true, "do_remote_prefill": false, "metaserver": <url>,
   "proxy_request_id": <id>, "registration_token": <a second token, the
   prefill's>}`` and computes at once;
3. the decode's ``POST /v1/metaserver`` is answered 200 ``{"status":
   "registered"}`` as soon as its params are stored (nothing is dispatched);
4. each prefill worker rank fetches the params with a long-poll
   ``GET /v1/metaserver?proxy_request_id=<id>`` carrying its token in the
   ``X-Registration-Token`` header (:func:`handle_fetch`).

The fetch answers, in order: 400 no or oversized id / token; 404 unknown or
finished id; 403 wrong token (constant-time); 503 with ``Retry-After: 1`` when
``MAX_FETCHERS`` already wait for this id; 200 with the registration (the decode's
params, as parsed at the boundary) once it is here; 504 when it did not come
within ``register_timeout_s`` (the prefill retries until its own deadline); 404
when the request ends meanwhile. Waiters are bounded (``MAX_FETCHERS`` per entry,
entries by ``max_pending``) and every wait ends with its entry or its deadline.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from proxy.backend import JSON_HEADERS, json_error
from proxy.errors import ProxyError
from proxy.metaserver import Pending
from proxy.prefill import send_prefill
from proxy.registration import Envelope, parse_params, token_matches

if TYPE_CHECKING:
    from proxy.app import Proxy

log = logging.getLogger("proxy")

TOKEN_HEADER = "X-Registration-Token"
# Concurrent fetches of one request: one per prefill TP rank.
MAX_FETCHERS = 64
_MAX_ID = 512
_REGISTERED = msgspec.json.encode({"status": "registered"})


def start_prefill(proxy: Proxy, p: Pending) -> None:
    """Step 2: send the prefill now, with a fetch ticket; failures abort ``p`` (send_prefill)."""
    p.fetch_token = secrets.token_urlsafe(24)
    p.params = {
        "metaserver": proxy.metaserver_url,
        "proxy_request_id": p.id,
        "registration_token": p.fetch_token,
    }
    loop = asyncio.get_running_loop()
    p.dispatched = loop.create_future()
    assert proxy._psession is not None
    task = loop.create_task(
        send_prefill(p, proxy._psession, proxy.prefillers, proxy.metrics, proxy.cfg.timeout_s)
    )
    p.prefill_task = task
    proxy._bg.add(task)
    task.add_done_callback(proxy._bg.discard)


def record_registration(proxy: Proxy, p: Pending, env: Envelope) -> web.Response:
    """Step 3: the decode registered (token already checked); store its params for the fetch."""
    if p.registration is None:
        try:
            params = parse_params(env)
        except ProxyError as e:
            return proxy._meta_reject(e, "malformed")
        p.disarm_deadline()  # from here the prefill's and the decode's own deadlines apply
        p.registration = msgspec.json.encode(params)
        if p.on_registered is not None and not p.on_registered.done():
            p.on_registered.set_result(p.registration)
        result = "registered"
    else:
        result = "duplicate"  # a retry after a lost answer: idempotent
    proxy.metrics.registration(result)
    return web.Response(body=_REGISTERED, headers=JSON_HEADERS)


async def handle_fetch(proxy: Proxy, request: web.Request) -> web.Response:
    """Step 4: a prefill rank fetches the decode's registration (long-poll)."""
    rid = request.query.get("proxy_request_id", "")
    token = request.headers.get(TOKEN_HEADER, "")
    if not (0 < len(rid) <= _MAX_ID and 0 < len(token) <= _MAX_ID):
        return _reject(proxy, ProxyError(400, "metaserver fetch: needs proxy_request_id and "
                                         f"{TOKEN_HEADER} of 1..{_MAX_ID} characters", "malformed"),
                       "malformed")
    p = proxy.pending.get(rid)
    if p is None:
        proxy.metrics.fetch("unknown")
        return json_error(ProxyError(404, f"metaserver fetch: unknown or finished proxy_request_id {rid!r}"))
    if p.fetch_token is None or not token_matches(p.fetch_token, token):
        return _reject(proxy, ProxyError(403, f"metaserver fetch: wrong token for {rid!r}", "forbidden"),
                       "forbidden")
    if p.registration is None:
        if p.fetchers >= MAX_FETCHERS:
            return _reject(proxy, ProxyError(503, f"metaserver fetch: {p.fetchers} fetches of {rid!r} "
                                             "already wait", "overloaded", retry_after=1), "overloaded")
        if p.on_registered is None:
            p.on_registered = asyncio.get_running_loop().create_future()
        p.fetchers += 1
        try:
            async with asyncio.timeout(proxy.cfg.register_timeout_s):
                await asyncio.shield(p.on_registered)
        except TimeoutError:
            proxy.metrics.fetch("timeout")
            return json_error(ProxyError(504, f"metaserver fetch: {rid!r} not registered within "
                                         f"{proxy.cfg.register_timeout_s:g} s", "register_timeout"))
        except ProxyError as e:  # the request ended
            proxy.metrics.fetch("finished")
            return json_error(e)
        finally:
            p.fetchers -= 1
    assert p.registration is not None
    proxy.metrics.fetch("answered")
    return web.Response(body=p.registration, headers=JSON_HEADERS)


def _reject(proxy: Proxy, err: ProxyError, result: str) -> web.Response:
    log.warning("%s", err.message)
    proxy.metrics.fetch(result)
    return json_error(err)
