"""A prefill request computed before its decode registered (early dispatch, ``claim_in_worker``).

Worker level: a prefill rank and a decode rank of ``SfaRemoteD2HConnector`` over real
ZMQ on 127.0.0.1 and a real HTTP claim server (``ProxyStub``). The prefill writes some
or all layers before the registration is released; decode's KV must then equal the
prefill's blocks that the registration names, byte for byte, and the prefill's blocks
are held until decode answered. A failed or refused claim publishes nothing and frees
the blocks. :class:`LateSends` alone: layers written while claims end on another
thread are each published exactly once.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from ascend_offload.connectors.remote_d2h import SfaRemoteD2HConnector, kv_region
from ascend_offload.connectors.remote_d2h.metadata import (
    LateSendJob,
    RecvJob,
    RemoteD2HMetadata,
    SendJob,
)
from ascend_offload.harness.servers import free_port
from ascend_offload.pd.late_sends import LateSends
from tests.support.fake_device import installed
from tests.unit.pd.test_claims import REG, WAIT_S, ProxyStub, running_proxy
from tests.unit.pd.test_rd2h_device_kv import (
    D_BLOCKS,
    LAYERS,
    NAMES,
    P_BLOCKS,
    _config,
    _Engines,
    _kv,
)

DST = [0, 4, 5, 6, 2]
MINE = (8, 7, 1, 2, 3, 9)  # the request's prefill blocks; the registration's offset 1 skips block 8
SRC = list(MINE[1:])


@pytest.fixture(name="proxy")
def _proxy() -> Iterator[ProxyStub]:
    yield from running_proxy()


@contextlib.contextmanager
def _ranks(monkeypatch: pytest.MonkeyPatch, on_device: bool) -> Iterator[dict[str, Any]]:
    """A decode rank expecting request r1 in DST, and a prefill rank with seeded KV."""
    monkeypatch.setattr("vllm.distributed.parallel_state.get_tensor_model_parallel_rank", lambda: 0)
    src, dst = _kv(P_BLOCKS, seed=3), _kv(D_BLOCKS, seed=None)
    with installed() as fake:
        monkeypatch.setattr(kv_region, "_engine", _Engines(fake, device_memory=False))
        place = fake.place if on_device else (lambda t: t)
        port = free_port()
        dec = SfaRemoteD2HConnector(_config(producer=False, port=port, layerwise=True),
                                    KVConnectorRole.WORKER, _kv_config(D_BLOCKS))
        pre_cfg = _config(producer=True, port=port, layerwise=True)
        pre_cfg.kv_transfer_config.kv_connector_extra_config["claim_timeout_s"] = WAIT_S
        pre = SfaRemoteD2HConnector(pre_cfg, KVConnectorRole.WORKER, _kv_config(P_BLOCKS))
        try:
            dec.register_kv_caches({n: place(t) for n, t in zip(NAMES, dst, strict=True)})
            pre.register_kv_caches({n: place(t) for n, t in zip(NAMES, src, strict=True)})
            assert dec.decode is not None and pre.prefill is not None
            dec.decode.apply(RemoteD2HMetadata(recv=[RecvJob("r1", tuple(DST))]))
            yield {"dec": dec, "pre": pre, "src": src, "dst": dst, "port": port}
        finally:
            dec.shutdown()
            pre.shutdown()


def _kv_config(num_blocks: int) -> Any:
    return SimpleNamespace(num_blocks=num_blocks, kv_cache_groups=[])


def _registration(port: int, **over: Any) -> dict[str, Any]:
    return {**REG, "remote_host": "127.0.0.1", "remote_port": port, "remote_request_id": "r1",
            "remote_block_ids": DST, "remote_block_offset": 1, **over}


def _late_job(proxy: ProxyStub, pid: str, token: str | None = None) -> LateSendJob:
    return LateSendJob("p1", MINE, proxy.url, pid, token or proxy.tokens[pid])


def _until(what: str, check: Any) -> Any:
    deadline = time.monotonic() + WAIT_S
    while not (got := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.005)
    return got


def _released(pre: Any, finished: set[str], want: set[str]) -> None:
    """vLLM's loop: ``finished`` is told once (already told if empty); the worker's
    answers then accumulate until every request of ``want`` may be freed."""
    sent = set(pre.get_finished(finished))
    _until(f"{want} released", lambda: sent.update(pre.get_finished(set())) or want <= sent)


def _received(dec: SfaRemoteD2HConnector) -> None:
    assert dec.decode is not None
    got: set[str] = set()
    _until("decode received r1", lambda: got.update(dec.decode.get_finished(set())[1]) or "r1" in got)
    assert dec.decode.take_load_errors() == set()


@pytest.mark.parametrize("claimed_after", [0, 2, LAYERS], ids=["before-forward", "mid-forward", "after-forward"])
@pytest.mark.parametrize("on_device", [False, True], ids=["host", "staged-device"])
def test_layers_written_before_the_claim_are_published_when_it_arrives(
        monkeypatch: pytest.MonkeyPatch, proxy: ProxyStub, claimed_after: int, on_device: bool) -> None:
    with _ranks(monkeypatch, on_device) as r:
        proxy.expect("x1", answer=_registration(r["port"]))
        pre = r["pre"].prefill
        pre.apply(RemoteD2HMetadata(late_send=[_late_job(proxy, "x1")]))
        for i, name in enumerate(NAMES):
            if i == claimed_after:
                proxy.release("x1")
                _until("claimed", lambda: pre.totals()["late_claims"] == 1)
            pre.save_kv_layer(name)
        pre.wait_for_save()
        if claimed_after == LAYERS:  # the forward ended before the decode registered
            proxy.wait_calls(1)
            assert pre.get_finished({"p1"}) == set()  # held: the claim is still waiting
            assert pre.gauges()["late_sends_waiting"] == 1
            proxy.release("x1")
        _received(r["dec"])
        for d, s in zip(r["dst"], r["src"], strict=True):
            assert torch.equal(d[:, DST], s[:, SRC])  # the blocks from the registration's offset
            assert not d[:, [b for b in range(D_BLOCKS) if b not in DST]].any()
        _released(pre, set() if claimed_after == LAYERS else {"p1"}, {"p1"})
        totals = pre.totals()
        assert (totals["late_claims"], totals["late_claim_failures"]) == (1, 0)
        assert totals["layers_published"] == LAYERS and totals["acks"] == LAYERS
        assert pre.gauges() == {"pending_slot_uses": 0, "late_sends_waiting": 0}
        assert proxy.calls["x1"] == 1


@pytest.mark.parametrize(("token", "answer", "why"), [
    ("wrong", None, "HTTP 403"),
    (None, {"remote_block_ids": list(range(7))}, "decode expects 7"),
    (None, {"transfer_protocol": "memfabric/sdma"}, "transfer protocol mismatch"),
], ids=["refused-claim", "blocks-do-not-line-up", "other-protocol"])
def test_a_failed_or_refused_claim_sends_nothing_and_frees_the_blocks(
        monkeypatch: pytest.MonkeyPatch, proxy: ProxyStub,
        token: str | None, answer: dict[str, Any] | None, why: str) -> None:
    # a handler of our own: the connector routes ascend_offload.* to vLLM's handlers
    # (not to the root's, where pytest's caplog listens)
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append  # type: ignore[method-assign]
    logger = logging.getLogger("ascend_offload.pd.late_sends")
    logger.addHandler(handler)
    with contextlib.ExitStack() as stack:
        stack.callback(logger.removeHandler, handler)
        r = stack.enter_context(_ranks(monkeypatch, False))
        proxy.expect("x1", answer=_registration(r["port"], **(answer or {})))
        pre = r["pre"].prefill
        pre.apply(RemoteD2HMetadata(late_send=[_late_job(proxy, "x1", token)]))
        for name in NAMES:
            pre.save_kv_layer(name)
        pre.wait_for_save()
        proxy.release("x1")
        _released(pre, {"p1"}, {"p1"})
        totals = pre.totals()
        assert (totals["late_claims"], totals["late_claim_failures"], totals["layers_published"]) == (0, 1, 0)
        assert pre.gauges() == {"pending_slot_uses": 0, "late_sends_waiting": 0}
        (line,) = [rec.getMessage() for rec in seen if "computed before its decode" in rec.getMessage()]
        assert "p1" in line and why in line and "t" * 32 not in line  # the request and why, never the token


def test_a_registered_send_and_a_late_one_share_a_step(monkeypatch: pytest.MonkeyPatch, proxy: ProxyStub) -> None:
    """The late send's claim ends mid-forward; the registered one is published as written."""
    with _ranks(monkeypatch, False) as r:
        dec = r["dec"]
        dec.decode.apply(RemoteD2HMetadata(recv=[RecvJob("r2", (1, 3))]))
        proxy.expect("x1", answer=_registration(r["port"]))
        pre = r["pre"].prefill
        pre.apply(RemoteD2HMetadata(send=[SendJob("p2", "r2", (4, 5), "127.0.0.1", r["port"], 1, 0)],
                                    late_send=[_late_job(proxy, "x1")]))
        pre.save_kv_layer(NAMES[0])
        proxy.release("x1")
        _until("claimed", lambda: pre.totals()["late_claims"] == 1)
        for name in NAMES[1:]:
            pre.save_kv_layer(name)
        pre.wait_for_save()
        got: set[str] = set()
        _until("decode received both", lambda: got.update(dec.decode.get_finished(set())[1]) or {"r1", "r2"} <= got)
        for d, s in zip(r["dst"], r["src"], strict=True):
            assert torch.equal(d[:, DST], s[:, SRC]) and torch.equal(d[:, [1, 3]], s[:, [4, 5]])
        _released(pre, {"p1", "p2"}, {"p1", "p2"})
        assert pre.totals()["layers_published"] == 2 * LAYERS


