"""Sparse decode offload in one real vLLM CPU engine (colocated mode), float32.

Our 4-layer sparse-MLA model (index_topk 32) with ``AscendSparseDecodeConnector``,
hot buffers of 64 rows, against the same model without the connector (the
baseline). Both engines stay up for the whole file, with the same engine
config and the same KV memory (``kv_cache_memory_bytes``); every request is
submitted at once and the engines are stepped by hand, so the scheduler's
running/waiting counts of every step are recorded.

* Batch A, 32 prompts: 16 of 256-520 tokens (>= 4x the hot buffer) and 16 of
  8-120, 3-10 new tokens each, at most 4 at a time (``max_num_seqs``), prefill
  in chunks of 128 tokens mixed with decode rows; requests finish and free their
  pool rows while others continue.
* Batch B, 6 prompts of 460-520 tokens with 12 new tokens each: the host pool
  (40 blocks) holds at most two of them at once, so the others wait for pool
  rows (``get_num_new_matched_tokens`` -> None) while the baseline runs up to
  four: the offload engine's peak running requests is <= 2, the baseline's >= 3.

Greedy tokens must be identical, every decode token of every layer must have
been resolved through the hot buffers, and the run must really hit and miss.
The engine's device KV, read from its own allocation (``device_*_kv_bytes``
gauges): main KV = the hot buffers only.

A third engine, started after the first two are gone, runs the same batches with
``residency_backend: device`` (the resolve, miss gather and new-row scatter as
device tensor ops): its tokens must equal the baseline's, and in every engine step
its worker read no top-k and no row back to the host (``device.host_read``'s counter,
reported per step through the connector stats), while the host resolver's engine
read the top-k every layer of every decode step.

Then hybrid residency (``hybrid: true``), the same 38 prompts at concurrency 4 on two
more engines: with the same KV memory every request stays resident (no miss, nothing
written to the pool, nothing moved); with ~100 indexer blocks the residents' borrowed
blocks run out, the longest-running move to the host pool (counted) and decode from the
hot buffers. Tokens equal the baseline's on both, every borrowed block goes back.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from ascend_offload.harness.engines import StepRecorder, owned_engine, run_requests, stepped_engine
from ascend_offload.harness.tiny_sparse_model import make_tiny_sparse_model
from tests.e2e.harness import MODEL_CACHE, registry_value, sparse_decode_config

N_LAYERS = 4
TOPK = 32
HOT = 64
BLOCK = 32
ROW_BYTES = (64 + 16) * 4  # latent + rope, float32
INDEX_ROW_BYTES = 32 * 4  # index_head_dim, float32
MAX_SEQS = 4
PAGE = 4096
# The same KV memory for both engines. Small enough that the offload engine's
# overlapping main-KV views (one element per block) fit inside the hot regions.
KV_BYTES = 256 * 2**20
ENGINE_ARGS: dict[str, Any] = dict(
    dtype="float32", block_size=BLOCK, enforce_eager=True, enable_prefix_caching=False, seed=0,
    max_num_batched_tokens=128, max_model_len=1024, max_num_seqs=MAX_SEQS,
    kv_cache_memory_bytes=KV_BYTES)
POOL_BLOCKS = 40  # >= max_model_len; at most two of batch B's reservations at once
POOL_GB = POOL_BLOCKS * BLOCK * N_LAYERS * ROW_BYTES / 2**30 + 1e-9


def _batch_a() -> tuple[list[int], list[int]]:
    rng = random.Random(5)
    lengths = [rng.randrange(256, 521) if i % 2 == 0 else rng.randrange(8, 121) for i in range(32)]
    return lengths, [rng.randrange(3, 11) for _ in lengths]


LENGTHS_A, MAX_TOKENS_A = _batch_a()
LENGTHS_B = [460, 520, 475, 505, 490, 466]
MAX_TOKENS_B = [12] * len(LENGTHS_B)
LENGTHS = LENGTHS_A + LENGTHS_B
MAX_TOKENS = MAX_TOKENS_A + MAX_TOKENS_B


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


PROMPTS_A, PROMPTS_B = _prompts(LENGTHS_A, 23), _prompts(LENGTHS_B, 29)


def _reservation_blocks(n: int, k: int) -> int:
    return -(-(n + k) // BLOCK)


def _sparse_config(backend: str = "host") -> dict[str, Any]:
    return sparse_decode_config({"topk_buffer_size": HOT, "index_topk": TOPK,
                                 "dram_size_per_dp_GB": POOL_GB, "residency_backend": backend})


class _ConnectorSteps(StepRecorder):
    """The scheduler counts of every step plus the connector's stats of that step (the
    worker's counter deltas, as vLLM hands them to its stat loggers)."""

    def __init__(self) -> None:
        super().__init__()
        self.connector: list[dict[str, Any]] = []

    def add(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        super().add(scheduler_stats, iteration_stats)
        if scheduler_stats is not None:
            self.connector.append(dict(scheduler_stats.kv_connector_stats or {}))


def _run(engine: Any, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    from vllm import SamplingParams

    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    return run_requests(engine, prompts, params)


def _metric(name: str) -> float:
    return registry_value(f"vllm:ascend_offload_sparse_{name}")


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(make_tiny_sparse_model(MODEL_CACHE / "tiny-sparse-mla-4l", index_topk=TOPK))


@pytest.fixture(scope="module")
def runs(model_dir: str) -> dict[str, Any]:
    rec = {"baseline": StepRecorder(), "offload": _ConnectorSteps(), "device": _ConnectorSteps()}
    out: dict[str, Any] = {"tokens": {}, "peak_a": {}, "peak_b": {}, "blocks": {}}
    # baseline first: a later engine's Prometheus logger replaces an earlier one's, and the
    # connector metrics read below are the offload engine's
    # baseline and the device resolver in this process (they start in seconds); the host
    # resolver's engine in its own processes, so the colocated connector's metadata crosses
    # vLLM's scheduler-worker boundary
    with owned_engine(lambda: stepped_engine(rec["baseline"], model=model_dir, **ENGINE_ARGS),
                      in_process=True) as base, \
         owned_engine(lambda: stepped_engine(rec["offload"], model=model_dir,
                                             kv_transfer_config=_sparse_config(), **ENGINE_ARGS)
                      ) as off:
        engines = {"baseline": base, "offload": off}
        for name, eng in engines.items():
            out["blocks"][name] = eng.vllm_config.cache_config.num_gpu_blocks
            r = rec[name]
            m = r.mark()
            toks = _run(eng, PROMPTS_A, MAX_TOKENS_A)
            out["peak_a"][name] = r.peak_running(m)
            m = r.mark()
            toks += _run(eng, PROMPTS_B, MAX_TOKENS_B)
            out["peak_b"][name] = r.peak_running(m)
            out["tokens"][name] = toks
        out["metrics"] = {n: _metric(n) for n in (
            "steps", "resolved_positions", "hit_positions", "miss_rows", "miss_bytes",
            "offload_rows", "admission_failures", "unmatched_rows", "resolve_seconds",
            "copy_seconds", "pool_rows_used", "device_kv_bytes", "device_main_kv_bytes",
            "device_indexer_kv_bytes")}
    # the device resolver's engine: the same batches after the others are gone
    with owned_engine(lambda: stepped_engine(rec["device"], model=model_dir,
                                             kv_transfer_config=_sparse_config("device"),
                                             **ENGINE_ARGS), in_process=True) as dev_engine:
        m = rec["device"].mark()
        toks = _run(dev_engine, PROMPTS_A, MAX_TOKENS_A)
        out["peak_a"]["device"] = rec["device"].peak_running(m)
        m = rec["device"].mark()
        toks += _run(dev_engine, PROMPTS_B, MAX_TOKENS_B)
        out["peak_b"]["device"] = rec["device"].peak_running(m)
        out["tokens"]["device"] = toks
    out["connector_steps"] = {n: rec[n].connector for n in ("offload", "device")}
    return out


def test_greedy_tokens_identical_to_the_model_without_offload(runs: dict[str, Any]) -> None:
    toks = runs["tokens"]
    assert len(LENGTHS) >= 30
    assert [len(t) for t in toks["offload"]] == MAX_TOKENS
    assert toks["offload"] == toks["baseline"]
    assert toks["device"] == toks["baseline"]  # residency_backend: device
    # the prompts really differ in what they generate (not one degenerate answer)
    assert len({tuple(t) for t in toks["baseline"]}) == len(LENGTHS)


def test_requests_ran_concurrently_and_waited_for_pool_rows(runs: dict[str, Any]) -> None:
    # several requests decoded at once (batch A)
    assert runs["peak_a"]["offload"] >= 2 and runs["peak_a"]["baseline"] >= 2, runs["peak_a"]
    # batch B: any three reservations exceed the pool, so at most two ran at once with
    # offload; the baseline (same engine config, no pool) ran more, so requests waited
    # for pool rows, and every one finished (rows freed and taken again)
    res = sorted(_reservation_blocks(n, k) for n, k in zip(LENGTHS_B, MAX_TOKENS_B, strict=True))
    assert sum(res[:3]) > POOL_BLOCKS >= sum(res[-2:])
    assert runs["peak_b"]["offload"] <= 2 < runs["peak_b"]["baseline"], runs["peak_b"]
    assert runs["peak_b"]["offload"] == 2, runs["peak_b"]


def test_every_decode_token_went_through_the_hot_buffers(runs: dict[str, Any]) -> None:
    m = runs["metrics"]
    assert m["admission_failures"] == 0 and m["unmatched_rows"] == 0, m
    # every decode step of every request resolves min(topk, context) positions per layer
    decode_positions = N_LAYERS * sum(min(TOPK, n) * (k - 1)
                                      for n, k in zip(LENGTHS, MAX_TOKENS, strict=True))
    assert m["resolved_positions"] >= decode_positions, m
    assert m["hit_positions"] > 0 and m["miss_rows"] > 0, m  # selection and eviction happened
    assert m["hit_positions"] + m["miss_rows"] == m["resolved_positions"], m
    assert m["miss_bytes"] == m["miss_rows"] * ROW_BYTES, m
    # every computed main-KV row of every layer went to the host pool
    computed = sum(n + k - 1 for n, k in zip(LENGTHS, MAX_TOKENS, strict=True))
    assert m["offload_rows"] == N_LAYERS * computed, m
    assert m["resolve_seconds"] > 0 and m["copy_seconds"] > 0, m
    print(f"\nsparse decode offload metrics: {m}; hit rate "
          f"{m['hit_positions'] / m['resolved_positions']:.3f}, miss rows per step "
          f"{m['miss_rows'] / m['steps']:.1f}")


def test_device_main_kv_is_the_hot_buffers_only(runs: dict[str, Any]) -> None:
    """Read from the engines: the offload engine's main KV on the device is its hot
    buffers (page-rounded), its indexer blocks took the rest of the same KV memory;
    the baseline's main KV is vLLM's blocks x page x layers."""
    m, blocks = runs["metrics"], runs["blocks"]
    hot = N_LAYERS * -(-(MAX_SEQS * HOT * ROW_BYTES) // PAGE) * PAGE
    assert m["device_main_kv_bytes"] == hot, m
    assert m["device_indexer_kv_bytes"] == blocks["offload"] * BLOCK * INDEX_ROW_BYTES * N_LAYERS
    assert m["device_kv_bytes"] == m["device_main_kv_bytes"] + m["device_indexer_kv_bytes"]
    assert m["device_kv_bytes"] <= KV_BYTES
    base_main = blocks["baseline"] * BLOCK * ROW_BYTES * N_LAYERS
    base_total = blocks["baseline"] * BLOCK * (ROW_BYTES + INDEX_ROW_BYTES) * N_LAYERS
    assert base_total <= KV_BYTES
    # vLLM's blocks: the baseline's hold main KV + indexer, the offload engine's only the
    # indexer, over the memory left after the hot buffers
    assert blocks["baseline"] == KV_BYTES // (BLOCK * (ROW_BYTES + INDEX_ROW_BYTES) * N_LAYERS)
    assert blocks["offload"] == (KV_BYTES - hot) // (BLOCK * INDEX_ROW_BYTES * N_LAYERS), blocks
    # per request at the longest stated context: hot rows vs the full paged main KV
    ctx = max(LENGTHS) + max(MAX_TOKENS)
    per_req = {"offload": m["device_main_kv_bytes"] / MAX_SEQS,
               "baseline": _reservation_blocks(ctx, 0) * BLOCK * ROW_BYTES * N_LAYERS}
    assert per_req["offload"] / per_req["baseline"] <= HOT / ctx * 1.1
    print(f"\ndevice KV ({KV_BYTES} B each): baseline main {base_main} B in {blocks['baseline']} "
          f"blocks; offload main {m['device_main_kv_bytes']:.0f} B (hot buffers), indexer "
          f"{m['device_indexer_kv_bytes']:.0f} B in {blocks['offload']} blocks; main-KV ratio "
          f"{m['device_main_kv_bytes'] / base_main:.4f} of the baseline allocation, "
          f"{per_req['offload'] / per_req['baseline']:.4f} per request at {ctx} tokens")


def test_device_resolver_reads_nothing_back_per_step(runs: dict[str, Any]) -> None:
    """``residency_backend: device``: in every engine step the worker handed no top-k and
    no new row to host code (``device.host_read`` counts them), only its once-per-step
    report; the host resolver's engine read the top-k every layer of every decode step."""
    steps = runs["connector_steps"]
    dev_steps = [d for d in steps["device"] if d.get("steps")]
    host_steps = [d for d in steps["offload"] if d.get("steps")]
    decode_steps = [d for d in dev_steps if d.get("resolved_positions")]
    assert len(decode_steps) >= 40, len(decode_steps)
    for d in dev_steps:
        assert d.get("host_reads_topk", 0) == 0 and d.get("host_reads_new_rows", 0) == 0, d
        assert d.get("host_reads_step", 0) == d["steps"], d
    # the same requests went through the device engine's hot buffers: hits and misses
    resolved = sum(d.get("resolved_positions", 0) for d in dev_steps)
    hits = sum(d.get("hit_positions", 0) for d in dev_steps)
    assert resolved >= N_LAYERS * sum(min(TOPK, n) * (k - 1)
                                      for n, k in zip(LENGTHS, MAX_TOKENS, strict=True))
    assert 0 < hits < resolved
    assert sum(d.get("admission_failures", 0) + d.get("unmatched_rows", 0) for d in dev_steps) == 0
    # negative control: the host resolver reads the top-k of every layer of a decode step
    host_decode = [d for d in host_steps if d.get("resolved_positions")]
    assert host_decode and all(d.get("host_reads_topk", 0) >= N_LAYERS for d in host_decode)
    assert all(d.get("host_reads_step", 0) == 0 for d in host_steps)
    assert runs["peak_b"]["device"] == 2, runs["peak_b"]
    print(f"\ndevice resolver: {len(dev_steps)} steps ({len(decode_steps)} with decode rows), "
          f"0 top-k / row reads per step; host resolver: "
          f"{sum(d.get('host_reads_topk', 0) for d in host_steps)} top-k reads in "
          f"{len(host_decode)} decode steps; device hit rate {hits / resolved:.3f}")


# ---------------------------------------------------------------- hybrid residency

# KV memory of the tight hybrid engine: ~100 indexer blocks, so the residents' borrowed
# blocks run out while batch A runs (a long resident request needs ~45 of them)
HYBRID_TIGHT_KV = 2_000_000


class _HybridSteps(_ConnectorSteps):
    """Also vLLM's KV usage of every step (borrowed blocks count as used)."""

    def __init__(self) -> None:
        super().__init__()
        self.usage: list[float] = []

    def add(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        super().add(scheduler_stats, iteration_stats)
        if scheduler_stats is not None:
            self.usage.append(float(scheduler_stats.kv_cache_usage))


@pytest.fixture(scope="module")
def hybrid_runs(model_dir: str, runs: dict[str, Any]) -> dict[str, Any]:
    """Hybrid residency on, after the other engines: with the same KV memory (every request
    stays resident) and with a tight one (residents move to the pool under pressure)."""
    cfg = sparse_decode_config({"topk_buffer_size": HOT, "index_topk": TOPK,
                                "dram_size_per_dp_GB": POOL_GB, "hybrid": True})
    out: dict[str, Any] = {}
    for name, kv in (("roomy", KV_BYTES), ("tight", HYBRID_TIGHT_KV)):
        rec = _HybridSteps()
        args = {**ENGINE_ARGS, "kv_cache_memory_bytes": kv}
        with owned_engine(lambda rec=rec, args=args: stepped_engine(
                rec, model=model_dir, kv_transfer_config=cfg, **args), in_process=True) as eng:
            m = rec.mark()
            toks = _run(eng, PROMPTS_A, MAX_TOKENS_A)
            peak = rec.peak_running(m)
            toks += _run(eng, PROMPTS_B, MAX_TOKENS_B)
            steps = rec.connector
            out[name] = {"tokens": toks, "peak_a": peak, "usage": rec.usage, "steps": steps,
                         "blocks": eng.vllm_config.cache_config.num_gpu_blocks,
                         "sum": {k: sum(d.get(k, 0) for d in steps) for k in (
                             "placed_requests", "moved_requests", "moved_bytes", "resident_rows",
                             "resident_query_tokens", "miss_rows", "offload_rows",
                             "admission_failures", "unmatched_rows")}}
    out["baseline"] = runs["tokens"]["baseline"]
    return out


def test_hybrid_residency_tokens_identical_resident_while_memory_suffices(
        hybrid_runs: dict[str, Any]) -> None:
    """Roomy: every request starts resident and stays so: no resolve, no miss, nothing
    written to the host pool, nothing moved."""
    r = hybrid_runs["roomy"]
    assert r["tokens"] == hybrid_runs["baseline"]
    s = r["sum"]
    assert s["placed_requests"] == len(LENGTHS), s
    assert s["moved_requests"] == 0 and s["miss_rows"] == 0 and s["offload_rows"] == 0, s
    computed = sum(n + k - 1 for n, k in zip(LENGTHS, MAX_TOKENS, strict=True))
    assert s["resident_rows"] == N_LAYERS * computed, s
    assert s["admission_failures"] == 0 and s["unmatched_rows"] == 0, s
    assert r["peak_a"] == MAX_SEQS
    assert r["usage"][-1] == 0.0  # every borrowed block went back
    assert r["steps"][-1].get("resident_requests", 0) <= 1


def test_hybrid_residency_moves_residents_under_pressure_tokens_identical(
        hybrid_runs: dict[str, Any]) -> None:
    """Tight: requests start resident, some move to the host pool when vLLM needs blocks
    (counted, their rows copied once), all finish with the model's tokens."""
    r = hybrid_runs["tight"]
    assert r["tokens"] == hybrid_runs["baseline"]
    assert [len(t) for t in r["tokens"]] == MAX_TOKENS
    s = r["sum"]
    assert s["placed_requests"] >= len(LENGTHS) // 2, s
    assert 0 < s["moved_requests"] < s["placed_requests"], s
    assert s["moved_bytes"] > 0 and s["moved_bytes"] % (N_LAYERS * ROW_BYTES) == 0, s
    # moved requests decode through the hot buffers from the pool they were moved to
    assert s["miss_rows"] > 0 and s["offload_rows"] > 0, s
    assert s["admission_failures"] == 0 and s["unmatched_rows"] == 0, s
    assert r["peak_a"] == MAX_SEQS, r["peak_a"]
    assert r["usage"][-1] == 0.0  # every borrowed block went back
    # the tight engine really ran out of spare blocks (10 % are never borrowed)
    assert max(r["usage"]) > 0.85, max(r["usage"])
    print(f"\nhybrid residency, {r['blocks']} blocks: {s}")
