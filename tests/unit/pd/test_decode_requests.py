"""Decode scheduler bookkeeping (pd.decode_requests), driven directly without vLLM."""

from __future__ import annotations

import dataclasses
from typing import Any

from ascend_offload.pd.decode_requests import DecodeEndpoint, DecodeRequests, RecvJob
from ascend_offload.pd.registration import DecodeRegistration, RegistrationError

BLOCK = 16
EP = DecodeEndpoint(engine_id="D0", host="10.0.0.2", kv_port=7000, tp_size=2, dp_rank=1,
                    transfer_protocol="memfabric/sdma")


@dataclasses.dataclass
class Req:
    request_id: str
    num_prompt_tokens: int
    max_tokens: int = 8
    kv_transfer_params: dict[str, Any] | None = None


class Recorder:
    """A Registrar's interface; registrations end when the test says so."""

    def __init__(self) -> None:
        self.submitted: list[tuple[str, str, str, DecodeRegistration]] = []
        self.results: dict[str, BaseException | None] = {}
        self.tokens: list[str | None] = []

    def submit(self, request_id: str, url: str, proxy_request_id: str, params: DecodeRegistration,
               registration_token: str | None = None) -> None:
        self.submitted.append((request_id, url, proxy_request_id, params))
        self.tokens.append(registration_token)

    def poll(self) -> dict[str, BaseException | None]:
        out, self.results = self.results, {}
        return out


def _params(**kw: Any) -> dict[str, Any]:
    return {"do_remote_prefill": True, "do_remote_decode": False, "metaserver": "http://proxy:1/v1/metaserver",
            "proxy_request_id": "px", **kw}


def _requests(sparse: bool = False) -> tuple[DecodeRequests, Recorder]:
    reg = Recorder()
    return DecodeRequests(EP, block_size=BLOCK, sparse=sparse, registrar=reg), reg  # type: ignore[arg-type]


def test_only_remote_prefills_are_external_loads() -> None:
    reqs, _ = _requests()
    assert reqs.num_new_matched_tokens(Req("a", 70, kv_transfer_params=_params()), 16) == (54, True)
    assert reqs.num_new_matched_tokens(Req("b", 70, kv_transfer_params=_params()), 70) == (0, False)
    assert reqs.num_new_matched_tokens(Req("c", 70), 0) == (0, False)
    assert reqs.num_new_matched_tokens(Req("d", 70, kv_transfer_params={"do_remote_prefill": False}), 0) == (0, False)


def test_registers_endpoint_and_external_blocks_once() -> None:
    reqs, reg = _requests()
    req = Req("r", 70, kv_transfer_params=_params())
    reqs.after_alloc(req, [8, 3, 5, 6, 2], 54)  # block 0 (8) is a local prefix hit
    (rid, url, prid, sent), = reg.submitted
    assert (rid, url, prid) == ("r", "http://proxy:1/v1/metaserver", "px")
    assert sent.to_wire() == {
        "remote_engine_id": "D0", "remote_host": "10.0.0.2", "remote_port": 7000, "remote_tp_size": 2,
        "remote_dp_rank": 1, "remote_request_id": "r", "remote_block_ids": [3, 5, 6, 2],
        "remote_block_offset": 1, "transfer_protocol": "memfabric/sdma"}  # advertised to prefill
    assert req.kv_transfer_params["do_remote_prefill"] is False  # one transfer per request
    reqs.after_alloc(req, [8, 3, 5, 6, 2], 54)
    assert len(reg.submitted) == 1
    step = reqs.take_step()
    assert step.recv == [RecvJob("r", (3, 5, 6, 2))] and step.fail == {} and step.cancel == []
    assert reqs.take_step().recv == []  # handed to the workers once


def test_sparse_pulls_the_whole_prompt_and_reserves_max_tokens() -> None:
    reqs, reg = _requests(sparse=True)
    reqs.after_alloc(Req("r", 70, max_tokens=9, kv_transfer_params=_params()), [8, 3, 5, 6, 2], 54)
    sent = reg.submitted[0][3]
    assert sent.remote_block_offset == 0 and sent.remote_block_ids == [8, 3, 5, 6, 2]
    assert reqs.take_step().recv == [RecvJob("r", (3, 5, 6, 2), 70, 79)]  # load errors: external only


