"""Prefill's claims of decode registrations (pd.claims) against a real HTTP server.

``ProxyStub`` plays the proxy's ``/v1/metaserver/claim`` on 127.0.0.1 (aiohttp, its
own thread and loop): it checks the token, answers scripted statuses first, then
holds each claim open until the test releases it, as the proxy holds it until the
decode registered. No mocks of the client: every claim crosses a socket.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from ascend_offload.pd.claims import ClaimError, Claims, ClaimTicket, wants_claim
from ascend_offload.pd.registration import DecodeRegistration

REG = {"remote_engine_id": "D0", "remote_host": "10.0.0.2", "remote_port": 7000, "remote_tp_size": 1,
       "remote_dp_rank": 0, "remote_request_id": "dec-1", "remote_block_ids": [3, 4],
       "remote_block_offset": 0, "transfer_protocol": "mooncake/tcp"}
WAIT_S = 30.0  # bound of every wait below; a pass never comes near it


class ProxyStub:
    """The metaserver's claim route: 404 unknown id, 403 wrong token, scripted answers,
    then the registration once released."""

    def __init__(self) -> None:
        self.tokens: dict[str, str] = {}
        self.script: dict[str, list[tuple[int, dict[str, str], bytes]]] = {}
        self.answers: dict[str, bytes] = {}
        self.calls: Counter[str] = Counter()
        self._cond = threading.Condition()
        self._gates: dict[str, asyncio.Future[None]] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._runner = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(WAIT_S)
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}/v1/metaserver/claim"

    async def _start(self) -> web.AppRunner:
        app = web.Application()
        app.router.add_post("/v1/metaserver/claim", self._handle)
        runner = web.AppRunner(app, shutdown_timeout=1.0)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner

    def expect(self, pid: str, token: str = "t" * 32, answer: dict[str, Any] | bytes | None = None,
               script: list[tuple[int, dict[str, str], bytes]] | None = None) -> str:
        """Accept claims of ``pid`` with ``token``; answer ``script`` first, then ``answer``
        (default: the registration REG) once released."""
        self.tokens[pid] = token
        body = REG if answer is None else answer
        self.answers[pid] = body if isinstance(body, bytes) else json.dumps({"kv_transfer_params": body}).encode()
        self.script[pid] = list(script or [])
        return token

    def _gate(self, pid: str) -> asyncio.Future[None]:
        if pid not in self._gates:
            self._gates[pid] = self._loop.create_future()
        return self._gates[pid]

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        pid = body.get("proxy_request_id", "")
        with self._cond:
            self.calls[pid] += 1
            self._cond.notify_all()
        if pid not in self.tokens:
            return web.Response(status=404, text="unknown proxy_request_id")
        if body.get("claim_token") != self.tokens[pid]:
            return web.Response(status=403, text="wrong claim_token")
        if self.script[pid]:
            status, headers, raw = self.script[pid].pop(0)
            return web.Response(status=status, headers=headers, body=raw)
        await self._gate(pid)  # the decode has not registered yet
        return web.Response(body=self.answers[pid], content_type="application/json")

    def release(self, *pids: str) -> None:
        """The decodes of ``pids`` registered: their held claims are answered."""
        def go() -> None:
            for pid in pids:
                if not self._gate(pid).done():
                    self._gate(pid).set_result(None)
        self._loop.call_soon_threadsafe(go)

    def wait_calls(self, total: int) -> None:
        """Until the server has seen ``total`` claims (all ids together)."""
        with self._cond:
            assert self._cond.wait_for(lambda: sum(self.calls.values()) >= total, WAIT_S), self.calls

    def close(self) -> None:
        def open_gates() -> None:
            for g in self._gates.values():
                if not g.done():
                    g.set_result(None)
        self._loop.call_soon_threadsafe(open_gates)
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(WAIT_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(WAIT_S)


def running_proxy() -> Iterator[ProxyStub]:
    """A ``ProxyStub`` for one test (other modules make it their ``proxy`` fixture)."""
    stub = ProxyStub()
    yield stub
    stub.close()


@pytest.fixture(name="proxy")
def _proxy() -> Iterator[ProxyStub]:
    yield from running_proxy()


@pytest.fixture
def claims() -> Iterator[Claims]:
    c = Claims(timeout_s=WAIT_S, backoff_s=0.01, max_backoff_s=0.05)
    yield c
    c.close()


def outcome(claims: Claims, rid: str) -> DecodeRegistration | ClaimError:
    """The claim's outcome, waiting for it (bounded)."""
    deadline = time.monotonic() + WAIT_S
    while (got := claims.result(rid)) is None:
        assert time.monotonic() < deadline, f"claim {rid} still pending"
        claims.wait(0.5, rid)
    return got


