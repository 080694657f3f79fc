"""AscendStoreConnector (whole-prefix, local backend) on real vLLM CPU engines."""

from __future__ import annotations

import os
from typing import Any

import pytest

from ascend_offload.harness.tiny_model import random_prompts
from tests.e2e.harness import (
    BLOCK_SIZE,
    generate,
    make_engine,
    store_counter,
    store_transfer_config,
    tokens,
)

PROMPTS = random_prompts(4, [200, 333, 97, 520], seed=7)
# One block of the 4-layer tiny model on one rank: 4 layers x 2 (K,V) x 32 tokens x 64 x fp32.
OBJECT_BYTES = 4 * 2 * BLOCK_SIZE * 64 * 4


@pytest.fixture(scope="module")
def baseline() -> list[list[int]]:
    """Tokens of an engine that does not load our plugin at all."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # this (frontend) process keeps our connector names
    old = os.environ.get("VLLM_PLUGINS")
    os.environ["VLLM_PLUGINS"] = ""
    try:
        with make_engine(core=0, in_process=False) as llm:  # its own processes: no plugin there
            return tokens(generate(llm, PROMPTS))
    finally:
        if old is None:
            os.environ.pop("VLLM_PLUGINS", None)
        else:
            os.environ["VLLM_PLUGINS"] = old


def _params(out: Any) -> dict[str, Any]:
    assert out.kv_transfer_params is not None, "connector returned no stats"
    return out.kv_transfer_params["ascend_store"]


def test_second_run_loads_prefix_and_matches(baseline: list[list[int]]) -> None:
    cfg = store_transfer_config({"local": {"capacity_bytes": 256 << 20}})
    # Its own processes: the connector's metadata crosses the scheduler-worker boundary.
    with make_engine(core=1, kv_transfer_config=cfg, in_process=False, disable_log_stats=False) as llm:
        first = generate(llm, PROMPTS)
        assert tokens(first) == baseline
        for p, o in zip(PROMPTS, first, strict=True):
            st = _params(o)
            assert st["loaded_blocks"] == 0
            assert st["saved_blocks"] >= len(p) // BLOCK_SIZE
        second = generate(llm, PROMPTS)
        assert tokens(second) == baseline
        for p, o in zip(PROMPTS, second, strict=True):
            st = _params(o)
            assert st["loaded_blocks"] >= len(p) // BLOCK_SIZE - 1, (len(p), st)
        # One more request alone: nothing of the earlier ones may stay pinned or pending.
        last = generate(llm, PROMPTS[:1])
        assert tokens(last) == baseline[:1]
        store = _params(last[0])["store"]
        assert store["pinned_objects"] == 0
        assert store["pending_objects"] == 0
        assert store["stored_objects"] == store["total_pages"] - store["free_pages"]
        # the whole-prefix counters reach Prometheus, summed over the requests
        loaded = sum(_params(o)["loaded_blocks"] for o in [*second, *last])
        assert store_counter(llm, "loaded_blocks") == loaded > 0
        assert store_counter(llm, "saved_blocks") >= sum(_params(o)["saved_blocks"] for o in first) > 0


def test_tiny_store_still_serves_identically(baseline: list[list[int]]) -> None:
    cfg = store_transfer_config({"local": {"capacity_bytes": 3 * OBJECT_BYTES}})
    with make_engine(core=1, kv_transfer_config=cfg) as llm:
        for _ in range(2):
            outs = generate(llm, PROMPTS)
            assert tokens(outs) == baseline
        skipped = sum(_params(o)["skipped_blocks"] for o in outs)
        store = _params(outs[-1])["store"]
        assert skipped > 0 and store["skipped_stores"] > 0
        assert store["total_pages"] == 3
        last = generate(llm, PROMPTS[:1])
        assert tokens(last) == baseline[:1]
        store = _params(last[0])["store"]
        assert store["pinned_objects"] == 0 and store["pending_objects"] == 0
