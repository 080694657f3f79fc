"""A prefill process publishes reference-model prompt KV over Mooncake TCP on 127.0.0.1; the decode
consumer's destination is the sparse host pool; sparse decoding from it is bit-identical to full KV."""

from __future__ import annotations

import multiprocessing as mp

import pytest

pytest.importorskip("mooncake.engine")

from ascend_offload.harness.servers import free_port_range
from ascend_offload.transfer.mooncake import MooncakeEngine
from tests.unit.pd.pool_scenario import (
    MAX_NEW,
    WAIT_S,
    assert_pool_matches,
    consumer_for,
    decode_parity,
    fragment,
    make_pool,
    prefill_process,
    prompts,
)
from tests.unit.pd.pool_scenario import build_prefill as expected_prefill

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_mooncake_pull_into_host_pool_then_sparse_decode_parity():
    reqs = prompts()
    port = free_port_range(1)
    eng = MooncakeEngine(host="127.0.0.1", timeout_s=10)
    pool = make_pool(40)
    fragment(pool)
    cons = consumer_for(pool, eng, port)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=prefill_process, args=(child, reqs, "127.0.0.1", port), daemon=True)
    proc.start()
    try:
        assert parent.poll(60), "prefill process did not start"
        assert parent.recv() == "ready"
        for rid, prompt in reqs.items():
            assert cons.expect_pool(rid, pool, prompt_tokens=len(prompt), max_tokens=len(prompt) + MAX_NEW)
        parent.send("go")
        outs = cons.wait_finished(len(reqs), WAIT_S)
        assert sorted((o.request_id, o.ok) for o in outs) == [("a", True), ("b", True), ("c", True)], outs
        assert parent.poll(WAIT_S), "prefill did not report its outcomes"
        sent = parent.recv()
        assert sorted(sent) == [("a", True, ()), ("b", True, ()), ("c", True, ())]
        assert cons.stats.bytes_read > 0 and cons.active() == []
        # byte for byte against the same prefill computed here (separate address space over there)
        assert_pool_matches(pool, expected_prefill(reqs), list(reqs))
        decode_parity(pool, reqs, steps=18)
    finally:
        try:
            parent.send("stop")
        except OSError:  # the child is gone already; do not hide the real failure
            pass
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        cons.close()
        eng.close()
