"""SfaRemoteD2HConnector with KV on an accelerator (the fake device: CPU memory that
``device.is_host`` calls device memory and whose bytes only ``device.py`` may touch).

Both worker roles run in one process over real ZMQ on 127.0.0.1: a prefill rank
publishes, a decode rank pulls. A host-only engine must never see a device address
(the KV is staged through pinned host twins); an engine that reaches device memory
registers the KV in place. Either way decode's KV must equal what the host path
produces, byte for byte.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from ascend_offload import device
from ascend_offload.connectors.remote_d2h import SfaRemoteD2HConnector, kv_region
from ascend_offload.connectors.remote_d2h.metadata import RecvJob, RemoteD2HMetadata, SendJob
from ascend_offload.harness.servers import free_port
from ascend_offload.pd.layout import extents, layer_desc
from ascend_offload.transfer.base import TransferError
from ascend_offload.transfer.staged import StagedEngine
from tests.support.fake_device import (
    FakeDevice,
    FakeDeviceAccess,
    GuardedEngine,
    installed,
)

LAYERS, P_BLOCKS, D_BLOCKS = 3, 10, 8
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
SRC, DST = [7, 1, 2, 3, 9], [0, 4, 5, 6, 2]


def _config(*, producer: bool, port: int, layerwise: bool) -> Any:
    tc = SimpleNamespace(kv_connector_extra_config={"host": "127.0.0.1", "use_layerwise": layerwise,
                                                    "ack_timeout_s": 10.0, "request_timeout_s": 20.0},
                         is_kv_producer=producer, is_kv_consumer=not producer,
                         engine_id="P" if producer else "D", kv_port=port)
    return SimpleNamespace(kv_transfer_config=tc, cache_config=SimpleNamespace(block_size=4),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_rank=0),
                           model_config=SimpleNamespace(use_mla=False))


def _kv(num_blocks: int, seed: int | None) -> list[torch.Tensor]:
    """vLLM's (2, num_blocks, block_size, heads * dim) K/V stacks, one per layer."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    return [torch.randn((2, num_blocks, 4, 6), generator=g) if g else torch.zeros((2, num_blocks, 4, 6))
            for _ in range(LAYERS)]


class _Engines:
    """The engines ``kv_region`` builds, made by the test: guarded loopback engines."""

    def __init__(self, fake: FakeDevice, device_memory: bool, refuse_device: bool = False) -> None:
        self.fake, self.device_memory, self.refuse_device = fake, device_memory, refuse_device
        self.made: list[GuardedEngine] = []

    def __call__(self, cfg: Any, host: str, is_producer: bool = False, device_id: int = 0) -> GuardedEngine:
        eng = GuardedEngine(self.fake, device_memory=self.device_memory)
        if self.refuse_device:  # claims device memory, but its registration refuses it (no GPUDirect)
            eng.device_memory = True
            guard = GuardedEngine._check

            def check(what: str, addr: int, length: int, eng: GuardedEngine = eng) -> None:
                eng.device_memory = what != "register"
                try:
                    guard(eng, what, addr, length)
                finally:
                    eng.device_memory = True

            eng._check = check  # type: ignore[method-assign]
        self.made.append(eng)
        return eng


def _run(monkeypatch: pytest.MonkeyPatch, *, on_device: bool, device_memory: bool = False,
         refuse_device: bool = False, layerwise: bool = True,
         engines: Callable[[FakeDevice], Any] | None = None) -> dict[str, Any]:
    """One request's prompt KV from a prefill rank to a decode rank; decode's KV after.
    ``engines`` makes the engine factory (with a ``made`` list) for the fake device;
    default: guarded loopback engines."""
    monkeypatch.setattr("vllm.distributed.parallel_state.get_tensor_model_parallel_rank", lambda: 0)
    src, dst = _kv(P_BLOCKS, seed=3), _kv(D_BLOCKS, seed=None)
    with installed() as fake:
        factory = engines(fake) if engines else _Engines(fake, device_memory, refuse_device)
        monkeypatch.setattr(kv_region, "_engine", factory)
        place = fake.place if on_device else (lambda t: t)
        port = free_port()
        dec = SfaRemoteD2HConnector(_config(producer=False, port=port, layerwise=layerwise),
                                    KVConnectorRole.WORKER, SimpleNamespace(num_blocks=D_BLOCKS, kv_cache_groups=[]))
        pre = SfaRemoteD2HConnector(_config(producer=True, port=port, layerwise=layerwise),
                                    KVConnectorRole.WORKER, SimpleNamespace(num_blocks=P_BLOCKS, kv_cache_groups=[]))
        try:
            dec.register_kv_caches({n: place(t) for n, t in zip(NAMES, dst, strict=True)})
            pre.register_kv_caches({n: place(t) for n, t in zip(NAMES, src, strict=True)})
            assert dec.decode is not None and pre.prefill is not None
            dec.decode.apply(RemoteD2HMetadata(recv=[RecvJob("r1", tuple(DST))]))
            pre.prefill.apply(RemoteD2HMetadata(send=[SendJob("p1", "r1", tuple(SRC), "127.0.0.1", port, 1, 0)]))
            if layerwise:
                for n in NAMES:
                    pre.prefill.save_kv_layer(n)
            pre.prefill.wait_for_save()
            received: set[str] = set()
            end = time.monotonic() + 20
            while "r1" not in received and time.monotonic() < end:
                received |= dec.decode.get_finished(set())[1]
                time.sleep(0.01)
            assert "r1" in received
            sent: set[str] = set()
            while "p1" not in sent and time.monotonic() < end:
                sent |= pre.prefill.get_finished({"p1"})
                time.sleep(0.01)
            assert "p1" in sent
            regions = [dec._region, pre._region]
            return {"dst": [t.clone() for t in dst], "src": src, "fake": fake, "engines": factory.made,
                    "errors": dec.decode.take_load_errors(), "regions": regions,
                    "staged": [r is not None and r.mirror is not None for r in regions]}
        finally:
            dec.shutdown()
            pre.shutdown()


