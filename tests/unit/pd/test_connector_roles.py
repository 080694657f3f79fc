"""SfaRemoteD2HConnector carries only its role's state: the scheduler process gets the
scheduler bookkeeping, a decode rank the decode worker, a prefill rank the prefill worker
(kv_both: both workers over one KV region). The scheduler side of an early-dispatched
prefill request: scheduled at once and handed to the workers as a late send (the
default), or held back until its claim ends, against a real HTTP claim server."""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from ascend_offload.connectors.remote_d2h import SfaRemoteD2HConnector
from ascend_offload.pd.decode_requests import DecodeRequests
from ascend_offload.pd.prefill_requests import PrefillRequests
from tests.unit.pd.test_claims import REG, WAIT_S, ProxyStub, running_proxy


def _config(producer: bool, consumer: bool):
    tc = SimpleNamespace(kv_connector_extra_config={"host": "127.0.0.1"}, is_kv_producer=producer,
                         is_kv_consumer=consumer, engine_id="E0", kv_port=1)
    return SimpleNamespace(kv_transfer_config=tc, cache_config=SimpleNamespace(block_size=16),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_rank=0),
                           model_config=SimpleNamespace(use_mla=False))


@pytest.mark.parametrize(("producer", "consumer"), [(True, False), (False, True), (True, True)])
def test_each_process_holds_only_its_roles(monkeypatch, producer: bool, consumer: bool) -> None:
    monkeypatch.setattr("vllm.distributed.parallel_state.get_tensor_model_parallel_rank", lambda: 0)
    sched = SfaRemoteD2HConnector(_config(producer, consumer), KVConnectorRole.SCHEDULER)
    worker = SfaRemoteD2HConnector(_config(producer, consumer), KVConnectorRole.WORKER,
                                   SimpleNamespace(num_blocks=4, kv_cache_groups=[]))
    try:
        assert sched.decode is None and sched.prefill is None and sched.scheduler is not None
        assert isinstance(sched.scheduler.decode, DecodeRequests) is consumer
        assert isinstance(sched.scheduler.prefill, PrefillRequests) is producer
        assert worker.scheduler is None
        assert (worker.decode is not None) is consumer and (worker.prefill is not None) is producer
        assert worker.get_finished(set()) == (None, None)
        assert worker.get_block_ids_with_load_errors() == set()
    finally:
        sched.shutdown()
        worker.shutdown()


@pytest.fixture(name="proxy")
def _proxy() -> Iterator[ProxyStub]:
    yield from running_proxy()


def _scheduler(producer: bool, consumer: bool, claim_in_worker: bool = False) -> SfaRemoteD2HConnector:
    vc = _config(producer, consumer)
    vc.kv_transfer_config.kv_connector_extra_config.update(claim_timeout_s=WAIT_S, claim_wait_ms=5,
                                                           claim_in_worker=claim_in_worker)
    return SfaRemoteD2HConnector(vc, KVConnectorRole.SCHEDULER)


def _step(sched: SfaRemoteD2HConnector, scheduled: dict[str, int] | None = None) -> Any:
    return sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens=scheduled or {},
                                                      scheduled_new_reqs=[]))


def _early_request(proxy: ProxyStub, pid: str) -> SimpleNamespace:
    params = {"do_remote_decode": True, "do_remote_prefill": False, "claim_url": proxy.url,
              "proxy_request_id": pid, "claim_token": proxy.expect(pid)}
    return SimpleNamespace(request_id="req-" + pid, kv_transfer_params=params, num_prompt_tokens=32,
                           num_computed_tokens=0)


def _matched_until_claimed(sched: SfaRemoteD2HConnector, req: SimpleNamespace) -> tuple[int | None, bool]:
    """vLLM's loop: an answer of None skips the request this step; the empty step waits."""
    deadline = time.monotonic() + WAIT_S
    while (got := sched.get_num_new_matched_tokens(req, 0))[0] is None:
        assert time.monotonic() < deadline, "claim still pending"
        _step(sched)
    return got


def test_producer_holds_an_early_request_until_its_claim_ends(proxy: ProxyStub) -> None:
    sched = _scheduler(True, False)
    try:
        req = _early_request(proxy, "x1")
        assert sched.get_num_new_matched_tokens(req, 0) == (None, False)  # not schedulable yet
        proxy.wait_calls(1)
        assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
        assert _step(sched).send == []  # nothing scheduled: the next lookup may wait claim_wait_ms
        proxy.release("x1")
        assert _matched_until_claimed(sched, req) == (0, False)
        assert req.kv_transfer_params["remote_request_id"] == REG["remote_request_id"]
        assert "claim_url" not in req.kv_transfer_params
        sched.update_state_after_alloc(req, None, 0)
        sched.scheduler.kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: ([5, 6, 7],))
        assert [j.block_ids for j in _step(sched, {req.request_id: 32}).send] == [(5, 6)]
        assert sched.request_finished(req, [5, 6, 7]) == (True, None)  # decode reads its blocks
    finally:
        sched.shutdown()


def test_failed_claim_finishes_with_the_error(proxy: ProxyStub) -> None:
    sched = _scheduler(True, False)
    try:
        req = _early_request(proxy, "x1")
        req.kv_transfer_params["claim_token"] = "wrong"
        assert _matched_until_claimed(sched, req) == (0, False)
        sched.update_state_after_alloc(req, None, 0)
        held, params = sched.request_finished(req, [1])
        assert held is False and params is not None and "HTTP 403" in params["remote_d2h_error"]
    finally:
        sched.shutdown()


def test_consumer_ignores_claims(proxy: ProxyStub) -> None:
    sched = _scheduler(False, True)
    try:
        req = _early_request(proxy, "x1")
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        assert proxy.calls["x1"] == 0
    finally:
        sched.shutdown()


def test_producer_schedules_an_early_request_at_once_and_hands_the_claim_to_its_workers(
        proxy: ProxyStub) -> None:
    sched = _scheduler(True, False, claim_in_worker=True)
    try:
        req = _early_request(proxy, "x1")
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # schedulable now
        sched.update_state_after_alloc(req, None, 0)
        sched.scheduler.kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: ([5, 6, 7],))
        assert _step(sched, {req.request_id: 16}).late_send == []  # chunk 1 of 32 tokens
        req.num_computed_tokens = 16
        meta = _step(sched, {req.request_id: 16})
        assert meta.send == [] and not meta.empty
        (job,) = meta.late_send
        assert (job.request_id, job.block_ids, job.claim_url, job.proxy_request_id) == (
            req.request_id, (5, 6, 7), proxy.url, "x1")
        assert job.claim_token == proxy.tokens["x1"] and job.claim_token not in repr(meta)
        assert proxy.calls["x1"] == 0  # the scheduler never claims it
        assert sched.request_finished(req, [5, 6, 7]) == (True, None)  # held until the workers report
        sched.update_connector_output(SimpleNamespace(finished_recving=None,
                                                      finished_sending={req.request_id}))
        assert sched.request_finished(req, [5, 6, 7]) == (False, None)
    finally:
        sched.shutdown()


def test_a_malformed_claim_runs_as_a_plain_prefill(proxy: ProxyStub) -> None:
    sched = _scheduler(True, False, claim_in_worker=True)
    try:
        req = _early_request(proxy, "x1")
        req.kv_transfer_params["claim_url"] = "ftp://x"
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        sched.update_state_after_alloc(req, None, 0)
        held, params = sched.request_finished(req, [1])
        assert held is False and params is not None and "claim_url" in params["remote_d2h_error"]
    finally:
        sched.shutdown()
