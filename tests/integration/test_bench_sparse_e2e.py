"""``bench sparse-e2e`` with tiny settings: six real vLLM CPU engines (a few minutes).

Checks what the JSON promises rather than any timing: the ratios are medians of the
paired rounds, all engines generated the same greedy tokens, every decode row of
every layer was resolved through the hot buffers (exact count over the whole run)
by both resolvers, the device resolver's worker read no top-k back to the host, the
breakdown has the offload phases only for the offload engines, and the offload
engine's main-KV device bytes are exactly its hot buffers; the hybrid engine kept
every request resident (every decode query token of every layer attended over its
device rows, nothing resolved, copied, moved or written to the pool) at both batch
sizes, with its ratio per batch size.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ascend_offload import cli

ROOT = Path(__file__).resolve().parents[2]
LAYERS, ROW_BYTES = 4, (64 + 16) * 4  # tiny sparse model: latent + rope, float32
# The device engine runs the table's tensor ops (the kernel an accelerator runs) here; the
# C++ kernel a CPU engine picks by default runs in tests/e2e/test_sparse_decode_e2e.py.
ARGS = dict(batch=2, context=160, decode_tokens=6, hot=32, index_topk=16, rounds=2,
            device_use_native="off")


def _run_bench(tmp_path: Path, argv: list[str]) -> tuple[str, dict[str, Any]]:
    """``ascend-offload bench sparse-e2e ARGV`` in its own process: stdout and the JSON."""
    pytest.importorskip("vllm")
    out = tmp_path / "sparse-e2e.json"
    proc = subprocess.run([sys.executable, "-m", "ascend_offload.cli", "bench", "sparse-e2e", *argv,
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=450, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout, json.loads(out.read_text())


def test_sparse_e2e_is_registered_and_skipped_by_bench_all(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cli.BENCHES["sparse-e2e"] == "ascend_offload.bench.sparse_e2e"
    ran: list[str] = []
    monkeypatch.setattr(cli, "_run", lambda module, argv: ran.append(module) or 0)
    assert cli.main(["bench", "all", "--out", "x"]) == 0
    assert "ascend_offload.bench.sparse_e2e" not in ran and "ascend_offload.bench.e2e_pd" not in ran
    assert "ascend_offload.bench.sparse" in ran


def test_bad_settings_are_refused_before_any_engine_starts() -> None:
    from ascend_offload.bench import sparse_e2e

    with pytest.raises(SystemExit, match="index-topk"):
        sparse_e2e.main(["--context", "32", "--index-topk", "32"])
    with pytest.raises(SystemExit, match="decode-tokens"):
        sparse_e2e.main(["--decode-tokens", "1"])
    with pytest.raises(SystemExit, match="hybrid-batches"):
        sparse_e2e.main(["--hybrid-batches", "1,9"])  # above --batch 8
    with pytest.raises(SystemExit, match="hybrid-batches"):
        sparse_e2e.main(["--hybrid-batches", "one"])


@pytest.mark.bench
@pytest.mark.e2e
@pytest.mark.integration
@pytest.mark.timeout(720)
def test_tiny_run_writes_the_promised_json(tmp_path: Path) -> None:
    stdout, res = _run_bench(tmp_path, [f"--{k.replace('_', '-')}={v}" for k, v in ARGS.items()])
    assert "step_ratio" in stdout and "decode_device_kv_ratio" in stdout

    med = {n: res["step_ms"][n]["median"] for n in ("baseline", "offload", "device")}
    assert all(len(res["step_ms"][n]["rounds"]) == ARGS["rounds"] for n in med)
    paired = [o / b for o, b in zip(res["step_ms"]["offload"]["rounds"],
                                    res["step_ms"]["baseline"]["rounds"], strict=True)]
    assert res["step_ratio"] == pytest.approx(statistics.median(paired), rel=1e-3)
    assert res["step_ratio_of_medians"] == pytest.approx(med["offload"] / med["baseline"])
    assert res["target_met"] == (res["step_ratio"] <= 1.10)
    paired_dev = [o / b for o, b in zip(res["step_ms"]["device"]["rounds"],
                                        res["step_ms"]["baseline"]["rounds"], strict=True)]
    assert res["device_step_ratio"] == pytest.approx(statistics.median(paired_dev), rel=1e-3)
    assert res["device_step_ratio_of_medians"] == pytest.approx(med["device"] / med["baseline"])
    assert res["device_target_met"] == (res["device_step_ratio"] <= 1.15)
    assert res["parity"] is True

    bd = res["breakdown_ms_per_step"]
    for phase in ("resolve", "miss_copy", "offload"):
        assert all(phase not in bd[n] for n in ("baseline", "connector", "baseline2")), bd
        assert phase in bd["offload"] and phase in bd["device"], bd
    # no prefill-pass subtraction touches these (a prefill resolves and copies nothing);
    # offload and layer_rest are differences of timings: on a loaded machine either may
    # come out slightly negative, so only their presence is checked
    assert bd["offload"]["resolve"] > 0 and bd["offload"]["miss_copy"] > 0, bd
    assert all("layer_rest" in bd[n] for n in ("baseline", "offload")), bd
    for n in med:
        assert bd[n]["indexer"] > 0 and bd[n]["attention"] > 0, bd
        parts = sum(v for k, v in bd[n].items() if k not in ("step", "other"))
        assert bd[n]["other"] == pytest.approx(bd[n]["step"] - parts)

    # main KV on the device: the offload engine's hot buffers only (page-aligned), against
    # vLLM's paged main KV for the same batch at the stated context
    kv = res["main_kv_device_bytes"]
    hot = ARGS["batch"] * ARGS["hot"] * ROW_BYTES
    assert kv["offload_hot_buffers"] == LAYERS * hot
    assert kv["offload"] == LAYERS * -(-hot // 4096) * 4096
    blocks = -(-(ARGS["context"] + ARGS["decode_tokens"]) // 32)
    assert kv["baseline_for_context"] == ARGS["batch"] * blocks * 32 * ROW_BYTES * LAYERS
    assert res["decode_device_kv_ratio"] == pytest.approx(kv["offload"] / kv["baseline_for_context"])
    assert kv["baseline_allocated"] >= kv["baseline_for_context"]
    assert kv["offload_indexer"] > 0

    # every decode row of every layer went through the hot buffers: warm-up (batch // 2
    # requests, 4 tokens) and the rounds (their prefill-only passes decode nothing)
    b, dt = ARGS["batch"], ARGS["decode_tokens"]
    decode_rows = (b // 2) * 3 + ARGS["rounds"] * b * (dt - 1)
    for c in (res["offload_counters"], res["device_counters"]):
        assert c["resolved_positions"] == LAYERS * ARGS["index_topk"] * decode_rows, c
        assert c["admission_failures"] == 0 and c["unmatched_rows"] == 0, c
        assert c["miss_rows"] > 0 and c["hit_positions"] > 0, c
    # the same exact-LRU decisions on both resolvers; only the host one reads the top-k
    assert res["device_counters"]["miss_rows"] == res["offload_counters"]["miss_rows"]
    assert res["device_counters"]["host_reads_topk"] == 0
    assert res["device_counters"]["host_reads_new_rows"] == 0
    # one top-k read per layer of every step with decode rows: at least the warm-up's 3 and
    # the rounds' steps (more when a batch's requests do not decode in lockstep)
    reads = res["offload_counters"]["host_reads_topk"]
    assert reads % LAYERS == 0 and LAYERS * (3 + ARGS["rounds"] * (dt - 1)) <= reads \
        <= LAYERS * decode_rows, reads
    assert res["device_counters"]["host_reads_step"] > 0
    assert res["device_residency"] == {"kind": "device", "kernel": "ops"}
    _check_hybrid(res, b, dt, query_tokens=1)


def _check_hybrid(res: dict[str, Any], batch: int, dt: int, *, query_tokens: int,
                  rounds: int = ARGS["rounds"], hybrid_only: bool = False) -> None:
    """The hybrid engine at batch 1 and ``batch`` (the default ``--hybrid-batches``): its
    ratio is the median of its own paired rounds (at ``batch`` those of all engines unless
    ``hybrid_only``), every request stayed resident, tokens equal the baseline's."""
    assert res["config"]["hybrid_batches"] == [1, batch]
    assert res["config"]["hybrid_kv_cache_memory_bytes"] >= res["config"]["kv_cache_memory_bytes"]
    assert set(res["hybrid_step_ratio"]) == set(res["hybrid"]) == {"1", str(batch)}
    if not hybrid_only:
        main = res["hybrid"][str(batch)]["step_ms"]
        assert main["hybrid"]["rounds"] == res["step_ms"]["hybrid"]["rounds"]
        assert main["baseline"]["rounds"] == res["step_ms"]["baseline"]["rounds"]
        assert main["connector"]["rounds"] == res["step_ms"]["connector"]["rounds"]
        assert main["baseline2"]["rounds"] == res["step_ms"]["baseline2"]["rounds"]
    for key, h in res["hybrid"].items():
        b = int(key)
        assert h["batch"] == b and h["rounds"] == rounds and h["parity"] is True, h
        # the batch-size rounds of all engines: one pass each; a size of its own: two
        # (a palindrome), each round's figure the mean of an engine's passes
        passes = 1 if b == batch and not hybrid_only else 2
        assert h["passes_per_round"] == passes, h
        ratios = [x / y for x, y in zip(h["step_ms"]["hybrid"]["rounds"],
                                        h["step_ms"]["baseline"]["rounds"], strict=True)]
        assert res["hybrid_step_ratio"][key] == h["step_ratio"] == pytest.approx(
            statistics.median(ratios), rel=1e-3)
        # the same rounds split at the null-connector engine: vLLM's share and ours
        # and the A/A control: a second baseline engine against the baseline
        for num, den, name in (("connector", "baseline", "connector_step_ratio"),
                               ("hybrid", "connector", "vs_connector_step_ratio"),
                               ("baseline2", "baseline", "aa_step_ratio")):
            split = [x / y for x, y in zip(h["step_ms"][num]["rounds"],
                                           h["step_ms"][den]["rounds"], strict=True)]
            assert h[name] == pytest.approx(statistics.median(split), rel=1e-3)
        assert res["hybrid_connector_step_ratio"][key] == h["connector_step_ratio"]
        assert res["hybrid_vs_connector_step_ratio"][key] == h["vs_connector_step_ratio"]
        assert res["hybrid_aa_step_ratio"][key] == h["aa_step_ratio"]
        c = h["counters"]
        assert c["miss_rows"] == c["resolved_positions"] == c["pool_query_tokens"] == 0, c
        assert c["offload_rows"] == c["moved_requests"] == c["moved_bytes"] == 0, c
        # the prefill pass and the round, every pass
        assert c["placed_requests"] == 2 * b * rounds * passes, c
        assert res["hybrid_miss_rows"][key] == res["hybrid_moved_requests"][key] == 0
        assert res["hybrid_resident_query_tokens"][key] == c["resident_query_tokens"]
        if query_tokens == 1:
            want = LAYERS * b * rounds * passes * (dt - 1)
            assert h["expected_decode_resident_query_tokens"] == want
            assert c["resident_query_tokens"] == c["resident_rows"] == want, c
        else:
            assert c["resident_query_tokens"] >= LAYERS * b * rounds * passes * (dt - 1), c
        assert res["hybrid_target_met"][key] == (h["step_ratio"] <= 1.02)
        bd = h["breakdown_ms_per_step"]["hybrid"]
        assert bd["resolve"] == bd["miss_copy"] == bd["offload"] == 0, bd
    assert res["hybrid_parity"] is True
    hc = res["hybrid_counters"]
    assert hc["admission_failures"] == hc["unmatched_rows"] == hc["host_reads_topk"] == 0, hc
    # every request the worker still holds is resident (a finish reaches the worker with
    # the next step, so the last round's requests may still be there)
    g = res["hybrid_gauges"]
    assert g["resident_requests"] == g["admitted_requests"], g


