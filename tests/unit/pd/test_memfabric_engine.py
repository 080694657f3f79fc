"""MemFabricEngine over the fake MemFabric engine (same API as memfabric_hybrid's,
asserted in tests/unit/store/test_memcache_fake_api.py), the protocol mapping, and
prefill's per-request check that decode reads with the same transfer protocol."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ascend_offload.config import RemoteD2HConfig
from ascend_offload.pd.prefill_requests import PrefillRequests
from ascend_offload.pd.registration import DecodeRegistration, ProtocolGuard
from ascend_offload.transfer.base import (
    ReadOp,
    TransferError,
    create_engine,
    create_engine_for,
    transfer_protocol,
)
from ascend_offload.transfer.memfabric import PROTOCOLS, MemFabricEngine, data_op_type
from tests.support import fake_ascend as fa


def engine(role: str, protocol: str = "sdma", **kw: Any) -> MemFabricEngine:
    return MemFabricEngine(host="10.0.0.9", protocol=protocol, role=role, engine=fa.FakeTransferEngine(),
                           op_types=fa.FakeTransDataOpType, **kw)


def test_layer_pull_is_byte_equal_and_coalesced() -> None:
    p, d = engine("Prefill"), engine("Decode")
    src = torch.arange(4096, dtype=torch.uint8).view(8, 512).clone()
    dst = torch.zeros_like(src)
    p.register(src.data_ptr(), src.nbytes)
    d.register(dst.data_ptr(), dst.nbytes)
    ops = [ReadOp(dst[i].data_ptr(), src[i].data_ptr(), 512) for i in (2, 3, 4, 6)]
    assert d.read(p.endpoint, ops) == 2  # rows 2-4 contiguous on both sides: one run
    assert torch.equal(dst[[2, 3, 4, 6]], src[[2, 3, 4, 6]])
    assert int(dst[[0, 1, 5, 7]].sum()) == 0
    assert p.endpoint.startswith("10.0.0.9:")
    p.close()
    d.close()


def test_session_is_host_and_the_engines_port() -> None:
    """As vllm-ascend sets MemFabric up: session host:rpc_port, tcp://session as the store
    template, prefill serving the config store, the data-op type of the protocol."""
    raw = fa.FakeTransferEngine()
    e = MemFabricEngine(host="10.0.0.9", protocol="device_urma", role="Decode", device_id=5, nic="n",
                        engine=raw, op_types=fa.FakeTransDataOpType)
    session = f"10.0.0.9:{raw.get_rpc_port()}"
    assert e.endpoint == session
    assert raw.init_args == (f"tcp://{session}", session, "Decode", 5, fa.FakeTransDataOpType.DEVICE_URMA,
                             "Prefill", "n")


def test_a_read_the_library_refuses_is_a_transfer_error_naming_the_protocol() -> None:
    """What our engine does when MemFabric fails a read (here: the fake, like the library,
    fails one between mismatched data-op types): a ``TransferError`` naming our protocol.
    Our own guard refuses such a request before any read (next section)."""
    p, d = engine("Prefill", "device_rdma"), engine("Decode", "sdma")
    buf = torch.zeros(64, dtype=torch.uint8)
    out = torch.zeros(64, dtype=torch.uint8)
    p.register(buf.data_ptr(), 64)
    d.register(out.data_ptr(), 64)
    with pytest.raises(TransferError, match="sdma"):
        d.read(p.endpoint, [ReadOp(out.data_ptr(), buf.data_ptr(), 64)])


def test_unregistered_ranges_and_closed_engines_fail() -> None:
    p, d = engine("Prefill"), engine("Decode")
    buf = torch.ones(64, dtype=torch.uint8)
    out = torch.zeros(64, dtype=torch.uint8)
    p.register(buf.data_ptr(), 32)
    d.register(out.data_ptr(), 64)
    with pytest.raises(TransferError, match="rc=-1"):
        d.read(p.endpoint, [ReadOp(out.data_ptr(), buf.data_ptr(), 64)])
    d.read(p.endpoint, [ReadOp(out.data_ptr(), buf.data_ptr(), 32)])
    assert int(out.sum()) == 32
    d.close()
    with pytest.raises(TransferError, match="closed"):
        d.read(p.endpoint, [ReadOp(out.data_ptr(), buf.data_ptr(), 32)])
    with pytest.raises(ValueError, match="role='Both'"):
        engine("Both")
    with pytest.raises(ValueError, match="register length=0"):
        p.register(buf.data_ptr(), 0)


def test_protocols_map_to_the_wheels_data_op_types() -> None:
    for name, member in PROTOCOLS.items():
        assert data_op_type(name, fa.FakeTransDataOpType) == getattr(fa.FakeTransDataOpType, member)
    with pytest.raises(ValueError, match="accepted: 'sdma', 'device_rdma', 'device_urma'"):
        data_op_type("host_rdma", fa.FakeTransDataOpType)
    mf = pytest.importorskip("memfabric_hybrid", reason="the 'ascend' extra is not installed")
    got = {p: int(data_op_type(p, mf.TransDataOpType)) for p in PROTOCOLS}
    assert got == {"sdma": 1, "device_rdma": 8, "device_urma": 64}
    # every protocol the config accepts has a mapping
    accepted = RemoteD2HConfig.model_fields["memfabric_transfer_protocol"].annotation.__args__  # type: ignore[union-attr]
    assert set(accepted) == set(PROTOCOLS)


def test_real_wheel_without_the_driver_fails_at_initialize() -> None:
    """The real engine is driven up to initialize, which needs the Ascend driver."""
    pytest.importorskip("memfabric_hybrid", reason="the 'ascend' extra is not installed")
    try:
        import torch_npu  # noqa: F401
        pytest.skip("an Ascend stack is present: tests/npu runs the real engine")
    except ImportError:
        pass
    with pytest.raises(TransferError, match=r"MemFabric initialize\(.*protocol='device_rdma'"):
        create_engine("memfabric", protocol="device_rdma", role="Decode")


def test_transfer_protocol_names() -> None:
    assert transfer_protocol(RemoteD2HConfig()) == "mooncake/tcp"
    assert transfer_protocol(RemoteD2HConfig(mooncake_protocol="rdma")) == "mooncake/rdma"
    assert transfer_protocol(RemoteD2HConfig(transfer_backend="memfabric",
                                             memfabric_transfer_protocol="device_urma")) == "memfabric/device_urma"


def test_engine_for_config_uses_the_backends_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    import ascend_offload.transfer.memfabric as mfmod

    monkeypatch.setattr(mfmod, "MemFabricEngine", lambda **kw: seen.update(kw) or "engine")
    cfg = RemoteD2HConfig(transfer_backend="memfabric", memfabric_transfer_protocol="device_rdma",
                          memfabric_nic="tcp://10.1.1.1:7001")
    assert create_engine_for(cfg, host="h", role="Prefill", device_id=3) == "engine"
    assert seen == {"host": "h", "protocol": "device_rdma", "role": "Prefill", "device_id": 3,
                    "nic": "tcp://10.1.1.1:7001"}


# --------------------------------------------------------------------------- protocol check


def _params(**kw: Any) -> dict[str, Any]:
    base = {"do_remote_decode": True, "do_remote_prefill": False, "remote_host": "10.0.0.2",
            "remote_port": 7000, "remote_request_id": "dec-1", "remote_block_ids": [30, 31],
            "transfer_protocol": "memfabric/sdma"}
    return {**base, **kw}


def test_prefill_refuses_a_mismatched_decode_per_request(caplog: pytest.LogCaptureFixture) -> None:
    reqs = PrefillRequests("memfabric/sdma")
    req = lambda rid: SimpleNamespace(request_id=rid, num_prompt_tokens=32, num_computed_tokens=0)  # noqa: E731
    with caplog.at_level(logging.ERROR, logger="ascend_offload.pd.registration"):
        assert reqs.after_alloc(req("a"), _params(transfer_protocol="memfabric/device_rdma")) is False
        assert reqs.after_alloc(req("b"), _params(transfer_protocol="memfabric/device_rdma")) is False
        assert reqs.after_alloc(req("c"), _params()) is True  # the same protocol is served
        assert reqs.after_alloc(req("d"), _params(transfer_protocol="")) is False  # nothing advertised
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2, logged  # once per advertised protocol, not per request
    assert "'memfabric/device_rdma'" in logged[0] and "'memfabric/sdma'" in logged[0]
    err = reqs.take_error("a")
    assert err is not None and "transfer protocol mismatch" in str(err)
    assert reqs.take_sends({"c": 32}, {"c": [1, 2]}.get)[0].request_id == "c"
    assert reqs.protocol is not None and reqs.protocol.refused == 3


def test_protocol_guard_log_is_bounded(caplog: pytest.LogCaptureFixture) -> None:
    g = ProtocolGuard("mooncake/tcp")
    reg = DecodeRegistration(remote_host="h", remote_port=1, remote_request_id="r", remote_block_ids=[])
    with caplog.at_level(logging.ERROR, logger="ascend_offload.pd.registration"):
        for i in range(3 * ProtocolGuard.MAX_LOGGED):
            assert g.refuse(DecodeRegistration(**{**reg.to_wire(), "transfer_protocol": f"x/{i}"})) is not None
    assert len(caplog.records) == ProtocolGuard.MAX_LOGGED
    assert g.refused == 3 * ProtocolGuard.MAX_LOGGED


def test_advertised_protocol_is_bounded_at_the_boundary() -> None:
    from ascend_offload.pd.registration import ParamsError

    with pytest.raises(ParamsError, match="transfer_protocol"):
        DecodeRegistration.from_params(_params(transfer_protocol="x" * 65))


def _vllm_config(extra: dict[str, Any], role: str) -> Any:
    tc = SimpleNamespace(kv_connector_extra_config=extra, is_kv_producer=role == "kv_producer",
                         is_kv_consumer=role == "kv_consumer", engine_id="E", kv_port=7000)
    return SimpleNamespace(kv_transfer_config=tc, parallel_config=SimpleNamespace(tensor_parallel_size=1),
                           model_config=SimpleNamespace(use_mla=True), cache_config=SimpleNamespace(block_size=16))


def test_settings_select_memfabric_and_advertise_its_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    from ascend_offload.config import ConfigError
    from ascend_offload.connectors.remote_d2h import settings as st

    extra = {"transfer_backend": "memfabric", "memfabric_transfer_protocol": "device_rdma", "host": "10.0.0.3"}
    vc = _vllm_config(extra, "kv_consumer")
    monkeypatch.setattr(st.importlib.util, "find_spec", lambda name: object())
    s = st.build_settings(vc, st.parse_config(vc))
    assert s.endpoint.transfer_protocol == "memfabric/device_rdma"
    monkeypatch.setattr(st.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="key 'transfer_backend'='memfabric'"):
        st.build_settings(vc, st.parse_config(vc))


def test_memfabric_declares_device_memory() -> None:
    """MemFabric moves HBM, so device-resident KV is registered in place, not staged
    (docs/pd.md, "Device-resident KV"; a refused registration still falls back)."""
    assert engine("Decode").device_memory
    assert engine("Prefill", protocol="device_rdma").device_memory