def test_layers_and_claims_racing_publish_each_layer_once(proxy: ProxyStub) -> None:
    """Forty requests, their claims released while their layers are being written on
    another thread: every layer of every request is published exactly once."""
    published: Counter[tuple[str, int]] = Counter()
    lock = threading.Lock()

    def record(job: SendJob, layer: int) -> None:
        with lock:
            published[(job.request_id, layer)] += 1

    def start(job: SendJob, layers: list[int]) -> bool:
        for layer in layers:
            record(job, layer)
        return True

    late = LateSends(start=start, publish=record, claim_timeout_s=WAIT_S)
    rng = random.Random(7)
    layers, n = 8, 40
    try:
        for i in range(n):
            pid = f"x{i}"
            proxy.expect(pid, answer={**REG, "remote_block_ids": [1, 2]})
            rid = f"p{i}"
            late.add(LateSendJob(rid, (5, 6), proxy.url, pid, proxy.tokens[pid]))
            release_at = rng.randrange(layers + 1)
            for layer in range(layers):
                if layer == release_at:
                    proxy.release(pid)
                late.written(layer, [rid])
                time.sleep(rng.random() / 2000)
            late.end_step([rid])
            if release_at == layers:
                proxy.release(pid)
        _until("every claim ended", lambda: late.claimed == n)
        assert late.waiting == 0 and late.failures == 0 and late.take_failed() == set()
        assert published == Counter({(f"p{i}", layer): 1 for i in range(n) for layer in range(layers)})
    finally:
        late.close()


def test_the_claim_starts_when_the_step_is_bound_before_any_layer(
        monkeypatch: pytest.MonkeyPatch, proxy: ProxyStub) -> None:
    """vLLM binds the step's metadata before the forward: the claim waits at the proxy while
    the model computes, instead of starting at the first layer's save."""
    with _ranks(monkeypatch, False) as r:
        proxy.expect("x1", answer=_registration(r["port"]))
        conn = r["pre"]
        conn.bind_connector_metadata(RemoteD2HMetadata(late_send=[_late_job(proxy, "x1")]))
        proxy.wait_calls(1)  # no hook of the forward has run yet
        proxy.release("x1")
        _until("claimed", lambda: conn.prefill.totals()["late_claims"] == 1)
        for name in NAMES:
            conn.save_kv_layer(name, None, None)
        conn.wait_for_save()
        _received(r["dec"])
        _released(conn.prefill, {"p1"}, {"p1"})
        assert conn.prefill.totals()["layers_published"] == LAYERS
