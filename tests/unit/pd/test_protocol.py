from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_offload.pd import protocol as P


def _meta(**kw):
    base = dict(version=P.PROTOCOL_VERSION, engine_id="p0", p_rank=0, p_tp=2, endpoint="127.0.0.1:1",
                layers=[P.LayerDesc(main=[P.TensorDesc(4096, 64, 64, 10)], indexer=None)])
    base.update(kw)
    return P.MfMeta(**base)


def _ready(**kw):
    item = dict(request_id="r1", layer=0, slot=0, generation=1, src_blocks=[1, 2, 3], main=True,
                index_lo=0, index_hi=3)
    item.update(kw.pop("item", {}))
    base = dict(version=P.PROTOCOL_VERSION, engine_id="p0", p_rank=0, read_budget_ms=1000,
                items=[P.ReadReady(**item)])
    base.update(kw)
    return P.ReadReadyBatch(**base)


def _done(cls=P.ReadDone, **kw):
    base = dict(version=P.PROTOCOL_VERSION, engine_id="d0", d_rank=0, p_rank=0, request_id="r1",
                layer=0, slot=0, generation=1)
    if cls is P.ReadFailed:
        base.update(code=P.FAIL_READ, reason="boom")
    base.update(kw)
    return cls(**base)


@pytest.mark.parametrize("msg", [_meta(), _ready(), _done(), _done(P.ReadFailed)])
def test_roundtrip_and_tag_first(msg):
    data = P.encode(msg)
    assert P.decode(data) == msg
    raw = msgpack.unpackb(data)
    assert raw[0] == {"MfMeta": "mf_meta", "ReadReadyBatch": "read_ready_batch",
                      "ReadDone": "read_done", "ReadFailed": "read_failed"}[type(msg).__name__]
    assert raw[1] == P.PROTOCOL_VERSION


def test_version_mismatch_rejected_by_name():
    with pytest.raises(P.ProtocolError, match="version=99"):
        P.decode(P.encode(_done(version=99)))


def test_direction_enforced():
    with pytest.raises(P.ProtocolError, match="unexpected ReadDone"):
        P.decode(P.encode(_done()), expect=P.TO_DECODE)


@pytest.mark.parametrize("data", [b"", b"\x00", b"garbage", msgpack.packb(["read_done", 1]),
                                  msgpack.packb(["nope", 1, 2]), msgpack.packb({"a": 1})])
def test_garbage_rejected(data):
    with pytest.raises(P.ProtocolError):
        P.decode(data)


def test_negative_block_rejected():
    data = P.encode(_ready())
    raw = msgpack.unpackb(data)
    raw[5][0][4] = [1, -2, 3]
    with pytest.raises(P.ProtocolError):
        P.decode(msgpack.packb(raw))


def test_index_range_checked():
    with pytest.raises(P.ProtocolError, match="indexer range"):
        P.decode(P.encode(_ready(item=dict(index_lo=2, index_hi=5))))
    with pytest.raises(P.ProtocolError, match="indexer range"):
        P.decode(P.encode(_ready(item=dict(index_lo=2, index_hi=1))))


def test_meta_checks():
    with pytest.raises(P.ProtocolError, match="p_rank=2 not below p_tp=2"):
        P.decode(P.encode(_meta(p_rank=2)))
    with pytest.raises(P.ProtocolError, match="block_stride"):
        P.decode(P.encode(_meta(layers=[P.LayerDesc(main=[P.TensorDesc(0, 64, 32, 1)])])))


def test_unknown_fail_code_rejected():
    with pytest.raises(P.ProtocolError, match="code='weird'"):
        P.decode(P.encode(_done(P.ReadFailed, code="weird")))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_only_protocol_error(data):
    try:
        P.decode(data)
    except P.ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 200), st.integers(0, 7))
def test_fuzz_mutated_valid_message(pos, bit):
    data = bytearray(P.encode(_ready()))
    data[pos % len(data)] ^= 1 << bit
    try:
        P.decode(bytes(data))
    except P.ProtocolError:
        pass
