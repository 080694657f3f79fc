"""Real tiny vLLM CPU engines (8 float32 layers): layer sharing with I=[0], B in {1,2,3}.

Checks, against the same engine without any connector:
* chunked prefill (max_num_batched_tokens=64, prompts of 150 and 261 tokens) gives
  identical tokens;
* a later request sharing 224 prefix tokens loads them from the store (hit count)
  and still gives identical tokens;
* the engine's reported KV block count grows to >= 0.9 * N / physical of the base;
* with an injected slow store save (B=1) tokens stay identical and the gate waited.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[3]
N = 8


@pytest.fixture(scope="module")
def results() -> list[dict]:
    """Two engine_check processes at once, each pinned to its own core (2-core CI box)."""
    pytest.importorskip("vllm")
    base_env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_CPU_KVCACHE_SPACE="1")
    prep = subprocess.run(  # write the model once, before two processes would race on it
        [sys.executable, "-m", "tests.unit.layerwise.engine_check", "--prepare"],
        cwd=ROOT, env=base_env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert prep.returncode == 0, prep.stderr[-4000:]
    runs = [("base,2", "0"), ("1,3", str(min(1, (os.cpu_count() or 1) - 1)))]
    procs = []
    for configs, core in runs:
        env = dict(base_env, VLLM_CPU_OMP_THREADS_BIND=core)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tests.unit.layerwise.engine_check", "--configs", configs,
             "--slow-config", "1", "--delay", "0.005"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        ))
    merged: list[dict] = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=1200)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        line = next((ln for ln in out.splitlines() if ln.startswith("ENGINE_CHECK ")), None)
        assert proc.returncode == 0 and line is not None, err[-4000:]
        merged += json.loads(line[len("ENGINE_CHECK "):])
    merged.sort(key=lambda r: (r["config"] != "base", r["config"]))
    return merged


@pytest.mark.parametrize("b", [1, 2, 3])
def test_tokens_identical_with_chunked_prefill_and_store_prefix(results: list[dict], b: int) -> None:
    base = results[0]
    run = next(r for r in results if r["config"] == str(b))
    assert run["same_process"] and run["aliased"]
    assert run["pipeline"]["steps"] >= 261 // 64  # several scheduler chunks
    assert run["tokens"] == base["tokens"]
    assert run["prefix_hit_tokens"] == 224  # 7 full blocks came from the store
    assert run["prefix_tokens"] == base["prefix_tokens"]
    assert run["pipeline"]["load_errors"] == 0 and run["pipeline"]["save_errors"] == 0
    assert run["pipeline"]["blocks_loaded"] > 0 and run["gate"]["timeouts"] == 0


@pytest.mark.parametrize("b", [1, 2, 3])
def test_kv_block_capacity_grows(results: list[dict], b: int) -> None:
    base = results[0]["num_gpu_blocks"]
    run = next(r for r in results if r["config"] == str(b))
    physical = 1 + min(b, N - 1)
    assert run["physical_buffers"] == physical
    assert run["num_gpu_blocks"] >= 0.9 * N / physical * base


def test_slow_save_gate_waited(results: list[dict]) -> None:
    slow = next(r for r in results if r["config"] == "1")
    assert slow["delay"] > 0
    assert slow["gate"]["waits"] > 0 and slow["gate"]["wait_s"] > 0
    assert slow["tokens"] == results[0]["tokens"]
