"""SfaRemoteD2HConnector under layer sharing (AscendMultiConnector): the reuse-gate
tokens it takes for decode's reads, what it publishes with them, and that nothing
is left holding a slot (the e2e run is tests/e2e/test_pd_layerwise_e2e.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from ascend_offload.config import ConfigError
from ascend_offload.connectors import remote_d2h as rd
from ascend_offload.layerwise.gate import GateTimeout, ReuseGate
from ascend_offload.pd.producer import SlotRelease, gate_listener


class _Pipeline:
    """A ``SlotSharing`` (what the connector uses of a LayerwisePipeline), with a real gate."""

    def __init__(self) -> None:
        self.gate = ReuseGate(2, default_timeout_s=0.2)
        self.listeners: list[Any] = []
        self.failed_from: int | None = None  # index of the first layer whose load failed
        self.failed: frozenset[str] | None = None  # ... for these requests (None: all)

    def failed_requests_at_or_before(self, layer: str) -> frozenset[str] | None:
        if self.failed_from is None or int(layer[1:]) < self.failed_from:
            return frozenset()
        return self.failed

    def add_save_listener(self, fn: Any) -> None:
        self.listeners.append(fn)

    def members_of(self, layer: str) -> tuple[str, ...]:
        return (layer,)


class _Producer:
    def __init__(self) -> None:
        self.published: list[dict[str, Any]] = []
        self.listener: Any = None

    def publish_layer(self, layer: int, **kw: Any) -> int:
        self.published.append(dict(kw, layer=layer))
        return 1


def _connector(monkeypatch: pytest.MonkeyPatch, **extra: Any) -> rd.SfaRemoteD2HConnector:
    monkeypatch.setattr("vllm.distributed.parallel_state.get_tensor_model_parallel_rank", lambda: 0)
    tc = SimpleNamespace(kv_connector_extra_config={"host": "127.0.0.1", "ack_timeout_s": 3.0, **extra},
                         is_kv_producer=True, is_kv_consumer=False, engine_id="P0", kv_port=0)
    cfg = SimpleNamespace(kv_transfer_config=tc, cache_config=SimpleNamespace(block_size=16),
                          parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_rank=0),
                          model_config=SimpleNamespace(use_mla=True))
    conn = rd.SfaRemoteD2HConnector(cfg, KVConnectorRole.WORKER, SimpleNamespace(num_blocks=8, kv_cache_groups=[]))
    conn.prefill._layer_index = {"l0": 0, "l1": 1}
    return conn


def test_decode_reads_hold_the_slot_until_the_producer_releases(monkeypatch) -> None:
    conn = _connector(monkeypatch)
    pipe = _Pipeline()
    conn.attach_reuse_gate(pipe)
    assert pipe.gate.default_timeout_s >= 3.0 + 5.0  # writers outwait the ack deadline
    prod = _Producer()
    conn.prefill._producers[1] = prod
    conn.prefill._step_sends = {1: ["r1"]}
    lease = pipe.gate.acquire_write(1, "l1")
    pipe.listeners[0]("l1", 1, lease.generation)  # inside save_layer(l1), before the hand-off
    pipe.gate.release_write(lease)
    conn.prefill._publish(1, "l1")
    (pub,) = prod.published
    assert pub["slot"] == 1 and pub["request_ids"] == ["r1"] and pub["tag"] is not None
    with pytest.raises(GateTimeout):  # the next layer of slot 1 must wait for decode
        pipe.gate.acquire_write(1, "l3", timeout_s=0.05)
    # The producer's release (every read answered) reopens the slot.
    gate_listener(pipe.gate)(SlotRelease(slot=1, generation=1, layer=1, ok=True, tag=pub["tag"]))
    pipe.gate.release_write(pipe.gate.acquire_write(1, "l3", timeout_s=0.05))


def test_layers_after_a_failed_store_load_are_withheld(monkeypatch) -> None:
    """A store load of the step failed at l1: l0 is published, l1 is not (its KV is
    wrong) and its slot is free at once; decode recomputes what it never got."""
    conn = _connector(monkeypatch)
    pipe = _Pipeline()
    conn.attach_reuse_gate(pipe)
    prod = _Producer()
    conn.prefill._producers[1] = prod
    conn.prefill._step_sends = {1: ["r1"]}
    pipe.failed_from = 1
    for layer, slot in (("l0", 0), ("l1", 1)):
        lease = pipe.gate.acquire_write(slot, layer)
        pipe.listeners[0](layer, slot, lease.generation)
        pipe.gate.release_write(lease)
        conn.prefill._publish(int(layer[1:]), layer)
    assert [p["layer"] for p in prod.published] == [0]
    assert conn.prefill.withheld_layers == 1 and "l1" not in conn.prefill._gate_tokens
    pipe.gate.release_write(pipe.gate.acquire_write(1, "l3", timeout_s=0.05))  # slot 1 free


def test_a_failed_store_load_withholds_only_its_requests(monkeypatch) -> None:
    """The load failed at l1 for request A only: l1 is published for B (its KV is right),
    not for A; l0 for both."""
    conn = _connector(monkeypatch)
    pipe = _Pipeline()
    conn.attach_reuse_gate(pipe)
    prod = _Producer()
    conn.prefill._producers[1] = prod
    conn.prefill._step_sends = {1: ["rA", "rB"]}
    conn.prefill._by_remote.update({(1, "rA"): "A", (1, "rB"): "B"})
    pipe.failed_from, pipe.failed = 1, frozenset({"A"})
    for layer, slot in (("l0", 0), ("l1", 1)):
        lease = pipe.gate.acquire_write(slot, layer)
        pipe.listeners[0](layer, slot, lease.generation)
        pipe.gate.release_write(lease)
        conn.prefill._publish(int(layer[1:]), layer)
    assert [(p["layer"], p["request_ids"]) for p in prod.published] == [(0, ["rA", "rB"]), (1, ["rB"])]
    assert conn.prefill.withheld_layers == 1


def test_tokens_of_unpublished_layers_are_released_at_step_end(monkeypatch) -> None:
    conn = _connector(monkeypatch)
    pipe = _Pipeline()
    conn.attach_reuse_gate(pipe)
    conn.prefill._producers[1] = _Producer()
    conn.prefill._step_sends = {1: ["r1"]}
    lease = pipe.gate.acquire_write(0, "l0")
    pipe.listeners[0]("l0", 0, lease.generation)
    pipe.gate.release_write(lease)
    conn.wait_for_save()  # l0 was never published this step
    pipe.gate.release_write(pipe.gate.acquire_write(0, "l2", timeout_s=0.05))
    assert conn.prefill._gate_tokens == {}


def test_nothing_to_send_takes_no_token(monkeypatch) -> None:
    conn = _connector(monkeypatch)
    pipe = _Pipeline()
    conn.attach_reuse_gate(pipe)
    conn.prefill._step_sends = {}
    lease = pipe.gate.acquire_write(1, "l1")
    pipe.listeners[0]("l1", 1, lease.generation)
    pipe.gate.release_write(lease)
    assert conn.prefill._gate_tokens == {} and conn.prefill.gate_holds == 0
    # The slot is free at once: a held token would make this acquire raise GateTimeout.
    pipe.gate.release_write(pipe.gate.acquire_write(1, "l3", timeout_s=0.05))
    assert pipe.gate.stats().waits == 0


def test_layer_sharing_needs_per_layer_publishing(monkeypatch) -> None:
    conn = _connector(monkeypatch, use_layerwise=False)
    with pytest.raises(ConfigError, match="use_layerwise"):
        conn.attach_reuse_gate(_Pipeline())


def test_an_indexer_follower_takes_no_token_of_its_own(monkeypatch) -> None:
    """The sparse model: the pipeline saves a main layer with its indexer cache (one unit);
    the wire layer carries both, so one token per decode TP size holds the slot and the
    main layer's publish hands it on: the slot's next layer needs nothing else."""
    conn = _connector(monkeypatch)
    pipe = _Pipeline()
    pipe.members_of = lambda layer: (layer, f"{layer}.indexer")  # type: ignore[method-assign]
    conn.attach_reuse_gate(pipe)
    prod = _Producer()
    conn.prefill._producers[1] = prod
    conn.prefill._step_sends = {1: ["r1"]}
    lease = pipe.gate.acquire_write(1, "l1")
    pipe.listeners[0]("l1", 1, lease.generation)
    pipe.gate.release_write(lease)
    assert set(conn.prefill._gate_tokens) == {"l1"} and conn.prefill.gate_holds == 1
    conn.prefill._publish(1, "l1")
    (pub,) = prod.published
    assert conn.prefill._gate_tokens == {}
    gate_listener(pipe.gate)(SlotRelease(slot=1, generation=1, layer=1, ok=True, tag=pub["tag"]))
    # Within the step (no wait_for_save yet) the next layer of the slot may write.
    pipe.gate.release_write(pipe.gate.acquire_write(1, "l3", timeout_s=0.05))