def error(claims: Claims, rid: str) -> str:
    got = outcome(claims, rid)
    assert isinstance(got, ClaimError), got
    return str(got)


def test_held_claim_is_pending_until_decode_registers_and_wait_wakes(proxy: ProxyStub, claims: Claims) -> None:
    token = proxy.expect("p1")
    claims.submit("r1", proxy.url, "p1", token)
    proxy.wait_calls(1)
    assert claims.result("r1") is None and claims.pending == 1
    assert claims.wait(0.01, "r1") is False  # not ended yet
    assert claims.wait(0.01, "r2") is False  # no such claim

    woke: list[tuple[bool, float]] = []

    def waiter() -> None:
        t0 = time.monotonic()
        woke.append((claims.wait(WAIT_S, "r1"), time.monotonic() - t0))

    t = threading.Thread(target=waiter)
    t.start()
    proxy.release("p1")
    t.join(WAIT_S * 2)
    assert woke and woke[0][0] is True and woke[0][1] < WAIT_S  # woken by the claim, not the timeout
    assert outcome(claims, "r1") == DecodeRegistration(**REG)
    assert claims.pending == 0 and claims.counts["claimed"] == 1
    with pytest.raises(KeyError):  # taken: forgotten
        claims.result("r1")


@pytest.mark.parametrize(("pid", "token", "status"), [("unknown", "x" * 32, "HTTP 404"),
                                                      ("p1", "wrong", "HTTP 403")])
def test_unknown_id_and_wrong_token_are_final(proxy: ProxyStub, claims: Claims, pid: str, token: str,
                                              status: str) -> None:
    proxy.expect("p1")
    claims.submit("r1", proxy.url, pid, token)
    why = error(claims, "r1")
    assert status in why and "refused the claim" in why
    assert "x" * 32 not in why and "t" * 32 not in why  # the token is never in a message
    assert proxy.calls[pid] == 1  # not retried


@pytest.mark.parametrize("status", [400, 409])
def test_malformed_and_not_early_are_final(proxy: ProxyStub, claims: Claims, status: int) -> None:
    token = proxy.expect("p1", script=[(status, {}, b"no")])
    claims.submit("r1", proxy.url, "p1", token)
    assert f"HTTP {status} no" in error(claims, "r1")
    assert proxy.calls["p1"] == 1


def test_overloaded_and_5xx_are_retried(proxy: ProxyStub, claims: Claims) -> None:
    token = proxy.expect("p1", script=[(503, {"Retry-After": "1"}, b"overloaded"), (502, {}, b"bad gateway")])
    proxy.release("p1")
    claims.submit("r1", proxy.url, "p1", token)
    assert outcome(claims, "r1") == DecodeRegistration(**REG)
    assert proxy.calls["p1"] == 3


@pytest.mark.parametrize(("answer", "why"), [
    ({**REG, "remote_evil": 1}, "unknown field `remote_evil`"),
    ({**REG, "remote_port": "7000"}, "Expected `int`, got `str` - at `$.kv_transfer_params.remote_port`"),
    (b"not json", "malformed claim answer"),
    (json.dumps({"kv_transfer_params": REG, "extra": 1}).encode(), "unknown field `extra`"),
])
def test_malformed_answer_is_refused_naming_why(proxy: ProxyStub, claims: Claims, answer: Any, why: str) -> None:
    token = proxy.expect("p1", answer=answer)
    proxy.release("p1")
    claims.submit("r1", proxy.url, "p1", token)
    assert why in error(claims, "r1")
    assert proxy.calls["p1"] == 1


def test_oversized_answer_is_refused_unread(proxy: ProxyStub) -> None:
    small = Claims(timeout_s=WAIT_S, max_answer_bytes=64)
    try:
        token = proxy.expect("p1")
        proxy.release("p1")
        small.submit("r1", proxy.url, "p1", token)
        assert "claim answer too large" in error(small, "r1")
    finally:
        small.close()


