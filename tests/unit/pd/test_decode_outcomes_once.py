"""vLLM hears of each RD2H decode request once: received *or* stopped, never both, never twice.

vLLM's scheduler asserts on a request it is told about that it no longer holds;
before this, a request whose registration was refused and that the client
abandoned in the same step produced two outcomes (one reported "sent", one
"received") and stopped the decode engine (seen in the soak: fan-out streams
hung up while registrations flooded the proxy)."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from ascend_offload.connectors import remote_d2h as rd
from tests.unit.pd.test_connector_sparse import _cut_caches, _cut_config, _vllm_config


def _drain(conn: rd.SfaRemoteD2HConnector, seconds: float) -> tuple[list[str], list[str]]:
    """Everything get_finished reports for ``seconds`` (outcomes arrive from the I/O thread)."""
    sent: list[str] = []
    recv: list[str] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        s, r = conn.get_finished(set())
        sent += sorted(s or ())
        recv += sorted(r or ())
        time.sleep(0.02)
    return sent, recv


@pytest.fixture
def conn(monkeypatch: pytest.MonkeyPatch, port: int):
    monkeypatch.setattr("vllm.distributed.parallel_state.get_tensor_model_parallel_rank", lambda: 0)
    c = rd.SfaRemoteD2HConnector(
        _vllm_config(producer=False, port=port), KVConnectorRole.WORKER, _cut_config(40)
    )
    c.register_kv_caches(_cut_caches(40))
    yield c
    c.shutdown()


def _step(conn: rd.SfaRemoteD2HConnector, **meta) -> None:
    conn.bind_connector_metadata(rd.RemoteD2HMetadata(**meta))
    conn.start_load_kv(None)


def test_refused_and_abandoned_in_one_step_is_reported_once(conn) -> None:
    _step(conn, recv=[rd.RecvJob("e", (1, 2), 20, 30)])
    _step(conn, fail_recv={"e": "registration refused (503)"}, cancel_recv=["e"])
    sent, recv = _drain(conn, 1.0)
    assert (sent, recv) == (["e"], [])  # stopped: its blocks may be freed; nothing else
    assert conn.decode.pool.admitted() == []


def test_abandoned_after_its_outcome_is_reported_once(conn) -> None:
    _step(conn, recv=[rd.RecvJob("f", (1, 2), 20, 30)])
    _step(conn, fail_recv={"f": "registration refused (503)"})
    time.sleep(0.3)  # the failure's outcome is queued, not yet drained by get_finished
    _step(conn, cancel_recv=["f"])  # vLLM finished it meanwhile: the scheduler cancels
    sent, recv = _drain(conn, 1.0)
    assert len(sent + recv) == 1 and set(sent + recv) == {"f"}, (sent, recv)


def test_idle_wait_returns_the_pull_that_ends_during_it(conn) -> None:
    # A worker asked to wait (an idle step) returns as soon as a pull in flight ends,
    # in the same call: the outcome is not left for a later polling step.
    _step(conn, recv=[rd.RecvJob("g", (1, 2), 20, 30)])
    threading.Thread(
        target=conn.decode.consumer.fail, args=("g", "registration refused (503)")
    ).start()
    sent, recv = conn.decode.get_finished(set(), wait_s=60.0)
    assert (sent, recv) == (set(), {"g"})


def test_idle_wait_only_with_pulls_in_flight_and_nothing_finished(conn, monkeypatch) -> None:
    def no_wait(count: int, timeout_s: float) -> list:
        raise AssertionError("waited")

    monkeypatch.setattr(conn.decode.consumer, "wait_finished", no_wait)
    assert conn.decode.get_finished(set(), wait_s=60.0) == (set(), set())  # no pull in flight
    _step(conn, recv=[rd.RecvJob("h", (1, 2), 20, 30)])
    assert conn.decode.get_finished({"x"}, wait_s=60.0) == (set(), set())  # vLLM finished one


def test_facade_waits_on_idle_steps_only(conn, monkeypatch) -> None:
    seen: list[float] = []

    def record(finished: set[str], wait_s: float = 0.0) -> tuple[set[str], set[str]]:
        seen.append(wait_s)
        return set(), set()

    monkeypatch.setattr(conn.decode, "get_finished", record)
    _step(conn, idle=True)
    conn.get_finished(set())
    _step(conn)
    conn.get_finished(set())
    assert seen == [conn.cfg.idle_wait_ms / 1000, 0.0] and seen[0] > 0
