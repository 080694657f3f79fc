"""One failing store read on a layer-sharing engine must not change the answer.

The colocated engine runs the layerwise store with layer sharing (8 layers on 2
buffers) and ``kv_load_failure_policy: recompute``; ``debug: {fail_layer_loads: 1}``
fails the first layer load of the worker, as a missing or broken store object
would. vLLM reports "Recovered from KV load failure ... rescheduled" and recomputes;
the greedy tokens must equal those of the same engine without the fault.

Why it can go wrong: the layers after the failed one computed over a buffer the
load never filled. If the step's saves of those layers were committed, the
recompute's saves of the same keys would be duplicates and every later load would
read the wrong KV (the answer then diverged at token 11 here); the pipeline drops
them (``PipelineStats.save_dropped``).
"""

from __future__ import annotations

from typing import Any

import pytest

from ascend_offload.harness.tiny_model import random_prompts
from tests.e2e.harness import generate, make_engine, store_counter, tokens

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(600)]

PROMPT = random_prompts(1, [97], seed=41)


def layer_sharing_store(fail_loads: int) -> dict[str, Any]:
    store = {"use_layerwise": True, "layerwise_num_shared_buffers": 1, "layerwise_independent_layers": [0],
             "layerwise_prefetch_layers": 1, "local": {"capacity_bytes": 256 << 20}, "save_timeout_s": 5.0,
             "load_timeout_s": 30.0, "debug": {"fail_layer_loads": fail_loads}}
    return {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_module_path": "ascend_offload.connectors.store", "kv_connector_extra_config": store}


def test_one_failed_store_read_keeps_the_answer() -> None:
    with make_engine(num_layers=8, kv_transfer_config=layer_sharing_store(0), core=0,
                     disable_hybrid_kv_cache_manager=True, disable_log_stats=False) as llm:
        clean = tokens(generate(llm, PROMPT, 16))
        assert tokens(generate(llm, PROMPT, 16)) == clean  # store hits alone change nothing
        assert store_counter(llm, "layerwise_blocks_loaded") > 0  # the second pass loaded
        assert store_counter(llm, "layerwise_load_errors") == 0
    with make_engine(num_layers=8, kv_transfer_config=layer_sharing_store(1), core=0,
                     disable_hybrid_kv_cache_manager=True, disable_log_stats=False) as llm:
        faulted = [tokens(generate(llm, PROMPT, 16)) for _ in range(2)]
        # the injected failure really happened, and only once (the first layer load)
        assert store_counter(llm, "layerwise_load_errors") >= 1
        assert store_counter(llm, "layerwise_blocks_loaded") > 0
    assert faulted == [clean, clean]
