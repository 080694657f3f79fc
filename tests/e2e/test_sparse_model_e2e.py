"""Our sparse-MLA model (DeepSeek-V3.2 semantics) in real vLLM CPU engines, float32.

One tiny checkpoint (4 layers, index_topk=32), prompts of 20-400 tokens prefilled
in chunks of 128, 12 greedy tokens each. Four engines:
* sparse + a recording KV connector (prompts run twice) and sparse alone with prefix
  caching (run twice: the second run hits the cache): identical tokens (deterministic,
  the connector and cache hits change nothing), varied per prompt;
* dense (``use_sparse_attention=False``) and sparse with ``index_topk=4096``: identical
  (top-k covering the context is dense attention); sparse with 32 equals dense while
  the context stays <= 32 tokens and differs for every longer prompt;
* the connector gets ``register_kv_caches`` with the main-KV and indexer caches of every
  layer in their expected shapes, and per step ``wait_for_layer_load``/``save_kv_layer``
  for each main-KV layer in order (the new tokens' main-KV and indexer rows, which the
  connector overwrites at the wait as a load would, are computed again by the save),
  then ``start_load_kv`` (vLLM 0.32 starts loads after the forward unless the step
  has synchronous loads), then ``wait_for_save``.

The connector lives here (selected by ``kv_connector_module_path``) and is built on
first attribute access, so collecting this module does not import vLLM.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from ascend_offload.harness.tiny_sparse_model import make_tiny_sparse_model
from tests.e2e.harness import MODEL_CACHE, generate, make_engine, tokens

N_LAYERS = 4
TOPK = 32
MAX_TOKENS = 12
BLOCK = 32
# head sizes of the tiny model: latent 64 + rope 16; indexer 32
MAIN_ROW, INDEX_ROW = 80, 32
LENGTHS = (20, 64, 150, 260, 400)
ENGINE_ARGS: dict[str, Any] = dict(max_num_batched_tokens=128, max_model_len=1024, max_num_seqs=8)
SENTINEL = 12345.0
MAIN = [f"model.layers.{i}.self_attn.attn" for i in range(N_LAYERS)]
INDEXER = [f"model.layers.{i}.self_attn.indexer.k_cache" for i in range(N_LAYERS)]


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in LENGTHS]


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(make_tiny_sparse_model(MODEL_CACHE / "tiny-sparse-mla-4l", index_topk=TOPK))


def _run(model: str, *, overrides: dict[str, Any] | None = None, record: Path | None = None,
         repeat: int = 1, **engine: Any) -> dict[str, Any]:
    cfg = None
    if record is not None:
        cfg = {
            "kv_connector": "RecordingConnector",
            "kv_connector_module_path": __name__,
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"record_path": str(record)},
        }
    kwargs = dict(ENGINE_ARGS, hf_overrides=overrides or {}, disable_log_stats=False, **engine)
    with make_engine(model=model, kv_transfer_config=cfg, core=0, **kwargs) as llm:
        runs = [tokens(generate(llm, PROMPTS, max_tokens=MAX_TOKENS)) for _ in range(repeat)]
        hits = sum(getattr(m, "value", 0) for m in llm.get_metrics()
                   if m.name == "vllm:prefix_cache_hits")
        return {"runs": runs, "blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
                "prefix_hits": hits}


@pytest.fixture(scope="module")
def engines(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    record = tmp_path_factory.mktemp("sparse-hooks") / "events.jsonl"
    out = {
        "recorded": _run(model_dir, record=record, repeat=2),
        "sparse": _run(model_dir, repeat=2, enable_prefix_caching=True),
        "dense": _run(model_dir, overrides={"use_sparse_attention": False}),
        "wide": _run(model_dir, overrides={"index_topk": 4096}),
    }
    out["events"] = [json.loads(line) for line in record.read_text().splitlines()]
    return out


def test_greedy_output_is_deterministic_and_varied(engines: dict[str, Any]) -> None:
    first, second = engines["recorded"]["runs"]
    assert first == second  # same engine, run twice
    assert engines["sparse"]["runs"][0] == first  # another engine, without a connector
    for toks in first:
        assert len(toks) == MAX_TOKENS
        assert len(set(toks)) >= MAX_TOKENS // 2, toks  # not one repeated token
    assert len({tuple(t) for t in first}) == len(PROMPTS)


def test_prefix_cache_hits_give_the_same_tokens(engines: dict[str, Any]) -> None:
    """The second run reads the prompts' full blocks (main KV and indexer keys) from
    vLLM's prefix cache instead of computing them."""
    sparse = engines["sparse"]
    # every full block but the one holding the last prompt token (always computed)
    assert sparse["prefix_hits"] >= sum((n - 1) // BLOCK * BLOCK for n in LENGTHS)
    assert sparse["runs"][1] == engines["recorded"]["runs"][0]


def test_topk_covering_the_context_equals_dense(engines: dict[str, Any]) -> None:
    assert engines["wide"]["runs"][0] == engines["dense"]["runs"][0]


def test_topk_below_the_context_really_selects(engines: dict[str, Any]) -> None:
    sparse, dense = engines["sparse"]["runs"][0], engines["dense"]["runs"][0]
    for n, s, d in zip(LENGTHS, sparse, dense, strict=True):
        if n + MAX_TOKENS - 1 <= TOPK:  # every step's context fits in top-k
            assert s == d, n
        else:
            assert s != d, n


def test_connector_sees_both_caches_of_every_layer(engines: dict[str, Any]) -> None:
    reg = [e for e in engines["events"] if e["event"] == "register_kv_caches"]
    assert len(reg) == 1
    caches = reg[0]["caches"]
    assert set(caches) == set(MAIN) | set(INDEXER)
    blocks = engines["recorded"]["blocks"]
    for name in MAIN:
        assert caches[name]["shape"] == [blocks, 1, BLOCK, MAIN_ROW], name
    for name in INDEXER:
        assert caches[name]["shape"] == [blocks, 1, BLOCK, INDEX_ROW], name
    assert {c["dtype"] for c in caches.values()} == {"torch.float32"}
    # eight separate tensors (no aliasing without an offload layout hook)
    assert len({c["data_ptr"] for c in caches.values()}) == 2 * N_LAYERS


def test_layer_hooks_run_for_every_main_layer_in_order(engines: dict[str, Any]) -> None:
    steps: list[list[dict[str, Any]]] = [[]]
    for e in engines["events"]:
        if e["event"] == "register_kv_caches":
            continue
        steps[-1].append(e)
        if e["event"] == "wait_for_save":
            steps.append([])
    assert steps[-1] == []
    forward = [s for s in steps[:-1] if len(s) > 2]
    idle = [s for s in steps[:-1] if len(s) <= 2]
    # 5 prompts, prefill chunks of 128 tokens, 12 tokens each, two runs
    assert len(forward) >= 2 * MAX_TOKENS
    expected = []
    for name in MAIN:
        expected += [f"wait_for_layer_load:{name}", f"save_kv_layer:{name}"]
    # no synchronous loads scheduled: vLLM starts (async) loads after the forward
    expected += ["start_load_kv", "wait_for_save"]
    assert all([e["event"] for e in s] == ["start_load_kv", "wait_for_save"] for s in idle)
    for step in forward:
        assert [e["event"] + (f":{e['layer']}" if "layer" in e else "") for e in step] == expected
        for e in step[:-2]:
            if e["event"] == "save_kv_layer":
                assert e["same_tensor"], e
                # the rows the wait overwrote (as a load would) were computed afterwards
                assert e["new_rows"] > 0 and e["main_written"] and e["indexer_written"], e


_CONNECTOR: type | None = None


def _connector_class() -> type:
    """A worker-side recorder of the connector hooks (JSON lines at ``record_path``)."""
    global _CONNECTOR
    if _CONNECTOR is not None:
        return _CONNECTOR
    import torch
    from vllm.forward_context import get_forward_context

    from ascend_offload.bench.null_connector import NullConnector

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.view(-1, t.shape[-1])

    def new_slots(slots: torch.Tensor) -> torch.Tensor:
        return slots[slots >= 0]

    class RecordingConnector(NullConnector):  # scheduler side: a pure observer
        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            super().__init__(vllm_config, role, kv_cache_config)
            extra = vllm_config.kv_transfer_config.kv_connector_extra_config
            self.path = Path(extra["record_path"])
            self.caches: dict[str, torch.Tensor] = {}

        def _write(self, **event: Any) -> None:
            with self.path.open("a") as f:
                f.write(json.dumps(event) + "\n")

        def _rows(self, layer_name: str) -> tuple[torch.Tensor, torch.Tensor]:
            index_name = layer_name.replace(".attn", ".indexer.k_cache")
            return rows(self.caches[layer_name]), rows(self.caches[index_name])

        # worker side
        def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
            self.caches = dict(kv_caches)
            self._write(event="register_kv_caches", caches={
                n: {"shape": list(t.shape), "dtype": str(t.dtype), "data_ptr": t.data_ptr()}
                for n, t in kv_caches.items()})

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            self._write(event="start_load_kv")

        def wait_for_layer_load(self, layer_name: str) -> None:
            # overwrite the step's new rows of both caches, as a layerwise load would
            slots = new_slots(get_forward_context().attn_metadata[layer_name].slot_mapping)
            for t in self._rows(layer_name):
                t[slots] = SENTINEL
            self._write(event="wait_for_layer_load", layer=layer_name)

        def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                          **kwargs: Any) -> None:
            reg = self.caches[layer_name]
            slots = new_slots(attn_metadata.slot_mapping)
            main, index = (t[slots] for t in self._rows(layer_name))
            self._write(event="save_kv_layer", layer=layer_name,
                        same_tensor=kv_layer.data_ptr() == reg.data_ptr() and kv_layer.shape == reg.shape,
                        new_rows=int(slots.numel()), main_written=bool((main != SENTINEL).all()),
                        indexer_written=bool((index != SENTINEL).all()))

        def wait_for_save(self) -> None:
            self._write(event="wait_for_save")

    _CONNECTOR = RecordingConnector
    return _CONNECTOR


def __getattr__(name: str) -> Any:
    if name == "RecordingConnector":
        return _connector_class()
    raise AttributeError(name)