@pytest.mark.parametrize("layerwise", [True, False])
def test_host_only_engine_stages_device_kv_byte_identical(monkeypatch, layerwise: bool) -> None:
    host = _run(monkeypatch, on_device=False, layerwise=layerwise)
    dev = _run(monkeypatch, on_device=True, layerwise=layerwise)
    assert host["errors"] == set() and dev["errors"] == set()
    for h, d, s in zip(host["dst"], dev["dst"], dev["src"], strict=True):
        assert torch.equal(d, h)  # the staged path wrote exactly the host path's bytes
        assert torch.equal(d[:, DST], s[:, SRC])
        assert not d[:, [b for b in range(D_BLOCKS) if b not in DST]].any()
    assert host["staged"] == [False, False] and dev["staged"] == [True, True]
    fake = dev["fake"]
    for eng in dev["engines"]:  # no device address ever reached the host-only transport
        assert eng.violations == [] and eng.registered and eng.read_ranges is not None
        assert not any(fake.touches(a, n) for a, n in eng.registered + eng.read_ranges)
    assert sum(len(e.read_ranges) for e in dev["engines"]) > 0
    d_region = dev["regions"][0]
    assert isinstance(d_region.engine, StagedEngine)
    assert d_region.engine.landed_blocks == LAYERS * 2 * len(DST)  # K and V blocks of every layer
    assert fake.accesses > 0


def test_device_capable_engine_registers_device_memory_in_place(monkeypatch) -> None:
    dev = _run(monkeypatch, on_device=True, device_memory=True)
    assert dev["errors"] == set() and dev["staged"] == [False, False]
    for d, s in zip(dev["dst"], dev["src"], strict=True):
        assert torch.equal(d[:, DST], s[:, SRC])
    fake = dev["fake"]
    for eng in dev["engines"]:  # the KV itself is registered: no host twin in between
        assert eng.registered and all(fake.touches(a, n) for a, n in eng.registered)
    assert fake.accesses == 0  # nothing was staged


def test_refused_device_registration_falls_back_to_staging(monkeypatch) -> None:
    """An RDMA engine without GPUDirect refuses device memory: the region stages instead."""
    dev = _run(monkeypatch, on_device=True, refuse_device=True)
    assert dev["errors"] == set() and dev["staged"] == [True, True]
    for d, s in zip(dev["dst"], dev["src"], strict=True):
        assert torch.equal(d[:, DST], s[:, SRC])
    fake = dev["fake"]
    for eng in dev["engines"]:
        assert len(eng.violations) == 1  # the one refused attempt, rolled back
        assert not any(fake.touches(a, n) for a, n in eng.registered[1:])


def test_guard_and_fake_catch_the_unstaged_path() -> None:
    """Negative controls: registering device KV in place with a host-only engine is refused,
    and reading device bytes outside device.py raises."""
    with installed() as fake:
        kv = fake.place(torch.zeros(2, 4, 4, 6))
        eng = GuardedEngine(fake)
        ((views, _),) = kv_region.kv_views({"model.layers.0.attn": kv}, [("model.layers.0.attn", None)], 4)
        ((addr, length),) = extents([layer_desc(views)])
        with pytest.raises(TransferError):
            eng.register(addr, length)
        assert eng.violations
        with pytest.raises(FakeDeviceAccess):
            views[0].clone()
        with pytest.raises(FakeDeviceAccess):
            views[1].fill_(1.0)
        assert not device.is_host(views[0]) and device.is_host(torch.zeros(1))
        eng.close()
