"""Decode -> proxy metaserver registration, with retries and one deadline.

The decode scheduler tells the proxy where prefill should send readiness
(``POST /v1/metaserver`` with ``proxy_request_id``, the ``registration_token``
the proxy handed this decode in the request's ``kv_transfer_params``, and
``kv_transfer_params``);
the proxy then dispatches the prefill. A proxy restart or a brief network
blip must not lose the request, so connection errors and 5xx are retried with
capped exponential backoff; a 4xx (unknown id, malformed body) is final. The
whole exchange has a deadline that becomes a :class:`RegistrationError`, never
a hang (invariant I5). :class:`Registrar` runs registrations off the
scheduler thread.

:class:`DecodeRegistration` is what decode registers and prefill receives back
(the proxy passes it through untouched, adding ``do_remote_decode`` /
``do_remote_prefill``): one typed struct on both sides, its field names the
JSON keys of the wire format.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from collections.abc import Mapping
from typing import Annotated, Any

import httpx
import msgspec

from ascend_offload.errors import AscendOffloadError

log = logging.getLogger(__name__)


class RegistrationError(AscendOffloadError, RuntimeError):
    """The metaserver refused the registration or did not accept it before the deadline."""


class ParamsError(AscendOffloadError, ValueError):
    """A request's ``kv_transfer_params`` are not a valid decode registration."""


_Count = Annotated[int, msgspec.Meta(ge=0)]
_Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
# Keys the proxy adds next to the registered ones when it dispatches the prefill.
ROLE_FLAGS = ("do_remote_decode", "do_remote_prefill")


class DecodeRegistration(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Decode's endpoint and destination blocks for one request (decode -> proxy -> prefill).

    Why typed: both sides used to build and read loose dicts, so a renamed or
    mistyped key surfaced only as a decode timeout. Unknown keys and wrong types
    are rejected where prefill parses them (:meth:`from_params`).
    """

    remote_engine_id: str = ""
    remote_host: str
    remote_port: _Port  # decode's kv_port; rank ports follow (topology.decode_port)
    remote_tp_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    remote_dp_rank: _Count = 0
    remote_request_id: str  # decode's request id: the name on the P/D wire
    remote_block_ids: list[_Count]  # decode blocks, one per prompt block from the offset
    remote_block_offset: _Count = 0  # prefill block index of remote_block_ids[0]
    # ``backend/protocol`` decode reads with (e.g. "memfabric/sdma", "mooncake/tcp"):
    # prefill serves a request only when it is its own (ProtocolGuard).
    transfer_protocol: Annotated[str, msgspec.Meta(max_length=64)] = ""

    def to_wire(self) -> dict[str, Any]:
        """The JSON object registered with the metaserver."""
        return msgspec.to_builtins(self)

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> DecodeRegistration:
        """Parse prefill's ``kv_transfer_params`` (registered keys + the proxy's role flags)."""
        body = {k: v for k, v in params.items() if k not in ROLE_FLAGS}
        try:
            return msgspec.convert(body, cls)
        except msgspec.ValidationError as exc:
            raise ParamsError(f"kv_transfer_params of a remote decode: {exc}") from None


class ProtocolGuard:
    """Prefill's check that a decode reads with this prefill's transfer protocol.

    Why: MemFabric's two ends must use the same data-op type (and Mooncake the same
    transport); a mismatched pair would fail every read of the request, after decode
    already waited for it. The request is refused at once instead (decode recomputes),
    logged once per distinct advertised protocol (a bounded set: a peer choosing new
    strings cannot grow it, nor the log, without limit)."""

    MAX_LOGGED = 64

    def __init__(self, mine: str) -> None:
        self.mine = mine
        self.refused = 0
        self._logged: set[str] = set()

    def refuse(self, reg: DecodeRegistration) -> str | None:
        """Why ``reg``'s request cannot be served (None: same protocol)."""
        if reg.transfer_protocol == self.mine:
            return None
        self.refused += 1
        why = (f"decode {reg.remote_host}:{reg.remote_port} reads with transfer protocol "
               f"{reg.transfer_protocol or '(none advertised)'!r}, this prefill serves {self.mine!r}")
        if reg.transfer_protocol not in self._logged and len(self._logged) < self.MAX_LOGGED:
            self._logged.add(reg.transfer_protocol)
            log.error("remote-d2h: %s; its requests are refused (decode recomputes them). "
                      "Set the same transfer_backend / *_protocol on both sides", why)
        return why