def test_deadline_ends_an_unanswered_claim(proxy: ProxyStub) -> None:
    short = Claims(timeout_s=0.3, backoff_s=0.01, max_backoff_s=0.05)
    try:
        token = proxy.expect("p1")  # never released
        short.submit("r1", proxy.url, "p1", token)
        t0 = time.monotonic()
        assert short.wait(WAIT_S, "r1") is True and time.monotonic() - t0 < WAIT_S
        why = error(short, "r1")
        assert "no registration for proxy_request_id='p1' within 0.3s" in why
        assert short.pending == 0
    finally:
        short.close()


def test_unreachable_proxy_is_retried_until_the_deadline() -> None:
    from ascend_offload.harness.servers import free_port

    short = Claims(timeout_s=0.3, backoff_s=0.01, max_backoff_s=0.05)
    try:
        short.submit("r1", f"http://127.0.0.1:{free_port()}/v1/metaserver/claim", "p1", "t")
        why = error(short, "r1")
        assert "ConnectError" in why and "attempt(s)" in why
    finally:
        short.close()


def test_cancel_ends_the_task(proxy: ProxyStub, claims: Claims) -> None:
    for i in range(3):
        claims.submit(f"r{i}", proxy.url, f"p{i}", proxy.expect(f"p{i}"))
    proxy.wait_calls(3)
    assert claims.pending == 3
    for i in range(3):
        claims.cancel(f"r{i}")
    deadline = time.monotonic() + WAIT_S
    while claims.pending:
        assert time.monotonic() < deadline, "cancelled claims still running"
        time.sleep(0.01)
    with pytest.raises(KeyError):
        claims.result("r0")
    proxy.release("p0", "p1", "p2")  # a late answer finds nobody
    assert claims.counts == {"cancelled": 3}


def test_resubmitting_replaces_the_earlier_claim(proxy: ProxyStub, claims: Claims) -> None:
    token = proxy.expect("p1")
    claims.submit("r1", proxy.url, "p1", "wrong")
    claims.submit("r1", proxy.url, "p1", token)
    proxy.release("p1")
    assert outcome(claims, "r1") == DecodeRegistration(**REG)


def test_hundred_claims_wait_at_once(proxy: ProxyStub, claims: Claims) -> None:
    """Every claim is held by the server at the same time: no pool caps how many wait."""
    n = 100
    for i in range(n):
        claims.submit(f"r{i}", proxy.url, f"p{i}", proxy.expect(f"p{i}", answer={**REG, "remote_request_id": f"d{i}"}))
    proxy.wait_calls(n)  # all 100 held open at once, none answered yet
    assert claims.pending == n
    proxy.release(*(f"p{i}" for i in reversed(range(n))))
    for i in range(n):
        got = outcome(claims, f"r{i}")
        assert isinstance(got, DecodeRegistration) and got.remote_request_id == f"d{i}"
    assert claims.pending == 0 and claims.counts["claimed"] == n


def test_close_cancels_and_refuses_later_claims(proxy: ProxyStub) -> None:
    c = Claims(timeout_s=WAIT_S)
    c.submit("r1", proxy.url, "p1", proxy.expect("p1"))
    proxy.wait_calls(1)
    c.close()
    assert c.pending == 0
    c.submit("r2", proxy.url, "p1", "t")
    assert "closed" in str(c.result("r2"))


def test_ticket_from_params() -> None:
    params = {"do_remote_decode": True, "do_remote_prefill": False, "claim_url": "http://h:1/v1/metaserver/claim",
              "proxy_request_id": "p", "claim_token": "t"}
    assert wants_claim(params) and not wants_claim({**params, "do_remote_decode": False})
    assert ClaimTicket.from_params(params).proxy_request_id == "p"
    with pytest.raises(ClaimError, match="must be an http"):
        ClaimTicket.from_params({**params, "claim_url": "file:///etc/passwd"})
    with pytest.raises(ClaimError, match="unknown field `remote_host`"):
        ClaimTicket.from_params({**params, "remote_host": "x"})
    with pytest.raises(ClaimError, match="missing required field `claim_token`"):
        ClaimTicket.from_params({k: v for k, v in params.items() if k != "claim_token"})
