"""``ascend-offload bench sparse-admission``: concurrent long requests admitted at the same
device KV budget, with sparse decode offload vs without.

Three real vLLM CPU engines of the tiny sparse-MLA model with DeepSeek-V3.2's cache
row proportions (main row ``kv_lora_rank`` 512 + rope 64, indexer row
``index_head_dim`` 128: main : indexer = 4.5 : 1; float32 both), one after the
other, with the same engine config and the same ``kv_cache_memory_bytes``: the
baseline (no connector: vLLM's paged main KV + indexer cache on the device) and
``AscendSparseDecodeConnector`` (colocated mode: the device holds the indexer
cache plus one hot buffer of ``--hot`` rows per request slot and main-KV layer;
the main KV lives in the host pool, sized to never be the limit). ``--requests``
prompts of ``--context`` tokens are submitted at once (greedy,
``--decode-tokens`` each); chunked prefill is off, so a request is admitted only
with its whole prompt's blocks. vLLM reports its running and waiting requests
after every step (a stat logger, :mod:`ascend_offload.harness.engines`); the
peak running count is what each engine admitted at once, and the greedy tokens
of the two must be identical.

The third engine is the offload engine with hybrid residency on (``sparse_offload.hybrid``)
at the same memory: a request's main KV starts in blocks borrowed from vLLM's free KV
blocks while they last, and moves to the host pool when vLLM needs them back (a waiting
request does not fit, a running one cannot grow). ``hybrid_admitted_ratio`` is its peak
running count / the baseline's, next to ``admitted_ratio`` of the same run (goal: at least
0.95 of it: borrowing must not cost admission); its greedy tokens must equal the
baseline's too, and its connector counters (requests placed resident, moved, bytes
moved) are reported.

``max_num_seqs`` (both engines) is, by default, the largest request count the
offload engine can hold at that budget: hot buffers are reserved per request
slot, so each extra slot costs ``hot * layers * main_row`` bytes of the budget
before any indexer block. Per request the device then holds
``context * indexer_row + hot * main_row`` bytes per layer instead of
``context * (main_row + indexer_row)``: the admission ratio tends to
``(main + indexer) / (indexer + main * hot / context)`` (4.29x for 4.5 : 1
rows and hot = context / 16), whatever the budget; the bench prints that limit
next to the measured counts (block rounding moves the integers a little).

``decode_device_kv_ratio``: main-KV device bytes with offload (the offload
engine's own allocation, its ``device_main_kv_bytes`` gauge: the hot buffers of
its ``max_num_seqs`` slots) / without (vLLM's paged main KV for the same
number of requests at the stated context: blocks x page x layers, the page
read from the baseline engine's allocation).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from ascend_offload.bench import write_json

BLOCK_SIZE = 32
PAGE = 4096  # the cut page-aligns each hot region
MODEL_DIR = Path(os.environ.get("ASCEND_OFFLOAD_TEST_MODELS", "/tmp/ascend-offload-test-models"))
# DeepSeek-V3.2's cache rows (elements): MLA latent + rope, indexer key
ROWS = dict(kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128)
TARGET_RATIO = 5.0
HYBRID_TARGET_SHARE = 0.95  # hybrid_admitted_ratio >= this x admitted_ratio
ENGINES = ("baseline", "offload", "hybrid")
# the hybrid engine's connector counters (vllm:ascend_offload_sparse_*)
HYBRID_COUNTERS = ("placed_requests", "moved_requests", "moved_bytes", "resident_rows",
                   "resident_query_tokens", "miss_rows", "pool_query_tokens")


def _model(a: argparse.Namespace) -> str:
    from ascend_offload.harness.tiny_sparse_model import make_tiny_sparse_model

    path = MODEL_DIR / f"tiny-sparse-mla-v32rows-{a.layers}l-k{a.index_topk}"
    return str(make_tiny_sparse_model(path, num_hidden_layers=a.layers, index_topk=a.index_topk,
                                      max_position_embeddings=max(4096, 2 * a.context), **ROWS))


# ---------------------------------------------------------------------- sizing


def plan(a: argparse.Namespace) -> dict[str, Any]:
    """Bytes per row/block and the request counts each engine should admit at ``kv_bytes``."""
    main_row = (ROWS["kv_lora_rank"] + ROWS["qk_rope_head_dim"]) * 4
    index_row = ROWS["index_head_dim"] * 4
    req_blocks = -(-(a.context + a.decode_tokens) // BLOCK_SIZE)
    base_block = BLOCK_SIZE * (main_row + index_row) * a.layers
    if a.kv_bytes is None:  # room for --baseline-fit baseline requests
        a.kv_bytes = int(a.baseline_fit * req_blocks * base_block)

    def offload_fits(seqs: int) -> int:
        region = -(-seqs * a.hot * main_row // PAGE) * PAGE
        left = a.kv_bytes - a.layers * region - PAGE  # the indexer backing is page-rounded
        blocks = max(left, 0) // (BLOCK_SIZE * index_row * a.layers)
        return min(seqs, blocks // req_blocks)

    best = max(range(1, 4096), key=lambda s: (offload_fits(s), -s))
    seqs = a.max_num_seqs or best
    base_fit = a.kv_bytes // base_block // req_blocks
    limit = (main_row + index_row) / (index_row + main_row * a.hot / a.context)
    return {"main_row_bytes": main_row, "indexer_row_bytes": index_row,
            "request_blocks": req_blocks, "kv_cache_memory_bytes": a.kv_bytes,
            "max_num_seqs": seqs,
            "expected_running": {"baseline": min(seqs, base_fit), "offload": offload_fits(seqs)},
            "admitted_ratio_limit": limit}


def _engine_args(a: argparse.Namespace, p: dict[str, Any], model: str, kind: str
                 ) -> dict[str, Any]:
    """``kind``: ``baseline`` (no connector), ``offload`` or ``hybrid`` (the same with hybrid
    residency on)."""
    max_len = a.context + a.decode_tokens + BLOCK_SIZE
    args: dict[str, Any] = dict(
        model=model, dtype="float32", block_size=BLOCK_SIZE, enforce_eager=True, seed=0,
        enable_prefix_caching=False, max_model_len=max_len, max_num_seqs=p["max_num_seqs"],
        # whole prompts only: a request admitted holds all its prompt's blocks
        enable_chunked_prefill=False, max_num_batched_tokens=a.prefills_per_step * max_len,
        kv_cache_memory_bytes=p["kv_cache_memory_bytes"])
    if kind != "baseline":
        rows = p["max_num_seqs"] * p["request_blocks"] * BLOCK_SIZE
        pool_gb = rows * a.layers * p["main_row_bytes"] / 2**30 + 1e-6
        args["kv_transfer_config"] = {
            "kv_connector": "AscendSparseDecodeConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"sparse_offload": {
                "enabled": True, "topk_buffer_size": a.hot, "index_topk": a.index_topk,
                "dram_size_per_dp_GB": pool_gb, **({"hybrid": True} if kind == "hybrid" else {})}}}
    return args


def _gauge(name: str) -> float:
    """``vllm:ascend_offload_sparse_<name>`` (a gauge, or a counter's ``_total``) of this
    process's registry, where the engine created last exports."""
    from prometheus_client import REGISTRY

    want = {f"vllm:ascend_offload_sparse_{name}", f"vllm:ascend_offload_sparse_{name}_total"}
    return sum(s.value for fam in REGISTRY.collect() for s in fam.samples if s.name in want)


def _measure(a: argparse.Namespace, p: dict[str, Any], model: str, kind: str,
             prompts: list[list[int]]) -> dict[str, Any]:
    from vllm import SamplingParams

    from ascend_offload.harness.engines import (
        StepRecorder,
        owned_engine,
        run_requests,
        stepped_engine,
    )

    rec = StepRecorder()
    sp = SamplingParams(max_tokens=a.decode_tokens, temperature=0.0, ignore_eos=True)
    args = _engine_args(a, p, model, kind)
    with owned_engine(lambda: stepped_engine(rec, **args)) as eng:
        blocks = int(eng.vllm_config.cache_config.num_gpu_blocks)
        t0 = time.perf_counter()
        toks = run_requests(eng, prompts, [sp] * len(prompts))
        wall = time.perf_counter() - t0
        gauges: dict[str, Any] = ({n: int(_gauge(n)) for n in (
            "device_kv_bytes", "device_main_kv_bytes", "device_indexer_kv_bytes")}
            if kind != "baseline" else {})
        if kind == "hybrid":
            gauges["counters"] = {n: int(_gauge(n)) for n in HYBRID_COUNTERS}
    return {"num_gpu_blocks": blocks, "peak_running": rec.peak_running(),
            "preempted": rec.preempted(), "steps": len(rec.steps), "wall_s": wall,
            "tokens": toks, **gauges}


# ---------------------------------------------------------------------- run


def run(a: argparse.Namespace) -> dict[str, Any]:
    if a.hot is None:
        a.hot = max(BLOCK_SIZE, a.context // 16)
    if a.index_topk is None:
        a.index_topk = a.hot // 2
    if not a.index_topk <= a.hot < a.context:
        raise SystemExit(f"need --index-topk ({a.index_topk}) <= --hot ({a.hot}) < --context "
                         f"({a.context})")
    if a.decode_tokens < 1 or a.layers < 1 or a.prefills_per_step < 1:
        raise SystemExit("--decode-tokens, --layers and --prefills-per-step must be >= 1")
    p = plan(a)
    n = a.requests or max(p["max_num_seqs"] + 2, math.ceil(1.25 * p["max_num_seqs"]))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = a.core
    model = _model(a)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(a.context)] for _ in range(n)]
    t_start = time.time()
    res = {name: _measure(a, p, model, name, prompts) for name in ENGINES}
    base, off, hyb = res["baseline"], res["offload"], res["hybrid"]
    page_main = BLOCK_SIZE * p["main_row_bytes"]
    base_main_alloc = base["num_gpu_blocks"] * page_main * a.layers
    # vLLM's paged main KV for max_num_seqs requests of the stated context
    base_main_ctx = p["max_num_seqs"] * p["request_blocks"] * page_main * a.layers
    admitted = off["peak_running"] / max(base["peak_running"], 1)
    hybrid_admitted = hyb["peak_running"] / max(base["peak_running"], 1)
    return {
        "bench": "sparse-admission",
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(t_start)),
        "config": {"context": a.context, "hot": a.hot, "index_topk": a.index_topk,
                   "decode_tokens": a.decode_tokens, "layers": a.layers, "requests": n,
                   "core": a.core, **{k: p[k] for k in (
                       "kv_cache_memory_bytes", "max_num_seqs", "main_row_bytes",
                       "indexer_row_bytes", "request_blocks")}},
        "peak_running": {k: res[k]["peak_running"] for k in ENGINES},
        # the hybrid engine admits by the same blocks as the offload engine
        "expected_running": {**p["expected_running"],
                             "hybrid": p["expected_running"]["offload"]},
        "preempted": {k: res[k]["preempted"] for k in ENGINES},
        "num_gpu_blocks": {k: res[k]["num_gpu_blocks"] for k in ENGINES},
        "admitted_ratio": admitted,
        "admitted_ratio_limit": p["admitted_ratio_limit"],
        "target_admitted_ratio": TARGET_RATIO,
        "target_met": admitted >= TARGET_RATIO,
        "parity": base["tokens"] == off["tokens"],
        # hybrid residency at the same memory: resident requests borrow vLLM's free blocks
        # and give them back (moving to the host pool) when vLLM needs them
        "hybrid_admitted_ratio": hybrid_admitted,
        "hybrid_admitted_share": hybrid_admitted / admitted if admitted else 0.0,
        "hybrid_target_share": HYBRID_TARGET_SHARE,
        "hybrid_target_met": hybrid_admitted >= HYBRID_TARGET_SHARE * admitted,
        "hybrid_parity": base["tokens"] == hyb["tokens"],
        "hybrid_counters": hyb["counters"],
        "decode_device_kv_ratio": off["device_main_kv_bytes"] / base_main_ctx,
        "main_kv_device_bytes": {
            "offload": off["device_main_kv_bytes"],
            "offload_indexer": off["device_indexer_kv_bytes"],
            "offload_total": off["device_kv_bytes"],
            "baseline_for_context": base_main_ctx,
            "baseline_allocated": base_main_alloc},
        "wall_s": {k: round(res[k]["wall_s"], 2) for k in ENGINES},
        "loadavg_1m": os.getloadavg()[0],
    }


