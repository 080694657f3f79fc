"""Step 4 of the flow: the prefill request, sent once its decode registered (or, with
early dispatch, together with the decode request: it then carries a claim instead of
the registered params, see ``app.py``).

Its own module so the request flow in ``app.py`` stays readable; it shares the
failure rules stated there (connect errors move on to the next instance,
anything else aborts the sub-request through ``Pending.fail``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp

from proxy.backend import CONNECT_ERRORS, backend_headers, snippet
from proxy.balancer import Balancer, Instance
from proxy.errors import ProxyError
from proxy.metaserver import Pending
from proxy.metrics import ProxyMetrics

log = logging.getLogger("proxy")


async def send_prefill(
    p: Pending,
    params: dict[str, Any],
    session: aiohttp.ClientSession,
    prefillers: Balancer,
    metrics: ProxyMetrics,
    timeout_s: float,
) -> None:
    """Step 4: send the prefill with ``params`` (the registered ones, or a claim); on
    failure abort the sub-request with the error."""
    assert p.dispatched is not None
    dispatched = p.dispatched
    assert p.shared is not None
    payload = p.shared.prefill_payload(p.body, params)
    headers = backend_headers(p)
    tried: list[Instance] = []
    try:
        while True:
            inst = prefillers.pick(tried)
            if inst is None:
                names = ", ".join(i.name for i in tried)
                raise ProxyError(503, f"no prefill instance reachable (tried {names})", "prefill_down")
            tried.append(inst)
            Balancer.acquire(inst, p.weight)
            try:
                async with session.post(
                    inst.url + p.path, data=payload, headers=headers, trace_request_ctx=p
                ) as resp:
                    if not dispatched.done():
                        dispatched.set_result(True)
                    data = await resp.read()
                    if resp.status >= 300:
                        raise ProxyError(
                            502,
                            f"prefill {inst.name} answered HTTP {resp.status}: {snippet(data)}",
                            "prefill_status",
                        )
                if inst.down_until:
                    Balancer.mark_up(inst)
                return
            except CONNECT_ERRORS as e:
                prefillers.mark_down(inst)
                metrics.backend_error("prefill", "connect")
                log.warning("prefill %s unreachable: %s", inst.name, e)
                continue
            except TimeoutError:
                raise ProxyError(
                    504,
                    f"prefill {inst.name} did not answer within {timeout_s:g} s",
                    "prefill_timeout",
                ) from None
            except aiohttp.ClientError as e:
                raise ProxyError(
                    502, f"prefill {inst.name} failed: {type(e).__name__}: {e}", "prefill_error"
                ) from None
            finally:
                Balancer.release(inst, p.weight)
    except ProxyError as e:
        metrics.backend_error("prefill", e.kind)
        log.warning("request %s: %s", p.id, e.message)
        if not dispatched.done():
            dispatched.set_exception(e)
            dispatched.exception()
        p.fail(e)
    except asyncio.CancelledError:
        if not dispatched.done():
            dispatched.set_exception(ProxyError(404, f"request {p.id} was aborted", "aborted"))
            dispatched.exception()
        raise