MIN_ATTEMPT_S = 0.05  # the shortest timeout an attempt is given


def register(
    url: str,
    proxy_request_id: str,
    kv_transfer_params: DecodeRegistration | Mapping[str, Any],
    *,
    registration_token: str | None = None,
    timeout_s: float = 30.0,
    retries: int = 5,
    backoff_s: float = 0.05,
    max_backoff_s: float = 2.0,
    client: httpx.Client | None = None,
) -> dict[str, Any]:
    """POST one registration; return the metaserver's JSON answer (e.g. ``{"status": "dispatched"}``).

    Retries transport errors and 5xx with backoff until ``retries`` or ``timeout_s``
    (at least one attempt is made; an attempt is given at least ``MIN_ATTEMPT_S``, so the
    deadline may be overrun by that much)."""
    if not url.startswith(("http://", "https://")):
        raise RegistrationError(f"metaserver={url!r}: must be an http(s) URL")
    if not proxy_request_id:
        raise RegistrationError("proxy_request_id is empty")
    params = (kv_transfer_params.to_wire() if isinstance(kv_transfer_params, DecodeRegistration)
              else dict(kv_transfer_params))
    body: dict[str, Any] = {"proxy_request_id": proxy_request_id}
    if registration_token is not None:  # the proxy requires it: proof this decode got the request
        body["registration_token"] = registration_token
    body["kv_transfer_params"] = params
    own = client is None
    http = client or httpx.Client()
    deadline = time.monotonic() + timeout_s
    last = "no attempt made"
    attempts = 0
    try:
        for attempt in range(retries + 1):
            left = deadline - time.monotonic()
            if left <= 0 and attempts:
                break
            attempts += 1
            try:
                # the first attempt is always made (a loaded host may use up a short
                # deadline before it): its error, not "no attempt", is what the caller needs
                resp = http.post(url, json=body, timeout=max(left, MIN_ATTEMPT_S))
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                if resp.status_code == 200:
                    try:
                        data = resp.json()
                    except ValueError:
                        data = {}
                    return data if isinstance(data, dict) else {"answer": data}
                if resp.status_code < 500:
                    raise RegistrationError(
                        f"metaserver {url} refused proxy_request_id={proxy_request_id!r}: "
                        f"HTTP {resp.status_code} {resp.text[:200]}"
                    )
                last = f"HTTP {resp.status_code} {resp.text[:200]}"
            if attempt < retries:
                pause = min(backoff_s * (2 ** attempt), max_backoff_s, max(0.0, deadline - time.monotonic()))
                log.warning("metaserver registration of %r failed (%s); retry %d/%d in %.2fs",
                            proxy_request_id, last, attempt + 1, retries, pause)
                time.sleep(pause)
        raise RegistrationError(
            f"metaserver {url}: registration of proxy_request_id={proxy_request_id!r} failed after "
            f"{attempts} attempt(s) within {timeout_s:.1f}s: {last}"
        )
    finally:
        if own:
            http.close()


class Registrar:
    """Runs registrations on background threads; the scheduler polls results without blocking."""

    def __init__(self, *, timeout_s: float = 30.0, retries: int = 5, max_workers: int = 4) -> None:
        self.timeout_s = timeout_s
        self.retries = retries
        self._pool = cf.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="pd-register")
        self._client = httpx.Client(limits=httpx.Limits(max_connections=max_workers))
        self._futures: dict[str, cf.Future[dict[str, Any]]] = {}

    def submit(self, request_id: str, url: str, proxy_request_id: str,
               kv_transfer_params: DecodeRegistration | Mapping[str, Any],
               registration_token: str | None = None) -> None:
        self._futures[request_id] = self._pool.submit(
            register, url, proxy_request_id, kv_transfer_params,
            registration_token=registration_token,
            timeout_s=self.timeout_s, retries=self.retries, client=self._client,
        )

    def poll(self) -> dict[str, BaseException | None]:
        """Registrations that ended since the last poll: request id -> None (ok) or the error."""
        done: dict[str, BaseException | None] = {}
        for rid, fut in list(self._futures.items()):
            if fut.done():
                del self._futures[rid]
                done[rid] = fut.exception()
        return done

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()
