"""Real vLLM engines for tests and benches: always torn down, optionally stepped by hand.

:func:`owned_engine` owns the only reference to an engine (``LLM`` or
``LLMEngine``) and shuts its engine core down on exit, whatever happened, so a
failed test or bench never leaves an EngineCore process behind.

:func:`stepped_engine` builds an ``LLMEngine`` whose stat loggers include a
:class:`StepRecorder`: vLLM hands every logger the scheduler's counts after every
engine step (running and waiting requests, preemptions), which is how a test
or bench reads how many requests an engine really ran at once (vLLM's own
``num_requests_running`` gauge keeps only the latest value).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
_ids = itertools.count()


@contextlib.contextmanager
def owned_engine(factory: Callable[[], T], *, in_process: bool = False) -> Iterator[T]:
    """Build the engine with ``factory``; on exit shut its engine core down and collect it.

    ``in_process``: the engine core and its worker run in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, vLLM's uni-process executor). It starts in
    ~2-5 s instead of ~15-30 s (no process imports vLLM again), at the price of what
    only separate processes exercise: scheduler-to-worker metadata serialization,
    per-process CPU pinning and transfer-library state. The core freezes the GC heap
    and caches vLLM's environment reads at start; both are undone on exit so later
    engines and tests of this process see the environment as it is."""
    old = os.environ.get(_MP_ENV)
    if in_process:
        os.environ[_MP_ENV] = "0"
        _engine_core_hook()
    try:
        engine: Any = factory()
    finally:
        if in_process:
            _restore_env(_MP_ENV, old)
            _undo_core_process_setup()
    try:
        yield engine
    finally:
        core: Any = getattr(getattr(engine, "llm_engine", engine), "engine_core", None)
        with contextlib.suppress(Exception):
            core.shutdown()
        del engine, core
        if in_process:
            _undo_core_process_setup()
        gc.collect()


_MP_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def _engine_core_hook() -> None:
    """Our plugin's engine-core hook (layerwise layout, sparse KV cut) in this process, as
    the plugin installs it in every engine-core process it registers in. An in-process
    engine shares the process with whatever ran before it, and the plugin registers once
    per process: a test that patched and restored vLLM's engine-core function (or started
    before the plugin registered) must not leave the next engine without the hook."""
    from ascend_offload.connectors.kv_layout_hook import install_layout_hook

    install_layout_hook()  # idempotent; a no-op for engines that configure neither


def _restore_env(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


def _undo_core_process_setup() -> None:
    """What an engine core does to its process at start and a test process must not keep:
    the frozen GC heap (never collected otherwise) and the cached environment reads."""
    from vllm import envs

    envs.disable_envs_cache()
    gc.unfreeze()


@contextlib.contextmanager
def tiny_llm(model: str, kv_transfer_config: dict[str, Any] | None = None, *, plugin: bool = True,
             in_process: bool = False, **kwargs: Any) -> Iterator[Any]:
    """A float32, eager, prefix-caching-off ``LLM`` of a tiny test model (32-token blocks,
    ``kwargs`` override), shut down on exit. ``plugin=False``: the engine's processes load
    no vLLM plugin at all (vLLM exactly as without ours; this process keeps our names), so
    it always runs in its own processes. ``in_process``: see :func:`owned_engine`."""
    if not plugin and in_process:
        raise ValueError("plugin=False needs the engine's own processes: this one loaded our plugin")
    from vllm import LLM
    from vllm.config import KVTransferConfig

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    old = os.environ.get("VLLM_PLUGINS")
    if not plugin:
        from vllm.plugins import load_general_plugins

        load_general_plugins()
        os.environ["VLLM_PLUGINS"] = ""
    args: dict[str, Any] = dict(model=model, dtype="float32", block_size=32, enforce_eager=True,
                                max_model_len=4096, enable_prefix_caching=False, seed=0)
    args.update(kwargs)
    if kv_transfer_config is not None:
        args["kv_transfer_config"] = KVTransferConfig(**kv_transfer_config)
    try:
        with owned_engine(lambda: LLM(**args), in_process=in_process) as llm:
            yield llm
    finally:
        if not plugin:
            if old is None:
                os.environ.pop("VLLM_PLUGINS", None)
            else:
                os.environ["VLLM_PLUGINS"] = old


@dataclasses.dataclass(frozen=True)
class StepCounts:
    """The scheduler's counts after one engine step."""

    running: int
    waiting: int
    preempted: int  # requests preempted in this step


