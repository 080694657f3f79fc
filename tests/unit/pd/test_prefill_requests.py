"""Prefill scheduler bookkeeping (pd.prefill_requests), driven directly without vLLM."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from ascend_offload.pd.prefill_requests import PrefillRequests, SendJob
from tests.unit.pd.test_claims import REG, WAIT_S, ProxyStub, running_proxy


@dataclasses.dataclass
class Req:
    request_id: str
    num_prompt_tokens: int
    num_computed_tokens: int = 0


def _params(**kw: Any) -> dict[str, Any]:
    """What the proxy hands prefill: its role flags plus decode's registration."""
    base = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": "D0",
            "remote_host": "10.0.0.2", "remote_port": 7000, "remote_tp_size": 2, "remote_dp_rank": 1,
            "remote_request_id": "dec-1", "remote_block_ids": [30, 31], "remote_block_offset": 1}
    return {**base, **kw}


BLOCKS = {"p": [4, 5, 6]}


def test_send_job_when_the_prompt_finishes_computing() -> None:
    reqs = PrefillRequests()
    req = Req("p", 40)
    assert reqs.after_alloc(req, _params())
    assert reqs.take_sends({"p": 32}, BLOCKS.get) == []  # chunk 1: 32 of 40 tokens
    req.num_computed_tokens = 32
    assert reqs.take_sends({}, BLOCKS.get) == []  # not scheduled this step
    assert reqs.take_sends({"p": 8}, BLOCKS.get) == [SendJob("p", "dec-1", (5, 6), "10.0.0.2", 7000, 2, 1)]
    assert reqs.sending == {"p"}
    assert reqs.take_sends({"p": 1}, BLOCKS.get) == []  # sent once


def test_blocks_wait_for_decode_after_the_request_finished() -> None:
    reqs = PrefillRequests()
    reqs.after_alloc(Req("p", 16), _params(remote_block_ids=[30], remote_block_offset=0))
    assert len(reqs.take_sends({"p": 16}, BLOCKS.get)) == 1
    assert reqs.request_finished("p") is True
    reqs.workers_done(["p"])
    assert reqs.request_finished("p") is False


def test_finished_before_its_prompt_completed_sends_nothing() -> None:
    reqs = PrefillRequests()
    reqs.after_alloc(Req("p", 40), _params())
    assert reqs.request_finished("p") is False
    assert reqs.take_sends({"p": 40}, BLOCKS.get) == []


def test_missing_blocks_or_manager_drop_the_send(caplog: pytest.LogCaptureFixture) -> None:
    reqs = PrefillRequests()
    reqs.after_alloc(Req("p", 16), _params(remote_block_ids=[1, 2, 3], remote_block_offset=1))
    reqs.after_alloc(Req("q", 16), _params())
    with caplog.at_level(logging.ERROR):
        assert reqs.take_sends({"p": 16, "q": 16}, lambda rid: BLOCKS.get(rid)) == []
    assert "has 3 prefill blocks from offset 1; decode expects 3" in caplog.text
    assert "no KV cache manager bound; cannot send q" in caplog.text
    assert reqs.sending == set()


