"""AscendStoreConnector (whole-prefix) under preemption and a connector reset, on a real
vLLM CPU engine whose KV cache is small enough that vLLM must preempt.

Device prefix caching is off, so what a preempted request gets back comes from the
store (or is recomputed). Every answer is compared with an engine without the plugin
and a large KV cache (which never preempts)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import pytest

from ascend_offload.harness.engines import StepRecorder, owned_engine, stepped_engine
from ascend_offload.harness.tiny_model import random_prompts
from tests.e2e.harness import BLOCK_SIZE, store_transfer_config, tiny_model

MAX_TOKENS = 96
PROMPTS_A = random_prompts(6, [150, 181, 203, 166, 190, 172], seed=11)  # preemption
PROMPTS_B = random_prompts(4, [230, 260, 199, 245], seed=12)  # loaded, then reset mid-run
PROMPTS_C = random_prompts(3, [140, 170, 155], seed=13)  # stored before the reset only
SMALL_KV_BLOCKS = 24  # 6 requests of 5-7 prompt blocks growing by 3 blocks: vLLM preempts

ENGINE_ARGS: dict[str, Any] = dict(
    dtype="float32", block_size=BLOCK_SIZE, enforce_eager=True, max_model_len=512,
    enable_prefix_caching=False, seed=0, max_num_seqs=8,
)
_ids = iter(range(10**9))
COUNTERS = ("loaded_blocks", "saved_blocks", "preempted_requests", "resumed_blocks", "recomputed_blocks",
            "preempt_save_waits")


def _submit(engine: Any, prompts: Sequence[Sequence[int]]) -> list[str]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    ids = [f"req-{next(_ids)}" for _ in prompts]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, {"prompt_token_ids": list(p)}, sp)
    return ids


def _drain(engine: Any, done: dict[str, Any]) -> None:
    while engine.has_unfinished_requests():
        _step(engine, done)


def _step(engine: Any, done: dict[str, Any]) -> None:
    for out in engine.step():
        if out.finished:
            done[out.request_id] = out


def _run(engine: Any, prompts: Sequence[Sequence[int]]) -> list[Any]:
    done: dict[str, Any] = {}
    ids = _submit(engine, prompts)
    _drain(engine, done)
    return [done[i] for i in ids]


def _tokens(outs: Sequence[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def _store(out: Any) -> dict[str, Any]:
    assert out.kv_transfer_params is not None, "connector returned no stats"
    return out.kv_transfer_params["ascend_store"]


def _sum(outs: Sequence[Any], name: str) -> int:
    return sum(_store(o).get(name, 0) for o in outs)


@pytest.fixture(scope="module")
def baseline() -> dict[str, list[list[int]]]:
    """Tokens of an engine without a connector and with a large KV cache."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    rec = StepRecorder()
    with owned_engine(lambda: stepped_engine(rec, model=tiny_model(), **ENGINE_ARGS), in_process=True) as eng:
        out = {name: _tokens(_run(eng, p)) for name, p in
               (("A", PROMPTS_A), ("B", PROMPTS_B), ("C", PROMPTS_C))}
    assert rec.preempted() == 0  # the reference never preempts
    return out


LAYERWISE = {"use_layerwise": True, "layerwise_num_shared_buffers": 2, "layerwise_independent_layers": [0]}


@pytest.fixture(scope="module", params=["prefix", "layerwise"])
def store_engine(request: pytest.FixtureRequest) -> Any:
    """One engine per mode: the store connector and a KV cache of 24 blocks (layerwise:
    layers 1-3 share two device buffers, so their KV lives in the store between steps)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    rec = StepRecorder()
    extra: dict[str, Any] = {"local": {"capacity_bytes": 256 << 20}}
    if request.param == "layerwise":
        extra.update(LAYERWISE)
    cfg = store_transfer_config(extra)
    with owned_engine(lambda: stepped_engine(rec, model=tiny_model(), kv_transfer_config=cfg,
                                             num_gpu_blocks_override=SMALL_KV_BLOCKS,
                                             **ENGINE_ARGS), in_process=True) as eng:
        assert eng.vllm_config.cache_config.num_gpu_blocks == SMALL_KV_BLOCKS
        yield eng, rec, request.param


def test_preempted_requests_resume_from_the_store(baseline: dict[str, Any], store_engine: Any) -> None:
    eng, rec, mode = store_engine
    m = rec.mark()
    outs = _run(eng, PROMPTS_A)
    assert rec.preempted(m) > 0, "the small KV cache did not make vLLM preempt"
    assert _tokens(outs) == baseline["A"]
    preempted = _sum(outs, "preempted_requests")
    assert preempted == rec.preempted(m)  # the connector saw every preemption vLLM counted
    assert _sum(outs, "resumed_blocks") > 0
    assert _sum(outs, "recomputed_blocks") == 0  # the store held every computed full block
    print(mode, "preemption:", {n: _sum(outs, n) for n in COUNTERS}, "vllm preemptions", rec.preempted(m))
    store = _store(outs[-1])["store"]
    assert store["pinned_objects"] == 0
    # layerwise: the last step's save of the finishing request reports after it finished
    assert store["pending_objects"] == 0 or mode == "layerwise"


def test_reset_with_loads_in_flight_serves_no_pre_reset_block(baseline: dict[str, Any],
                                                              store_engine: Any) -> None:
    eng, _, _ = store_engine
    assert _tokens(_run(eng, PROMPTS_C)) == baseline["C"]  # stored; not running at the reset
    assert _tokens(_run(eng, PROMPTS_B)) == baseline["B"]  # stored
    done: dict[str, Any] = {}
    ids = _submit(eng, PROMPTS_B)  # every one loads its stored prefix
    for _ in range(3):  # admitted, loading / decoding
        _step(eng, done)
    assert eng.reset_prefix_cache(reset_running_requests=True, reset_connector=True) is True
    _drain(eng, done)
    outs = [done[i] for i in ids]
    assert _tokens(outs) == baseline["B"]
    assert _sum(outs, "loaded_blocks") > 0  # the load-heavy part ran before the reset
    # the reset preempted the running requests and the store forgot their blocks
    assert _sum(outs, "preempted_requests") > 0
    assert _sum(outs, "recomputed_blocks") > 0 and _sum(outs, "resumed_blocks") == 0
    print("reset:", {n: _sum(outs, n) for n in COUNTERS})
    # prefixes stored before the reset are not served after it: the only loads are of
    # blocks these requests saved themselves after it (resumptions from their own
    # preemptions in this small KV cache)
    after = _run(eng, PROMPTS_C)
    assert _tokens(after) == baseline["C"]
    assert _sum(after, "loaded_blocks") == _sum(after, "resumed_blocks")
    # ... until they are saved again
    again = _run(eng, PROMPTS_C)
    assert _tokens(again) == baseline["C"]
    print("after reset:", {n: _sum(after, n) for n in COUNTERS}, "again:", {n: _sum(again, n) for n in COUNTERS})
    assert all(_store(o)["loaded_blocks"] >= len(p) // BLOCK_SIZE - 1
               for o, p in zip(again, PROMPTS_C, strict=True))