class StepRecorder:
    """Collects :class:`StepCounts` of every step of one engine (see the module docstring)."""

    def __init__(self) -> None:
        self.steps: list[StepCounts] = []

    def add(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if scheduler_stats is None:
            return
        pre = 0 if iteration_stats is None else int(iteration_stats.num_preempted_reqs)
        self.steps.append(StepCounts(int(scheduler_stats.num_running_reqs),
                                     int(scheduler_stats.num_waiting_reqs), pre))

    def mark(self) -> int:
        """A position to measure from (:meth:`peak_running`, :meth:`preempted`)."""
        return len(self.steps)

    def peak_running(self, since: int = 0) -> int:
        return max((s.running for s in self.steps[since:]), default=0)

    def preempted(self, since: int = 0) -> int:
        return sum(s.preempted for s in self.steps[since:])

    def logger_factory(self) -> type:
        """A vLLM per-engine stat logger class feeding this recorder."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        recorder = self

        class _Logger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any,
                       mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
                recorder.add(scheduler_stats, iteration_stats)

            def log_engine_initialized(self) -> None:
                pass

        return _Logger


def ngram_speculative_config(drafts: int) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for n-gram speculation with ``drafts`` draft tokens
    (prompt lookup of 1-3 tokens), as the tests, benches and the demo run it."""
    return {"method": "ngram", "num_speculative_tokens": drafts, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1}


def explicit_kv_memory(engine_args: dict[str, Any]) -> None:
    """Let ``kv_cache_memory_bytes`` count: vLLM's CPU platform replaces it with the legacy
    ``VLLM_CPU_KVCACHE_SPACE`` (GiB) whenever that is set, so drop it from the
    environment the engine core inherits."""
    if engine_args.get("kv_cache_memory_bytes") is not None:
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)


def stepped_engine(recorder: StepRecorder, **engine_args: Any) -> Any:
    """An ``LLMEngine`` (engine core in its own process) reporting every step to ``recorder``.

    ``engine_args`` are vLLM's ``EngineArgs``; a ``kv_transfer_config`` dict is
    turned into a ``KVTransferConfig``. Stats logging is forced on (the recorder
    needs it)."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    explicit_kv_memory(engine_args)
    kvt = engine_args.get("kv_transfer_config")
    if isinstance(kvt, dict):
        engine_args["kv_transfer_config"] = KVTransferConfig(**kvt)
    engine_args["disable_log_stats"] = False
    return LLMEngine.from_engine_args(EngineArgs(**engine_args),
                                      stat_loggers=[recorder.logger_factory()])


def run_requests(engine: Any, prompts: Sequence[Sequence[int]], params: Sequence[Any],
                 after_step: Callable[[int], None] | None = None) -> list[list[int]]:
    """Submit every prompt at once, step the engine until all finish; tokens in order.
    ``after_step(i)`` runs after the ``i``-th step (0-based), e.g. to reset a cache with
    work in flight."""
    if len(prompts) != len(params):
        raise ValueError(f"{len(prompts)} prompts, {len(params)} sampling params")
    ids = [f"req-{next(_ids)}" for _ in prompts]
    for rid, prompt, sp in zip(ids, prompts, params, strict=True):
        engine.add_request(rid, {"prompt_token_ids": list(prompt)}, sp)
    done: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        if after_step is not None:
            after_step(step)
        step += 1
    missing = [rid for rid in ids if rid not in done]
    if missing:
        raise RuntimeError(f"engine finished without output for {missing}")
    return [done[rid] for rid in ids]
