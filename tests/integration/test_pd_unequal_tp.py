"""Unequal TP over Mooncake TCP: p_tp in {2, 4}, d_tp in {1, 2}, every rank its own process."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mooncake.engine")

from ascend_offload.harness.servers import free_port_range
from tests.support.pd_ranks import KVShape, RankConfig, expected_blocks, start_ranks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SHAPE = KVShape(num_layers=3, num_blocks=24, main_block_bytes=1024, indexer_block_bytes=128)
# block counts: 1 (fewer blocks than members: empty contributors), 3, 7 (uneven split)
REQS = {"one": ([9], [2]), "three": ([0, 1, 2], [20, 21, 22]), "seven": ([3, 5, 7, 11, 12, 13, 23], [0, 1, 3, 4, 5, 9, 10])}
# Per (p_tp, d_tp), worked out by hand, not from Topology (the code under test):
# items a decode rank receives = prefill ranks feeding it (p_tp / d_tp) x 3 requests x 3 layers;
# empty contributors per decode rank = members other than the first whose indexer share of a
# request is empty: none at ratio 1; at ratio 2 "one" (1 block: member 1 gets none);
# at ratio 4 "one" (members 1-3) and "three" (member 3).
EXPECTED = {(2, 1): (18, 1), (2, 2): (9, 0), (4, 1): (36, 4), (4, 2): (18, 1)}


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (2, 2), (4, 1), (4, 2)])
def test_unequal_tp(p_tp, d_tp):
    items, empty = EXPECTED[(p_tp, d_tp)]
    base = free_port_range(d_tp)
    cfgs = [RankConfig("decode", r, p_tp, d_tp, SHAPE, kv_port=base) for r in range(d_tp)]
    cfgs += [RankConfig("prefill", r, p_tp, d_tp, SHAPE) for r in range(p_tp)]
    procs = start_ranks(cfgs)
    decodes, prefills = procs[:d_tp], procs[d_tp:]
    try:
        for d in decodes:
            for rid, (_, dst) in REQS.items():
                d.call("expect", rid, dst)
        for p in prefills:
            for rid, (src, _) in REQS.items():
                p.call("add", rid, src, "127.0.0.1", base, d_tp)
        for p in prefills:
            p.call("run", list(range(SHAPE.num_layers)))
        for d in decodes:
            outs = d.call("wait", len(REQS), 30.0, timeout_s=40)
            # each request completes exactly once, successfully
            assert sorted((o[0], o[1]) for o in outs) == sorted((rid, True) for rid in REQS)
            assert d.call("wait", 1, 0.3) == []
            for src, dst in REQS.values():
                got, want = d.call("blocks", dst), expected_blocks(SHAPE, 1234, src)
                for (gkv, gidx), (wkv, widx) in zip(got, want, strict=True):
                    assert np.array_equal(gkv, wkv) and np.array_equal(gidx, widx)
            st = d.call("stats")
            # every contributor sent an item per (request, layer), empty ones included
            assert st["items"] == items
            # exactly its share: main KV once (member 0), indexer blocks once (union of members)
            nblocks = sum(len(dst) for _, dst in REQS.values())
            per_block = 2 * SHAPE.main_block_bytes + SHAPE.indexer_block_bytes
            assert st["bytes_read"] == nblocks * per_block * SHAPE.num_layers
            # members other than the first whose indexer share is empty send nothing, yet are acknowledged
            assert st["acked_empty"] == empty * SHAPE.num_layers
            assert st["failed"] == 0 and st["rejected"] == 0
            assert d.call("active") == []
        for p in prefills:
            sent = p.call("finished", len(REQS), 20.0)
            assert sorted(sent) == sorted((rid, True, ()) for rid in REQS)
            assert p.call("finished", 1, 0.2) == []
            st = p.call("stats")
            assert st["acked"] == len(REQS) * SHAPE.num_layers and st["timed_out"] == 0
            assert p.call("pending_slots") == {}
    finally:
        for x in procs:
            x.close()
