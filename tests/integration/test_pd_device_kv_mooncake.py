"""SfaRemoteD2HConnector with the KV on the (fake) accelerator over the real Mooncake
transfer engine, TCP on 127.0.0.1: TCP reaches host memory only, so both ranks stage
through pinned host twins; decode's KV equals prefill's blocks byte for byte."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("mooncake.engine")
pytest.importorskip("vllm")

from ascend_offload.connectors.remote_d2h import kv_region
from ascend_offload.transfer.mooncake import MooncakeEngine
from tests.support.fake_device import FakeDevice
from tests.unit.pd.test_rd2h_device_kv import DST, LAYERS, SRC, _run

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


class _Real:
    """The connector's own engine (Mooncake, from the config), recorded."""

    def __init__(self, fake: FakeDevice) -> None:
        self.made: list[Any] = []
        self._make = kv_region._engine

    def __call__(self, cfg: Any, host: str, is_producer: bool = False, device_id: int = 0) -> Any:
        eng = self._make(cfg, host, is_producer, device_id)
        self.made.append(eng)
        return eng


def test_mooncake_tcp_stages_device_kv(monkeypatch) -> None:
    out = _run(monkeypatch, on_device=True, engines=_Real)
    assert out["errors"] == set() and out["staged"] == [True, True]
    assert all(isinstance(e, MooncakeEngine) and not e.device_memory for e in out["engines"])
    for d, s in zip(out["dst"], out["src"], strict=True):
        assert torch.equal(d[:, DST], s[:, SRC])
    fake = out["fake"]
    for region in out["regions"]:  # what Mooncake registered and peers address: host twins only
        spans = [(t.base_addr, t.num_blocks * t.block_stride) for layer in region.layers for t in layer.main]
        assert len(spans) == 2 * LAYERS and not any(fake.touches(a, n) for a, n in spans)
        assert region.registered and not any(fake.touches(a, 1) for a in region.registered)