@pytest.mark.bench
def test_hybrid_only_runs_the_hybrid_rounds_alone(tmp_path: Path) -> None:
    """``--hybrid-only``: the four engines of the hybrid engine's rounds only, palindromic
    rounds at every batch size; the JSON has the hybrid keys and none of the offload
    engines'."""
    stdout, res = _run_bench(tmp_path, ["--hybrid-only", "--batch=2", "--context=160",
                                        "--decode-tokens=4", "--hot=32", "--index-topk=16",
                                        "--rounds=1"])
    assert "hybrid residency engines only" in stdout and "decode_device_kv_ratio" not in stdout
    assert res["config"]["hybrid_only"] is True
    assert "step_ratio" not in res and "device_step_ratio" not in res and "parity" not in res
    _check_hybrid(res, 2, 4, query_tokens=1, rounds=1, hybrid_only=True)


def test_a_hot_buffer_too_small_for_the_drafts_is_refused_before_any_engine_starts() -> None:
    from ascend_offload.bench import sparse_e2e

    with pytest.raises(SystemExit, match=r"--hot 64: a verification row of 1 \+ 3 tokens needs >= 128"):
        sparse_e2e.main(["--spec-tokens", "3", "--hot", "64"])
    with pytest.raises(SystemExit, match="spec-tokens >= 0"):
        sparse_e2e.main(["--spec-tokens", "-1"])


