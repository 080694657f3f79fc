"""Prefill and decode rank processes exchange layers over Mooncake TCP on 127.0.0.1."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("mooncake.engine")

from ascend_offload.harness.servers import free_port_range
from tests.support.pd_ranks import KVShape, RankConfig, expected_blocks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SHAPE = KVShape(num_layers=4, num_blocks=32, main_block_bytes=2048, indexer_block_bytes=256)


def assert_blocks_equal(got, want) -> None:
    for layer, ((gkv, gidx), (wkv, widx)) in enumerate(zip(got, want, strict=True)):
        assert np.array_equal(gkv, wkv), f"main KV of layer {layer} differs"
        if widx is not None:
            assert np.array_equal(gidx, widx), f"indexer of layer {layer} differs"


def test_two_processes_byte_identical(ranks):
    port = free_port_range(1)
    d = ranks(RankConfig("decode", 0, 1, 1, SHAPE, kv_port=port))
    p = ranks(RankConfig("prefill", 0, 1, 1, SHAPE))
    reqs = {"a": ([3, 4, 5, 6, 7], [10, 11, 12, 13, 14]),  # contiguous on both sides
            "b": ([31, 0, 17], [1, 30, 2]),  # scattered
            "c": ([20], [20])}
    for rid, (src, dst) in reqs.items():
        d.call("expect", rid, dst)
        p.call("add", rid, src, "127.0.0.1", port, 1)
    p.call("run", list(range(SHAPE.num_layers)))
    outs = d.call("wait", 3, 30.0, timeout_s=40)
    assert sorted((o[0], o[1], o[2]) for o in outs) == [("a", True, ()), ("b", True, ()), ("c", True, ())]
    for src, dst in reqs.values():
        assert_blocks_equal(d.call("blocks", dst), expected_blocks(SHAPE, 1234, src))
    untouched = sorted(set(range(SHAPE.num_blocks)) - {b for _, dst in reqs.values() for b in dst})
    for kv, idx in d.call("blocks", untouched):
        assert not kv.any() and not idx.any()
    sent = p.call("finished", 3, 10.0)
    assert sorted(sent) == [("a", True, ()), ("b", True, ()), ("c", True, ())]
    st = d.call("stats")
    assert st["reads"] == 3 * SHAPE.num_layers  # one batched read per (request, layer)
    # request "a" is contiguous: 3 tensors -> 3 descriptors per layer, not 15
    assert st["descriptors"] < st["items"] * 5 * 3
    assert p.call("pending_slots") == {}
    assert d.call("active") == []


def test_decode_killed_mid_transfer_slot_freed(ranks):
    """Decode dies after reading part of a request: prefill fails the slot at its deadline, then serves on."""
    port = free_port_range(1)
    d = ranks(RankConfig("decode", 0, 1, 1, SHAPE, kv_port=port))
    # The prefill's 1 s ack deadline passes only when the test advances its clock.
    p = ranks(RankConfig("prefill", 0, 1, 1, SHAPE, ack_timeout_s=1.0, manual_clock=True))
    d.call("expect", "r1", [0, 1, 2])
    p.call("add", "r1", [5, 6, 7], "127.0.0.1", port, 1)
    p.call("publish", 0)
    p.call("publish", 1)
    acked: list = []
    deadline = time.monotonic() + 20
    while not acked and time.monotonic() < deadline:
        acked += [r for r in p.call("drain_releases") if r[2]]
        time.sleep(0.05)
    assert acked, "decode never acknowledged layer 0 or 1"  # decode is mid-transfer
    d.kill()
    p.call("publish", 2)
    p.call("publish", 3)
    assert p.call("finished", 1, 0.5) == []  # nobody answers layers 2 and 3, the deadline is ahead
    p.call("advance", 2.0)
    sent = p.call("finished", 1, 20.0, timeout_s=30)  # ends by the ack deadline, never a hang
    assert len(sent) == 1 and sent[0][0] == "r1" and not sent[0][1]
    assert 2 in sent[0][2] and 3 in sent[0][2]
    assert p.call("pending_slots") == {}
    st = p.call("stats")
    assert st["timed_out"] >= 2
    # A fresh decode on another port: the same prefill serves the next request.
    port2 = free_port_range(1)
    d2 = ranks(RankConfig("decode", 0, 1, 1, SHAPE, kv_port=port2))
    d2.call("expect", "r2", [4, 5])
    p.call("add", "r2", [8, 9], "127.0.0.1", port2, 1)
    p.call("run", list(range(SHAPE.num_layers)))
    outs = d2.call("wait", 1, 20.0, timeout_s=30)
    assert [(o[0], o[1]) for o in outs] == [("r2", True)]
    assert_blocks_equal(d2.call("blocks", [4, 5]), expected_blocks(SHAPE, 1234, [8, 9]))
    assert p.call("finished", 1, 10.0) == [("r2", True, ())]


def test_prefill_killed_decode_fails_request_and_holds_nothing(ranks):
    port = free_port_range(1)
    d = ranks(RankConfig("decode", 0, 1, 1, SHAPE, kv_port=port, request_timeout_s=1.5))
    p = ranks(RankConfig("prefill", 0, 1, 1, SHAPE))
    d.call("expect", "r1", [0, 1, 2, 3])
    p.call("add", "r1", [0, 1, 2, 3], "127.0.0.1", port, 1)
    p.call("publish", 0)
    p.kill()
    outs = d.call("wait", 1, 20.0, timeout_s=30)
    assert len(outs) == 1 and outs[0][0] == "r1" and not outs[0][1]
    assert outs[0][2] == (0, 1, 2, 3)  # every block is a load error
    assert any("timeout" in r for r in outs[0][3])
    assert d.call("active") == []


def test_authenticated_control_plane_across_processes(ranks, tmp_path):
    """With a CURVE secret on both sides the layers arrive byte-identical; a prefill process
    without it is never heard (its ack deadline ends its request), decode serves on."""
    secret = tmp_path / "pd.secret"
    secret.write_bytes(b"a control-plane secret of enough bytes\n")
    secret.chmod(0o600)
    port = free_port_range(1)
    d = ranks(RankConfig("decode", 0, 1, 1, SHAPE, kv_port=port, secret_path=str(secret)))
    member = ranks(RankConfig("prefill", 0, 1, 1, SHAPE, secret_path=str(secret), engine_id="member"))
    outsider = ranks(RankConfig("prefill", 0, 1, 1, SHAPE, engine_id="outsider", manual_clock=True))
    d.call("expect", "m", [1, 2])
    d.call("expect", "x", [3])
    member.call("add", "m", [5, 6], "127.0.0.1", port, 1)
    outsider.call("add", "x", [7], "127.0.0.1", port, 1)
    outsider.call("run", list(range(SHAPE.num_layers)))
    member.call("run", list(range(SHAPE.num_layers)))
    assert [(o[0], o[1]) for o in d.call("wait", 1, 30.0, timeout_s=40)] == [("m", True)]
    assert_blocks_equal(d.call("blocks", [1, 2]), expected_blocks(SHAPE, 1234, [5, 6]))
    assert member.call("finished", 1, 10.0) == [("m", True, ())]
    assert d.call("stats")["items"] == SHAPE.num_layers  # nothing of the outsider was decoded
    outsider.call("advance", 60.0)  # past its ack deadline: nobody will ever answer it
    sent = outsider.call("finished", 1, 20.0, timeout_s=30)
    assert len(sent) == 1 and sent[0][0] == "x" and not sent[0][1]
