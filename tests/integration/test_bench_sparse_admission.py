"""``bench sparse-admission`` with small sizes: three real vLLM CPU engines, one after the other.

Checks what the JSON promises, not timings: each engine ran as many requests at
once as its KV memory allows (the plan's expected counts, from the block and
row sizes; the hybrid-residency engine as many as the offload engine), the greedy
tokens are identical, the offload engine's main KV on the device is its hot
buffers only (page-aligned) and the ratios are the ratios of the reported figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ascend_offload import cli

ROOT = Path(__file__).resolve().parents[2]
ARGS = dict(context=512, hot=32, index_topk=16, decode_tokens=6, layers=2, baseline_fit=3)


def test_registered_and_skipped_by_bench_all() -> None:
    assert cli.BENCHES["sparse-admission"] == "ascend_offload.bench.sparse_admission"
    assert "sparse-admission" in cli.SLOW_BENCHES


def test_plan_counts_blocks_and_hot_buffers() -> None:
    from ascend_offload.bench.sparse_admission import plan

    a = argparse.Namespace(kv_bytes=None, max_num_seqs=None, **{**ARGS, "baseline_fit": 4.5})
    p = plan(a)
    main, index = (512 + 64) * 4, 128 * 4
    assert (p["main_row_bytes"], p["indexer_row_bytes"]) == (main, index)
    assert p["request_blocks"] == 17  # 518 tokens
    assert p["expected_running"]["baseline"] == 4
    seqs = p["max_num_seqs"]
    # the offload engine holds max_num_seqs requests: their indexer blocks fit beside the
    # hot buffers of max_num_seqs slots, and one more slot would not fit
    for s, fits in ((seqs, True), (seqs + 1, False)):
        hot = 2 * -(-s * 32 * main // 4096) * 4096
        blocks = (a.kv_bytes - hot - 4096) // (32 * index * 2)
        assert (blocks // 17 >= s) is fits
    assert p["expected_running"]["offload"] == seqs
    assert p["admitted_ratio_limit"] == pytest.approx((main + index) / (index + main * 32 / 512))


def test_bad_settings_are_refused_before_any_engine_starts() -> None:
    from ascend_offload.bench import sparse_admission

    with pytest.raises(SystemExit, match="index-topk"):
        sparse_admission.main(["--context", "512", "--hot", "32", "--index-topk", "64"])


@pytest.mark.bench
@pytest.mark.e2e
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_small_run_writes_the_promised_json(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    out = tmp_path / "sparse-admission.json"
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in ARGS.items()]
    proc = subprocess.run([sys.executable, "-m", "ascend_offload.cli", "bench", "sparse-admission",
                           *argv, "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=580, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "admitted_ratio" in proc.stdout and "decode_device_kv_ratio" in proc.stdout
    res: dict[str, Any] = json.loads(out.read_text())
    print("\n" + proc.stdout)

    assert res["parity"] is True
    assert res["peak_running"] == res["expected_running"], res
    assert res["preempted"]["offload"] == 0  # the baseline may preempt as decodes grow
    pk = res["peak_running"]
    assert res["admitted_ratio"] == pytest.approx(pk["offload"] / pk["baseline"])
    # hybrid residency at the same memory: it borrows only free blocks and gives them back
    # (moving residents to the host pool) when vLLM needs them, so it admits as many
    assert res["hybrid_parity"] is True and res["preempted"]["hybrid"] == 0
    assert res["hybrid_admitted_ratio"] == pytest.approx(pk["hybrid"] / pk["baseline"])
    assert res["hybrid_admitted_share"] == pytest.approx(res["hybrid_admitted_ratio"]
                                                         / res["admitted_ratio"])
    assert res["hybrid_target_met"] is True
    hc = res["hybrid_counters"]
    assert 1 <= hc["placed_requests"] and hc["moved_requests"] <= hc["placed_requests"], hc
    assert res["num_gpu_blocks"]["hybrid"] == res["num_gpu_blocks"]["offload"]
    assert res["config"]["requests"] > pk["offload"] > pk["baseline"]
    c, kv = res["config"], res["main_kv_device_bytes"]
    hot = c["max_num_seqs"] * c["hot"] * c["main_row_bytes"]
    assert kv["offload"] == c["layers"] * -(-hot // 4096) * 4096
    assert kv["offload"] + kv["offload_indexer"] == kv["offload_total"] <= c["kv_cache_memory_bytes"]
    assert kv["offload_indexer"] == (res["num_gpu_blocks"]["offload"] * 32 * c["indexer_row_bytes"]
                                     * c["layers"])
    assert res["decode_device_kv_ratio"] == pytest.approx(kv["offload"] / kv["baseline_for_context"])
    assert kv["baseline_for_context"] == (c["max_num_seqs"] * c["request_blocks"] * 32
                                          * c["main_row_bytes"] * c["layers"])