@pytest.mark.bench
@pytest.mark.e2e
@pytest.mark.integration
@pytest.mark.timeout(720)
def test_tiny_speculating_run_writes_the_spec_keys(tmp_path: Path) -> None:
    """``--spec-tokens``: every engine speculates; the spec keys are the run's ratios, no
    verification row went to the pool, both offload engines verified the same rows."""
    pytest.importorskip("vllm")
    stdout, res = _run_bench(tmp_path, ["--batch=2", "--context=160", "--decode-tokens=8",
                                        "--index-topk=16", "--rounds=2", "--spec-tokens=3"])
    assert "spec_step_ratio" in stdout
    assert res["config"]["spec_tokens"] == 3 and res["config"]["hot"] == 96  # 5 x 16 -> 3 blocks
    assert res["parity"] is True
    assert res["spec_step_ratio"] == res["step_ratio"]
    assert res["spec_device_step_ratio"] == res["device_step_ratio"]
    assert res["spec_pool_fallback_rows"] == 0
    rows = res["spec"]["verify_rows"]
    assert rows["offload"] == rows["device"] > 0, rows
    vllm_counts = res["spec"]["device_engine_vllm"]
    assert vllm_counts["num_drafts"] == rows["device"], res["spec"]
    assert 0 <= vllm_counts["num_accepted_tokens"] <= vllm_counts["num_draft_tokens"]
    # the hybrid engine speculates too: its verification rows attend over its device rows
    _check_hybrid(res, 2, 8, query_tokens=4)