def test_sparse_blocks_the_decode_cache_serves_are_not_pulled() -> None:
    from ascend_offload.sparse.prefix_cache import PrefixHit

    reqs, reg = _requests(sparse=True)
    hit = PrefixHit((b"h0", b"h1"), (7, 4))
    seen: list[list[int]] = []

    def cached(blocks: Any) -> PrefixHit:
        seen.append(list(blocks))
        return hit

    reqs.after_alloc(Req("r", 70, max_tokens=9, kv_transfer_params=_params()), [7, 4, 5, 6, 2], 70,
                     cached=cached)
    assert seen == [[7, 4, 5, 6, 2]]  # the cache picks its blocks from the request's own
    sent = reg.submitted[0][3]
    # the prefill sends from the first block the decode lacks
    assert sent.remote_block_offset == 2 and sent.remote_block_ids == [5, 6, 2]
    # the load-error set stays every prompt block; the job carries the cached blocks
    assert reqs.take_step().recv == [RecvJob("r", (7, 4, 5, 6, 2), 70, 79, hit)]


def test_unusable_requests_fail_without_registering() -> None:
    reqs, reg = _requests()
    reqs.after_alloc(Req("short", 70, kv_transfer_params=_params()), [8, 3], 54)  # needs 4 blocks
    reqs.after_alloc(Req("nourl", 70, kv_transfer_params=_params(metaserver=None)), [8, 3, 5, 6, 2], 54)
    reqs.after_alloc(Req("hit", 32, kv_transfer_params=_params()), [1, 2], 0)  # all local: no load
    assert reg.submitted == []
    step = reqs.take_step()
    assert step.fail == {"short": "decode allocated 1 blocks, the prompt needs 4",
                         "nourl": "kv_transfer_params lacks 'metaserver' or 'proxy_request_id'"}
    assert [j.request_id for j in step.recv] == ["short", "nourl"]  # workers report them failed
    assert reqs.receiving == {"short", "nourl"}


def test_failed_registration_fails_the_load_unless_already_done() -> None:
    reqs, reg = _requests()
    for rid in ("a", "b"):
        reqs.after_alloc(Req(rid, 32, kv_transfer_params=_params()), [1, 2], 32)
    reqs.take_step()
    reqs.workers_done(["b"])  # b's KV arrived before its registration call returned
    reg.results = {"a": RegistrationError("HTTP 404"), "b": RegistrationError("late")}
    assert reqs.take_step().fail == {"a": "HTTP 404"}


def test_finished_while_pulling_holds_blocks_until_workers_stop() -> None:
    reqs, _ = _requests()
    reqs.after_alloc(Req("r", 32, kv_transfer_params=_params()), [1, 2], 32)
    assert reqs.request_finished("r") is True
    assert reqs.take_step().cancel == ["r"]
    reqs.workers_done(["r"])  # the worker stopped the pull ("sent")
    assert reqs.request_finished("r") is False
    assert reqs.request_finished("never-seen") is False


def test_registers_through_a_real_registrar_body() -> None:
    """The struct the bookkeeping hands the Registrar is what register() POSTs."""
    from ascend_offload.pd import registration

    bodies: list[dict[str, Any]] = []

    class Http:
        def post(self, url: str, json: dict[str, Any], timeout: float) -> Any:
            bodies.append(json)
            return type("R", (), {"status_code": 200, "json": lambda self: {"status": "dispatched"}})()

    out = registration.register("http://proxy:1/v1/metaserver", "px", DecodeRegistration(
        remote_host="h", remote_port=5, remote_request_id="r", remote_block_ids=[1]), client=Http())  # type: ignore[arg-type]
    assert out == {"status": "dispatched"}
    assert bodies == [{"proxy_request_id": "px", "kv_transfer_params": {
        "remote_engine_id": "", "remote_host": "h", "remote_port": 5, "remote_tp_size": 1, "remote_dp_rank": 0,
        "remote_request_id": "r", "remote_block_ids": [1], "remote_block_offset": 0, "transfer_protocol": ""}}]
