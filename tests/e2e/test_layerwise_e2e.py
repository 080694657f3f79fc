"""AscendStoreConnector with use_layerwise on real vLLM CPU engines (production path).

8 float32 layers, I=[0], B in {1, 2, 3}; vLLM's default engine-core child process, so
the layout hook is installed by our ``vllm.general_plugins`` entry point. Against an
engine without any connector:
* prompts longer than one scheduler chunk (max_num_batched_tokens=64) give identical tokens;
* a later request sharing 224 prefix tokens loads 7 blocks from the store, identical tokens;
* the reported number of KV blocks grows to >= 0.9 * N / physical of the plain engine;
* with a slow store save (B=1) tokens stay identical and the reuse gate waited.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from tests.e2e.harness import generate, make_engine, store_counter, store_transfer_config, tokens

N_LAYERS = 8
CHUNK = 64
ENGINE_ARGS: dict[str, Any] = dict(
    num_layers=N_LAYERS, max_num_batched_tokens=CHUNK, max_num_seqs=4, max_model_len=1024
)


def _prompts() -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(7)
    first = [[rng.randrange(3, 512) for _ in range(n)] for n in (150, 261)]
    second = [first[1][:224] + [rng.randrange(3, 512) for _ in range(45)]]  # 7 shared blocks
    return first, second


FIRST, SECOND = _prompts()


@pytest.fixture(scope="module")
def baseline() -> dict[str, Any]:
    with make_engine(core=0, **ENGINE_ARGS) as llm:
        return {
            "first": tokens(generate(llm, FIRST, max_tokens=8)),
            "second": tokens(generate(llm, SECOND, max_tokens=8)),
            "blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
        }


@pytest.mark.parametrize("b", [1, 2, 3])
def test_layerwise_parity_prefix_and_capacity(baseline: dict[str, Any], b: int) -> None:
    slow = b == 1
    extra = {
        "use_layerwise": True,
        "layerwise_num_shared_buffers": b,
        "layerwise_independent_layers": [0],
        # B = 3: two layers ahead in flight (the default); B = 1: the single-prefetch path
        "layerwise_prefetch_layers": 2 if b == 3 else 1,
        "local": {"capacity_bytes": 256 << 20},
        "debug": {"save_delay_s": 0.005 if slow else 0.0},
        "save_timeout_s": 60.0,
    }
    cfg = store_transfer_config(extra)
    physical = 1 + min(b, N_LAYERS - 1)
    with make_engine(core=1, kv_transfer_config=cfg, disable_log_stats=False, **ENGINE_ARGS) as llm:
        first = generate(llm, FIRST, max_tokens=8)
        assert tokens(first) == baseline["first"]
        second = generate(llm, SECOND, max_tokens=8)
        assert tokens(second) == baseline["second"]
        st = second[0].kv_transfer_params["ascend_store"]
        assert st["loaded_blocks"] == 224 // 32, st
        blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
        factor = blocks / baseline["blocks"]
        print(f"B={b}: physical={physical} blocks={blocks} base={baseline['blocks']} factor={factor:.3f}")
        assert factor >= 0.9 * N_LAYERS / physical
        assert store_counter(llm, "layerwise_load_errors") == 0
        assert store_counter(llm, "layerwise_blocks_loaded") > 0
        # the CPU product path: every copy ran on the native ordered queue
        assert store_counter(llm, "layerwise_native_copies") > 0
        if slow:
            assert store_counter(llm, "layerwise_gate_waits") > 0


def test_prefix_caching_on_is_refused() -> None:
    """Sharing cannot keep device-cached blocks: a clear startup error, not wrong answers
    (in-process: the engine core's error reaches the test as it is)."""
    cfg = store_transfer_config({"use_layerwise": True})
    with pytest.raises(Exception) as exc, \
            make_engine(kv_transfer_config=cfg, max_model_len=1024, enable_prefix_caching=True):
        pass
    assert "enable_prefix_caching" in str(exc.value), repr(exc.value)
