"""Run real tiny vLLM CPU engines with and without layer sharing; print one JSON line.

Run as a script (``python -m tests.unit.layerwise.engine_check --configs base,1,2``)
from the engine test, so vLLM's engine and its spawn/fork rules stay out of the
pytest process. The engine core runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
with vLLM's uni executor, so the layout hook installed here applies and the
test connector's scheduler and worker share its store.

For every config it reports the engine's number of KV blocks (vLLM's
``cache_config.num_gpu_blocks``), the generated tokens of prompts longer than one
scheduler chunk, the tokens of a later request that shares a long prefix, and
the pipeline / gate counters.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

NUM_LAYERS = 8
BLOCK = 32
CHUNK = 64  # max_num_batched_tokens: prompts below take several scheduler steps


def _make_model(path: Path) -> str:
    try:
        from ascend_offload.testing.tiny_model import make_tiny_llama
    except ImportError:
        return _private_tiny_llama(path)
    return str(make_tiny_llama(path, num_layers=NUM_LAYERS, seed=0))


def _private_tiny_llama(path: Path) -> str:
    """Fallback while the shared helper is absent: random float32 Llama, 8 layers."""
    marker = path / "config.json"
    if marker.exists():
        return str(path)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        initializer_range=0.2, tie_word_embeddings=False, torch_dtype="float32",
        bos_token_id=1, eos_token_id=2,
    )
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    return str(path)


def _prompts() -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(7)
    first = [[rng.randrange(3, 512) for _ in range(n)] for n in (150, 261)]
    # Shares 7 full blocks (224 tokens) with first[1], then diverges.
    second = [first[1][:224] + [rng.randrange(3, 512) for _ in range(45)]]
    return first, second


def run(config: str, model: str, delay: float, multiprocess: bool = False) -> dict[str, Any]:
    """One engine. ``multiprocess``: vLLM's default engine-core child process, where only
    the ``vllm.general_plugins`` entry point (plugin.register) installs the layout hook."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    stats_file = None
    if multiprocess:
        stats_file = Path(os.environ.get("TMPDIR", "/tmp")) / f"lw-stats-{os.getpid()}-{config}.json"
        stats_file.unlink(missing_ok=True)
        os.environ["ASCEND_OFFLOAD_LW_STATS"] = str(stats_file)
    else:
        from ascend_offload.layerwise.layout import install_layout_hook

        install_layout_hook()
    kwargs: dict[str, Any] = dict(
        model=model, dtype="float32", block_size=BLOCK, enforce_eager=True,
        max_model_len=1024, enable_prefix_caching=False, seed=0,
        max_num_batched_tokens=CHUNK, max_num_seqs=4, skip_tokenizer_init=True,
    )
    conn = None
    if config != "base":
        from tests.unit.layerwise import lw_connector as conn

        conn._STORE.__init__()
        conn._STATS.clear()
        conn._STATS.update(hit_tokens=0)
        conn._LAST.clear()
        extra = {
            "use_layerwise": True,
            "layerwise_num_shared_buffers": int(config),
            "layerwise_independent_layers": [0],
            "layerwise_prefetch_layers": 1,
            "debug_save_delay_s": delay,
            "save_timeout_s": 60.0,
        }
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="AscendStoreConnector", kv_role="kv_both",
            kv_connector_module_path="tests.unit.layerwise.lw_connector",
            kv_connector_extra_config=extra,
        )
    llm = LLM(**kwargs)
    try:
        sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        first, second = _prompts()
        out1 = llm.generate([{"prompt_token_ids": p} for p in first], sp, use_tqdm=False)
        hits_before = conn._STATS["hit_tokens"] if conn else 0
        if stats_file is not None:
            hits_before = json.loads(stats_file.read_text())["hit_tokens"]
        out2 = llm.generate([{"prompt_token_ids": p} for p in second], sp, use_tqdm=False)
        result: dict[str, Any] = {
            "config": config,
            "num_gpu_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
            "tokens": [list(o.outputs[0].token_ids) for o in out1],
            "prefix_tokens": [list(o.outputs[0].token_ids) for o in out2],
        }
        if conn is not None:
            st = conn._STATS
            if stats_file is not None:
                # the child writes after every step; the prefix request was its last step
                st = json.loads(stats_file.read_text())
                conn._LAST.update(gate=st["gate"], pipeline=st["pipeline"])
            result.update(
                prefix_hit_tokens=st["hit_tokens"] - hits_before,
                physical_buffers=st.get("physical_buffers"),
                aliased=st.get("aliased"),
                same_process=st.get("scheduler_pid") == st.get("worker_pid")
                and (multiprocess or st.get("worker_pid") == os.getpid()),
                multiprocess=multiprocess,
            )
        return result
    finally:
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default="base,1,2,3", help="comma list: base and/or B values")
    p.add_argument("--delay", type=float, default=0.0, help="debug_save_delay_s for B configs")
    p.add_argument("--slow-config", default="", help="the one B config that gets --delay")
    p.add_argument("--prepare", action="store_true", help="only write the tiny model, then exit")
    p.add_argument("--multiprocess", action="store_true",
                   help="engine core in a child process; the layout hook comes from the plugin")
    p.add_argument("--model-dir", default=os.environ.get(
        "ASCEND_OFFLOAD_TEST_MODELS", "/tmp/ascend-offload-test-models"))
    args = p.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.multiprocess else "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model = _make_model(Path(args.model_dir) / f"tiny-llama-{NUM_LAYERS}l")
    if args.prepare:
        return 0
    results = []
    for config in args.configs.split(","):
        delay = args.delay if config == args.slow_config else 0.0
        res = run(config, model, delay, args.multiprocess)
        if config != "base":
            from tests.unit.layerwise import lw_connector as conn

            res["gate"] = dict(conn._LAST.get("gate", {}))
            res["pipeline"] = dict(conn._LAST.get("pipeline", {}))
            res["delay"] = delay
        results.append(res)
        sys.stderr.write(f"engine_check: {config} done\n")
    sys.stdout.write("ENGINE_CHECK " + json.dumps(results) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