@pytest.mark.parametrize(("change", "why"), [
    ({"remote_extra": 1}, "unknown field `remote_extra`"),
    ({"remote_port": "7000"}, "Expected `int`, got `str` - at `$.remote_port`"),
    ({"remote_port": 70000}, "at `$.remote_port`"),
    ({"remote_block_ids": [1, -2]}, "at `$.remote_block_ids[1]`"),
    ({"remote_tp_size": 0}, "at `$.remote_tp_size`"),
    ({"remote_host": None}, "at `$.remote_host`"),
])
def test_malformed_registration_is_rejected_at_the_boundary(change: dict[str, Any], why: str,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    reqs = PrefillRequests()
    with caplog.at_level(logging.ERROR):
        assert reqs.after_alloc(Req("p", 16), _params(**change)) is False
    assert why in caplog.text and "decode will not get its KV" in caplog.text
    assert reqs.take_sends({"p": 16}, BLOCKS.get) == []


def test_missing_registration_key_is_named(caplog: pytest.LogCaptureFixture) -> None:
    params = _params()
    del params["remote_request_id"]
    with caplog.at_level(logging.ERROR):
        assert PrefillRequests().after_alloc(Req("p", 16), params) is False
    assert "missing required field `remote_request_id`" in caplog.text


# ---------------------------------------------------------------- early dispatch: the claim


@pytest.fixture(name="proxy")
def _proxy() -> Iterator[ProxyStub]:
    yield from running_proxy()


@dataclasses.dataclass
class Waiting:
    """A request as vLLM's waiting queue holds it: the claim may replace its params."""

    request_id: str
    kv_transfer_params: dict[str, Any] | None
    num_prompt_tokens: int = 16
    num_computed_tokens: int = 0


def _early(proxy: ProxyStub, pid: str, **kw: Any) -> dict[str, Any]:
    """What the proxy hands an early-dispatched prefill."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "claim_url": proxy.url,
            "proxy_request_id": pid, "claim_token": proxy.expect(pid, **kw)}


def _until_ready(reqs: PrefillRequests, req: Waiting) -> None:
    deadline = time.monotonic() + WAIT_S
    while not reqs.ready(req):
        assert time.monotonic() < deadline, "claim still pending"
        reqs.claims.wait(0.5, request_id=req.request_id)


@pytest.fixture
def early() -> Iterator[PrefillRequests]:
    reqs = PrefillRequests(claim_timeout_s=WAIT_S)
    yield reqs
    reqs.close()


def test_claimed_registration_replaces_the_params(proxy: ProxyStub, early: PrefillRequests) -> None:
    req = Waiting("p", _early(proxy, "x1", answer={**REG, "remote_block_ids": [30]}))
    assert early.ready(req) is False and early.claiming == 1  # the claim started, decode not registered
    proxy.wait_calls(1)
    assert early.ready(req) is False
    assert early.claims.wait(0.01, request_id="p") is False
    proxy.release("x1")
    _until_ready(early, req)
    assert req.kv_transfer_params == {"do_remote_decode": True, "do_remote_prefill": False,
                                      **{**REG, "remote_block_ids": [30]}}
    assert early.claiming == 0 and early.ready(req) is True  # asked again: nothing more to claim
    assert early.after_alloc(req, req.kv_transfer_params)
    assert early.take_sends({"p": 16}, {"p": [4]}.get) == [SendJob("p", "dec-1", (4,), "10.0.0.2", 7000, 1, 0)]
    assert proxy.calls["x1"] == 1


def test_failed_claim_runs_a_plain_prefill_with_the_error(proxy: ProxyStub, early: PrefillRequests,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    params = _early(proxy, "x1")
    req = Waiting("p", {**params, "proxy_request_id": "gone"})  # the proxy forgot it: 404
    with caplog.at_level(logging.ERROR):
        _until_ready(early, req)
    assert req.kv_transfer_params == {"do_remote_decode": False, "do_remote_prefill": False}
    assert caplog.text.count("request p was dispatched before its decode registered") == 1
    assert "HTTP 404" in caplog.text
    assert early.request_finished("p") is False  # nothing held
    err = early.take_error("p")
    assert err is not None and "HTTP 404" in err["remote_d2h_error"]


def test_malformed_claim_params_fail_at_once(early: PrefillRequests) -> None:
    req = Waiting("p", {"do_remote_decode": True, "claim_url": "ftp://x", "proxy_request_id": "x",
                        "claim_token": "t"})
    assert early.ready(req) is True and early.claiming == 0
    err = early.take_error("p")
    assert err is not None and "must be an http(s) URL" in err["remote_d2h_error"]


def test_request_finished_while_claiming_cancels_the_claim(proxy: ProxyStub, early: PrefillRequests) -> None:
    req = Waiting("p", _early(proxy, "x1"))
    assert early.ready(req) is False
    proxy.wait_calls(1)
    assert early.request_finished("p") is False
    assert early.claiming == 0 and early.take_error("p") is None
    deadline = time.monotonic() + WAIT_S
    while early.claims.pending:
        assert time.monotonic() < deadline, "the cancelled claim still runs"
        time.sleep(0.01)


def test_a_step_after_an_idle_one_waits_once_for_the_claim(proxy: ProxyStub) -> None:
    """The lookup blocks (once per step, only after an idle step) until the claim ends,
    so the request runs in this step rather than an empty step later."""
    reqs = PrefillRequests(claim_timeout_s=WAIT_S, claim_wait_s=WAIT_S)
    try:
        req, other = Waiting("p", _early(proxy, "x1")), Waiting("q", _early(proxy, "x2"))
        reqs.end_step(idle=False)  # after a busy step: no wait
        assert reqs.ready(req) is False and reqs.ready(other) is False
        proxy.wait_calls(2)
        reqs.end_step(idle=True)
        timer = threading.Timer(0.2, proxy.release, ("x1",))
        timer.start()
        assert reqs.ready(req) is True  # blocked until released (WAIT_S is far longer)
        assert req.kv_transfer_params["remote_request_id"] == REG["remote_request_id"]
        assert reqs.ready(other) is False  # the step's one wait is spent: no second one
        timer.join()
    finally:
        reqs.close()


def test_no_claim_without_claim_url(early: PrefillRequests) -> None:
    assert early.ready(Waiting("p", _params())) and early.ready(Waiting("q", None))
    assert early.claiming == 0 and early.claims.pending == 0 and len(early.claims) == 0