def report(res: dict[str, Any]) -> str:
    c = res["config"]
    pk, ex = res["peak_running"], res["expected_running"]
    kv = res["main_kv_device_bytes"]
    hc = res["hybrid_counters"]
    verdict = "met" if res["target_met"] else "NOT met"
    return "\n".join([
        f"sparse-admission: {c['requests']} requests x {c['context']}-token prompts, "
        f"{c['decode_tokens']} tokens each, hot buffer {c['hot']} rows, index_topk "
        f"{c['index_topk']}, {c['layers']} layers, rows main {c['main_row_bytes']} B / indexer "
        f"{c['indexer_row_bytes']} B, KV memory {c['kv_cache_memory_bytes'] / 2**20:.1f} MiB "
        f"each, max_num_seqs {c['max_num_seqs']}",
        f"  peak running requests: baseline {pk['baseline']} (expected {ex['baseline']}, "
        f"{res['num_gpu_blocks']['baseline']} blocks), offload {pk['offload']} (expected "
        f"{ex['offload']}, {res['num_gpu_blocks']['offload']} indexer blocks), hybrid "
        f"{pk['hybrid']} ({res['num_gpu_blocks']['hybrid']} indexer blocks); preempted "
        f"{res['preempted']['baseline']} / {res['preempted']['offload']} / "
        f"{res['preempted']['hybrid']}",
        f"  admitted_ratio {res['admitted_ratio']:.2f}x (limit for these rows and hot/context: "
        f"{res['admitted_ratio_limit']:.2f}x); target >= {res['target_admitted_ratio']:.1f}x: "
        f"{verdict}; greedy tokens identical: {res['parity']}",
        f"  hybrid_admitted_ratio {res['hybrid_admitted_ratio']:.2f}x = "
        f"{res['hybrid_admitted_share']:.3f} x admitted_ratio {res['admitted_ratio']:.2f}x "
        f"(target >= {res['hybrid_target_share']:.2f} x: "
        f"{'met' if res['hybrid_target_met'] else 'NOT met'}); placed "
        f"{hc['placed_requests']}, moved {hc['moved_requests']} ({hc['moved_bytes']} B), "
        f"resident query tokens {hc['resident_query_tokens']}, miss rows {hc['miss_rows']}; "
        f"greedy tokens identical: {res['hybrid_parity']}",
        f"  decode_device_kv_ratio {res['decode_device_kv_ratio']:.4f}: main KV on the device "
        f"{kv['offload']} B (hot buffers, read from the engine) vs {kv['baseline_for_context']} B "
        f"(paged, {c['max_num_seqs']} requests x {c['request_blocks']} blocks); the baseline "
        f"allocated {kv['baseline_allocated']} B of main KV, the offload engine "
        f"{kv['offload_indexer']} B of indexer",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ascend-offload bench sparse-admission",
                                description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=2048, help="prompt tokens per request")
    p.add_argument("--hot", type=int, default=None, help="hot-buffer rows (default context/16)")
    p.add_argument("--index-topk", type=int, default=None, help="default hot/2")
    p.add_argument("--decode-tokens", type=int, default=8, help="generated tokens per request")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--kv-bytes", type=int, default=None,
                   help="kv_cache_memory_bytes of both engines (default: --baseline-fit requests)")
    p.add_argument("--baseline-fit", type=float, default=6.0,
                   help="default KV memory in baseline requests of the context")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="both engines (default: what the offload engine can hold)")
    p.add_argument("--requests", type=int, default=None,
                   help="submitted at once (default: 1.25 x max_num_seqs, at least +2)")
    p.add_argument("--prefills-per-step", type=int, default=8,
                   help="max_num_batched_tokens in whole prompts")
    p.add_argument("--core", default="0", help="VLLM_CPU_OMP_THREADS_BIND of the engines' workers")
    p.add_argument("--json", help="write the result as JSON here")
    a = p.parse_args(argv)
    res = run(a)
    print(report(res))
    if a.json:
        write_json(a.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
