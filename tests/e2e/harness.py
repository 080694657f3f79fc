"""Real vLLM CPU engines for end-to-end tests: start, use, always tear down.

Engines run in-process through vLLM's ``LLM`` API (its EngineCore and worker are
child processes). ``make_engine`` pins each engine's worker to one core with
``VLLM_CPU_OMP_THREADS_BIND`` so two engines can share this 2-core machine.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ascend_offload.harness.engines import tiny_llm
from ascend_offload.harness.tiny_model import make_tiny_llama

BLOCK_SIZE = 32
MODEL_CACHE = Path(os.environ.get("ASCEND_OFFLOAD_TEST_MODELS", "/tmp/ascend-offload-test-models"))


def tiny_model(num_layers: int = 4) -> str:
    return str(make_tiny_llama(MODEL_CACHE / f"tiny-llama-{num_layers}l", num_layers=num_layers))


def ngram_sparse_model(index_topk: int = 32) -> str:
    """Our 4-layer sparse-MLA model with small weights (initializer range 0.02): its greedy
    text repeats itself often enough that vLLM's n-gram drafts are sometimes accepted,
    sometimes rejected (the default weights' acceptance is ~0)."""
    from ascend_offload.harness.tiny_sparse_model import (
        NGRAM_INITIALIZER_RANGE,
        make_tiny_sparse_model,
    )

    return str(make_tiny_sparse_model(MODEL_CACHE / f"tiny-sparse-mla-4l-ngram-k{index_topk}",
                                      index_topk=index_topk,
                                      initializer_range=NGRAM_INITIALIZER_RANGE))


def store_transfer_config(extra: dict[str, Any] | None = None, role: str = "kv_both") -> dict[str, Any]:
    return {
        "kv_connector": "AscendStoreConnector",
        "kv_role": role,
        "kv_connector_extra_config": extra or {},
    }


@contextlib.contextmanager
def make_engine(
    *,
    num_layers: int = 4,
    kv_transfer_config: dict[str, Any] | None = None,
    core: int | None = None,
    in_process: bool = True,
    **kwargs: Any,
) -> Iterator[Any]:
    """A float32, eager, prefix-caching-off LLM on the tiny Llama (or ``model=``); shut down on exit.

    ``in_process`` (the default): engine core and worker run in this process and start
    in seconds (see ``owned_engine``); ``False`` where a test needs what only separate
    processes exercise (metadata serialization, per-process library state, TP > 1).
    ``core`` pins a multi-process engine's worker (``VLLM_CPU_OMP_THREADS_BIND``) for the
    engine's start only: the variable is restored once its processes have read it, so
    it never leaks into a later test of the same worker."""
    model = kwargs.pop("model", None) or tiny_model(num_layers)
    pin = None if core is None or in_process else str(core)
    with pinned_env({"VLLM_CPU_OMP_THREADS_BIND": pin}) as restore, \
            tiny_llm(model, kv_transfer_config, in_process=in_process,
                     **{"block_size": BLOCK_SIZE, **kwargs}) as llm:
        restore()
        yield llm


@contextlib.contextmanager
def pinned_env(values: dict[str, str | None]) -> Iterator[Callable[[], None]]:
    """Set the non-None ``values`` in ``os.environ``; yield a function that restores the
    previous values (called at the latest on exit)."""
    old = {k: os.environ.get(k) for k, v in values.items() if v is not None}
    os.environ.update({k: v for k, v in values.items() if v is not None})
    done = False

    def restore() -> None:
        nonlocal done
        if done:
            return
        done = True
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    try:
        yield restore
    finally:
        restore()


def generate(llm: Any, prompts: list[list[int]], max_tokens: int = 16) -> list[Any]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def tokens(outputs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def store_counter(llm: Any, name: str) -> float:
    """An ``AscendStoreConnector`` Prometheus counter of an in-process ``LLM`` (started with
    ``disable_log_stats=False``), summed over its label sets."""
    return sum(getattr(m, "value", 0) for m in llm.get_metrics()
               if m.name == f"vllm:ascend_offload_store_{name}")


def sparse_decode_config(sparse: dict[str, Any]) -> dict[str, Any]:
    """A colocated ``AscendSparseDecodeConnector`` kv-transfer config with ``sparse`` as its
    ``sparse_offload`` block (``enabled`` is set)."""
    return {"kv_connector": "AscendSparseDecodeConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"sparse_offload": {"enabled": True, **sparse}}}


def registry_value(family: str) -> float:
    """A metric family of this process's Prometheus registry (``family`` or ``family_total``),
    summed over its label sets: where the stat loggers of this process's engines export
    (the engine created last registers its logger). Not ``LLM.get_metrics()``: it
    truncates counters to integers, and time counters are fractions of a second here."""
    from prometheus_client import REGISTRY

    want = {family, f"{family}_total"}
    return sum(s.value for fam in REGISTRY.collect() for s in fam.samples if s.name in want)
