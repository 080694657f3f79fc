"""One failing store read on a layer-sharing engine must not change the answer.

The colocated engine runs the layerwise store with layer sharing (8 layers on 2
buffers) and ``kv_load_failure_policy: recompute``; ``debug_fail_layer_loads: 1``
fails the first layer load of the worker, as a missing or broken store object
would. vLLM reports "Recovered from KV load failure ... rescheduled" and recomputes;
the greedy tokens must equal those of the same engine without the fault.

Known failure (xfail, strict): the tokens after the failed load differ from the
fault-free ones (measured: 97-token prompt, 16 tokens, the answer diverges at
token 11; the same run without the fault gives identical tokens three times; the
logprobs differ from the second generated token on, so this is not rounding; with
every layer independent the same fault recomputes to identical tokens).
Under P/D the soak saw the same: the one request whose prefix load failed on
the prefill answered differently from the plain engine. When this passes, drop
the marker and put the store-read fault back into the soak
(``tests/reliability/conftest.py``, ``prefill_config``).
"""

from __future__ import annotations

from typing import Any

import pytest

from ascend_offload.testing.tiny_model import random_prompts
from tests.e2e.harness import generate, make_engine, tokens

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(600)]

PROMPT = random_prompts(1, [97], seed=41)


def layer_sharing_store(fail_loads: int) -> dict[str, Any]:
    store = {"use_layerwise": True, "layerwise_num_shared_buffers": 1, "layerwise_independent_layers": [0],
             "layerwise_prefetch_layers": 1, "local": {"capacity_bytes": 256 << 20}, "save_timeout_s": 5.0,
             "load_timeout_s": 30.0, "debug_fail_layer_loads": fail_loads}
    return {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_module_path": "ascend_offload.connectors.store", "kv_connector_extra_config": store}


@pytest.mark.xfail(strict=True, reason="a failed layerwise load recovered by vLLM's recompute changes the "
                                       "greedy tokens (module docstring)")
def test_one_failed_store_read_keeps_the_answer() -> None:
    with make_engine(num_layers=8, kv_transfer_config=layer_sharing_store(0), core=0,
                     disable_hybrid_kv_cache_manager=True) as llm:
        clean = tokens(generate(llm, PROMPT, 16))
        assert tokens(generate(llm, PROMPT, 16)) == clean  # store hits alone change nothing
    with make_engine(num_layers=8, kv_transfer_config=layer_sharing_store(1), core=0,
                     disable_hybrid_kv_cache_manager=True) as llm:
        faulted = [tokens(generate(llm, PROMPT, 16)) for _ in range(2)]
    assert faulted == [clean, clean]
