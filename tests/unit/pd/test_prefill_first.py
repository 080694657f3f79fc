"""Prefill-first dispatch, without vLLM: the scheduler's ticket, the worker's waiting sends
(``pd.prefill_first.AwaitingSends``) and the registration fetcher against a real HTTP server."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from aiohttp import web

from ascend_offload.pd.prefill_first import AwaitingSends
from ascend_offload.pd.prefill_requests import ERROR_KEY, PrefillRequests, SendJob
from ascend_offload.pd.registration import DecodeRegistration
from ascend_offload.pd.registration_fetch import (
    TOKEN_HEADER,
    FetchFailed,
    FetchResult,
    FetchTicket,
    RegistrationFetcher,
)


@dataclasses.dataclass
class Req:
    request_id: str
    num_prompt_tokens: int
    num_computed_tokens: int = 0


TICKET = {"do_remote_decode": True, "do_remote_prefill": False, "metaserver": "http://127.0.0.1:9/v1/metaserver",
          "proxy_request_id": "px-1", "registration_token": "tok"}
REG = DecodeRegistration(remote_host="10.0.0.2", remote_port=7000, remote_tp_size=2, remote_dp_rank=1,
                         remote_request_id="dec-1", remote_block_ids=[30, 31], remote_block_offset=1,
                         transfer_protocol="mooncake/tcp")


# ------------------------------------------------------------------ scheduler


def test_ticket_becomes_a_send_of_all_blocks_and_holds_them() -> None:
    reqs = PrefillRequests()
    assert reqs.after_alloc(Req("p", 40), TICKET)
    (job,) = reqs.take_sends({"p": 40}, {"p": [4, 5, 6]}.get)
    assert job.ticket == FetchTicket(metaserver=TICKET["metaserver"], proxy_request_id="px-1",
                                     registration_token="tok")
    assert job.block_ids == (4, 5, 6)
    assert reqs.request_finished("p") is True  # held until the workers report it
    reqs.workers_done(["p"])
    assert reqs.request_finished("p") is False


@pytest.mark.parametrize("bad", [{"metaserver": "file:///etc/passwd"}, {"proxy_request_id": 7},
                                 {"registration_token": ""}, {"extra": 1}])
def test_malformed_ticket_runs_as_plain_prefill(bad: dict[str, Any]) -> None:
    reqs = PrefillRequests()
    assert not reqs.after_alloc(Req("p", 8), {**TICKET, **bad})
    assert reqs.take_sends({"p": 8}, {"p": [1]}.get) == []
    assert reqs.request_finished("p") is False
    err = reqs.take_error("p")
    assert err is not None and "invalid fetch ticket" in err[ERROR_KEY]


# ------------------------------------------------------------------ worker bookkeeping


class FakeFetcher:
    def __init__(self) -> None:
        self.submitted: dict[str, float] = {}
        self.cancelled: list[str] = []
        self.results: dict[str, FetchResult] = {}

    def submit(self, key: str, ticket: FetchTicket, deadline: float) -> None:
        self.submitted[key] = deadline

    def poll(self) -> dict[str, FetchResult]:
        out, self.results = self.results, {}
        return out

    def cancel(self, key: str) -> None:
        self.cancelled.append(key)

    def close(self) -> None:
        pass


def _job(rid: str = "p") -> SendJob:
    return SendJob(rid, "", (4, 5, 6), "", 0, 0, 0,
                   ticket=FetchTicket.from_params(TICKET))


@pytest.fixture
def clock() -> Iterator[list[float]]:
    yield [100.0]


def _awaiting(fetcher: FakeFetcher, clock: list[float], **kw: Any) -> AwaitingSends:
    return AwaitingSends(fetcher, wait_s=30.0, clock=lambda: clock[0], **kw)  # type: ignore[arg-type]


def test_registration_during_the_forward_publishes_written_layers_and_joins(clock: list[float]) -> None:
    f = FakeFetcher()
    aw = _awaiting(f, clock)
    assert aw.add(_job()) is None and f.submitted == {"p": 130.0}
    aw.layer_written(0)
    aw.layer_written(1)
    f.results["p"] = REG
    (j,), ended = aw.take()
    assert ended == [] and j.layers == (0, 1) and j.in_forward
    assert (j.job.remote_request_id, j.job.block_ids, j.job.host, j.job.kv_port, j.job.d_tp, j.job.dp_rank) == \
        ("dec-1", (5, 6), "10.0.0.2", 7000, 2, 1)
    assert j.job.ticket is None and len(aw) == 0
    assert (aw.stats.fetched, aw.stats.held) == (1, 0)


def test_registration_after_the_forward_publishes_every_layer(clock: list[float]) -> None:
    f = FakeFetcher()
    aw = _awaiting(f, clock)
    aw.add(_job())
    aw.layer_written(0)
    aw.end_forward(4)
    assert aw.take() == ([], [])  # nothing yet: keeps waiting (blocks held by the scheduler)
    f.results["p"] = REG
    (j,), _ = aw.take()
    assert j.layers == (0, 1, 2, 3) and not j.in_forward
    assert aw.stats.held == 1


def test_no_registration_expires_and_a_stuck_fetch_is_given_up(clock: list[float]) -> None:
    f = FakeFetcher()
    aw = _awaiting(f, clock)
    aw.add(_job("a"))
    aw.add(_job("b"))
    f.results["a"] = FetchFailed("no registration within the deadline", expired=True)
    joined, (ended,) = aw.take()
    assert joined == [] and ended.request_id == "a" and ended.expired
    clock[0] += 30.0 + 6.0  # "b"'s fetch never ended: the backstop frees it
    _, (ended,) = aw.take()
    assert ended.request_id == "b" and ended.expired and f.cancelled == ["b"]
    assert aw.stats.expired == 2 and len(aw) == 0


@pytest.mark.parametrize("reg, why", [
    (msgspec.structs.replace(REG, remote_host="bad host!"), "neither an IP address nor a host name"),
    (msgspec.structs.replace(REG, remote_block_ids=[1, 2, 3]), "decode expects 3"),
    (msgspec.structs.replace(REG, remote_port=0), "remote_port=0"),
    (msgspec.structs.replace(REG, transfer_protocol="memfabric/sdma"), "transfer protocol"),
])
def test_unusable_registration_fails_that_request_alone(clock: list[float], reg: DecodeRegistration,
                                                        why: str) -> None:
    f = FakeFetcher()
    aw = _awaiting(f, clock, protocol="mooncake/tcp")
    aw.add(_job("p"))
    aw.add(_job("q"))
    f.results.update({"p": reg, "q": REG})
    (j,), (ended,) = aw.take()
    assert j.job.request_id == "q" and ended.request_id == "p" and not ended.expired
    assert why in ended.reason and aw.stats.refused == 1


def test_waiting_table_is_bounded(clock: list[float]) -> None:
    aw = _awaiting(FakeFetcher(), clock, max_requests=1)
    assert aw.add(_job("a")) is None
    ended = aw.add(_job("b"))
    assert ended is not None and "limit 1" in ended.reason and len(aw) == 1


# ------------------------------------------------------------------ fetcher over HTTP


class Metaserver:
    """A stand-in for the proxy's fetch route, on its own thread's loop."""

    def __init__(self) -> None:
        self.answers: list[tuple[int, bytes]] = []  # popped per request; empty: hang
        self.seen: list[tuple[str, str]] = []
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_get("/v1/metaserver", self.fetch)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1, handler_cancellation=True)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.ready.set()
        self.loop.run_forever()

    async def fetch(self, request: web.Request) -> web.Response:
        self.seen.append((request.query.get("proxy_request_id", ""), request.headers.get(TOKEN_HEADER, "")))
        if not self.answers:
            await asyncio.sleep(3600)
        status, body = self.answers.pop(0)
        return web.Response(status=status, body=body)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _wait(fetcher: RegistrationFetcher, key: str) -> FetchResult:
    import time

    end = time.monotonic() + 30  # a hang guard, not a timing threshold
    while time.monotonic() < end:
        got = fetcher.poll()
        if key in got:
            return got[key]
        time.sleep(0.01)
    raise AssertionError(f"fetch {key} never ended")


def test_fetcher_over_http() -> None:
    import time

    ms = Metaserver()
    fetcher = RegistrationFetcher(max_answer_bytes=4096, backoff_s=0.01)
    ticket = FetchTicket(metaserver=f"http://127.0.0.1:{ms.port}/v1/metaserver", proxy_request_id="px-1",
                         registration_token="tok")
    good = msgspec.json.encode(REG)
    try:
        # a 5xx and the proxy's own 504 are retried; then the registration arrives
        ms.answers = [(503, b"busy"), (504, b"wait"), (200, good)]
        fetcher.submit("a", ticket, time.monotonic() + 30)
        assert _wait(fetcher, "a") == REG
        assert ms.seen[0] == ("px-1", "tok")
        # refusals are final; malformed or oversized answers fail that request alone
        for status, body, why in [(403, b"no", "HTTP 403"), (200, b'{"remote_host": 1}', "malformed"),
                                  (200, msgspec.json.encode({**msgspec.to_builtins(REG), "x": 1}), "malformed"),
                                  (200, b"[" * 5000, "over 4096 bytes"), (200, b"\xff", "malformed")]:
            ms.answers = [(status, body)]
            fetcher.submit("b", ticket, time.monotonic() + 30)
            got = _wait(fetcher, "b")
            assert isinstance(got, FetchFailed) and why in got.reason and not got.expired, (why, got)
        # nothing ever answers: the deadline ends the fetch
        ms.answers = []
        fetcher.submit("c", ticket, time.monotonic() + 0.3)
        got = _wait(fetcher, "c")
        assert isinstance(got, FetchFailed) and got.expired
        # nobody listens: retried until the deadline
        dead = FetchTicket(metaserver="http://127.0.0.1:9/v1/metaserver", proxy_request_id="px-2",
                           registration_token="tok")
        fetcher.submit("d", dead, time.monotonic() + 0.3)
        got = _wait(fetcher, "d")
        assert isinstance(got, FetchFailed) and got.expired and "ConnectError" in got.reason
        # a cancelled fetch never reports
        fetcher.submit("e", ticket, time.monotonic() + 30)
        fetcher.cancel("e")
        assert len(fetcher) == 0
    finally:
        fetcher.close()
        ms.close()
