"""The store tier and the joint prefill on our sparse-MLA model (vLLM CPU engines).

The model has two caches per decoder layer in one KV cache group with different
page sizes: the main KV (one ``kv_lora_rank + rope`` row per token) and the
lightning indexer's keys. A store object holds one block of *both* for every
layer; in layerwise mode an indexer cache follows its main layer's buffer.

* ``AscendStoreConnector`` alone, whole-prefix and layerwise (one shared buffer):
  a second pass loads every shared prefix from the store and answers exactly
  like a plain engine of the same model.
* Joint P/D: the prefill runs ``AscendMultiConnector`` (layerwise store with one
  shared buffer + the ``SfaRemoteD2HConnector`` producer), the decode the
  consumer with ``sparse_offload`` (main KV pulled into its host pool, the
  indexer into device blocks). Both orders of the children in the config give
  the plain engine's tokens, the store serves prefix hits, decode pulls.
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

from ascend_offload.testing.tiny_sparse_model import make_tiny_sparse_model
from tests.e2e.harness import (
    BLOCK_SIZE,
    MODEL_CACHE,
    generate,
    make_engine,
    store_transfer_config,
    tokens,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

N_LAYERS = 4
TOPK = 32
MAX_TOKENS = 8
# One block on one rank, every layer: main row (64 latent + 16 rope) + indexer row (64), fp32.
OBJECT_BYTES = N_LAYERS * BLOCK_SIZE * (64 + 16 + 64) * 4


def _prompts() -> list[list[int]]:
    """12 prompts: three families of three sharing a 2-9 block prefix, three unrelated."""
    rng = random.Random(41)
    out = []
    for prefix_len, tails in ((70, (5, 40, 120)), (300, (1, 33, 90)), (150, (64, 7, 200)), (0, (20, 260, 45))):
        prefix = [rng.randrange(3, 512) for _ in range(prefix_len)]
        out += [prefix + [rng.randrange(3, 512) for _ in range(t)] for t in tails]
    return out


PROMPTS = _prompts()


def sparse_model() -> str:
    return str(make_tiny_sparse_model(MODEL_CACHE / "tiny-sparse-mla-4l", index_topk=TOPK))


@pytest.fixture(scope="module")
def baseline() -> list[list[int]]:
    """Tokens of a plain engine of the same model (no connector)."""
    with make_engine(model=sparse_model(), core=0) as llm:
        return tokens(generate(llm, PROMPTS, MAX_TOKENS))


def _store(out: Any) -> dict[str, Any]:
    assert out.kv_transfer_params is not None, "connector returned no stats"
    return out.kv_transfer_params["ascend_store"]


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole-prefix", "layerwise"])
def test_store_on_the_sparse_model_matches_plain(baseline: list[list[int]], layerwise: bool) -> None:
    extra: dict[str, Any] = {"local": {"capacity_bytes": 64 << 20}}
    if layerwise:
        extra.update(use_layerwise=True, layerwise_num_shared_buffers=1, layerwise_independent_layers=[0],
                     layerwise_prefetch_layers=1)
    with make_engine(model=sparse_model(), core=1, kv_transfer_config=store_transfer_config(extra),
                     disable_hybrid_kv_cache_manager=True) as llm:
        first = [generate(llm, [p], MAX_TOKENS)[0] for p in PROMPTS]  # one by one: family hits
        assert tokens(first) == baseline
        second = generate(llm, PROMPTS, MAX_TOKENS)
        assert tokens(second) == baseline
        # family members after the first loaded the shared prefix in the first pass
        assert sum(_store(o)["loaded_blocks"] for o in first) > 0
        for p, o in zip(PROMPTS, second, strict=True):
            assert _store(o)["loaded_blocks"] >= (len(p) - 1) // BLOCK_SIZE, (len(p), _store(o))
        # One more request alone: no load pin of the earlier ones is left. Whole-prefix
        # saves are committed within their step; a layerwise save is committed when a
        # later step reports it, so the lone request's own may still be pending here.
        last = generate(llm, PROMPTS[:1], MAX_TOKENS)
        assert tokens(last) == baseline[:1]
        store = _store(last[0])["store"]
        assert store["pinned_objects"] == 0
        if not layerwise:
            assert store["pending_objects"] == 0


# ------------------------------------------------------------------ joint P/D

HOT = 64
ROW_BYTES = (64 + 16) * 4  # main row: latent + rope, float32
MAX_LEN = 4096
POOL_ROWS = MAX_LEN + 512
POOL_GB = POOL_ROWS * N_LAYERS * ROW_BYTES / 2**30 + 1e-9
BAD = ("Recovered from KV load failure", "blocks failed to load", "decode did not read", "cannot send",
       "cannot receive", "Traceback", "has no reuse-gate token", "admission failed")


def joint_prefill_config(kv_port: int, rd2h_extra: dict[str, Any], producer_first: bool) -> dict[str, Any]:
    """AscendMultiConnector: layerwise store (one shared buffer) + RD2H producer, in either order."""
    from tests.e2e.pd_cluster import rd2h_config

    store = {"use_layerwise": True, "layerwise_num_shared_buffers": 1, "layerwise_independent_layers": [0],
             "layerwise_prefetch_layers": 1, "local": {"capacity_bytes": 64 << 20}, "save_timeout_s": 5.0,
             "load_timeout_s": 60.0}
    children = [{"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
                 "kv_connector_module_path": "ascend_offload.connectors.store", "kv_connector_extra_config": store},
                rd2h_config("kv_producer", kv_port, rd2h_extra)]
    if producer_first:
        children.reverse()
    return {"kv_connector": "AscendMultiConnector", "kv_role": "kv_producer", "kv_port": kv_port,
            "kv_connector_module_path": "ascend_offload.connectors.multi",
            "kv_connector_extra_config": {"connectors": children}}


def _counter(url: str, name: str) -> float:
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f"vllm:ascend_offload_{name}_total"))


# The store-first order is what the demo runs (configs/cpu-demo/prefill-joint.json), with the
# same parity check, in tests/e2e/test_demo_e2e.py; here the other order.
@pytest.mark.parametrize("producer_first", [True], ids=["producer-first"])
def test_joint_prefill_feeding_sparse_decode_matches_plain(
        baseline: list[list[int]], producer_first: bool, tmp_path_factory: pytest.TempPathFactory) -> None:
    pytest.importorskip("mooncake.engine")
    from concurrent.futures import ThreadPoolExecutor

    from tests.e2e.pd_cluster import body, complete, log_lines, log_sizes, pd_cluster, rd2h_config

    extra = {"ack_timeout_s": 30, "request_timeout_s": 30, "registration_timeout_s": 30}
    sparse = {"enabled": True, "topk_buffer_size": HOT, "index_topk": TOPK, "dram_size_per_dp_GB": POOL_GB}
    with pd_cluster(sparse_model(), tmp_path_factory.mktemp("joint-sparse"),
                    lambda port: joint_prefill_config(port, extra, producer_first),
                    lambda port: rd2h_config("kv_consumer", port, {**extra, "sparse_offload": sparse}),
                    prefill_args=("--disable-hybrid-kv-cache-manager",),
                    decode_args=("--no-enable-prefix-caching", "--max-num-seqs", "4")) as c:
        model = c["model"]
        prefill = c["servers"]["prefill"]
        assert "decode reads of each layer hold its physical buffer (8 layers on 4 buffers)" in prefill.text(), \
            [ln for ln in prefill.text().splitlines() if "physical buffer" in ln]
        since = log_sizes(c)
        req = [body(model, p, False, MAX_TOKENS, return_token_ids=True) for p in PROMPTS]
        # The first member of each family alone (it stores the prefix), the rest 4 at a time.
        firsts = list(range(0, len(PROMPTS), 3))
        answers: dict[int, Any] = {i: complete(c["proxy"], req[i]) for i in firsts}
        rest = [i for i in range(len(PROMPTS)) if i not in answers]
        with ThreadPoolExecutor(4) as pool:
            answers.update(zip(rest, pool.map(lambda i: complete(c["proxy"], req[i]), rest), strict=True))
        got = [list(answers[i].token_ids or ()) for i in range(len(PROMPTS))]
        assert got == baseline
        deadline = time.monotonic() + 30
        while _counter(c["decode"], "rd2h_layers_pulled") < len(PROMPTS) * N_LAYERS and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _counter(c["decode"], "rd2h_layers_pulled") == len(PROMPTS) * N_LAYERS
        assert _counter(c["prefill"], "store_loaded_blocks") > 0  # family members hit the store
        assert _counter(c["prefill"], "rd2h_gate_holds") > 0
        assert [line for b in BAD for line in log_lines(c, since, b)] == []
