"""Engines and rounds of ``ascend-offload bench sparse-e2e`` (:mod:`.sparse_e2e`).

The tiny sparse-MLA model's vLLM CPU engines (without a connector, with a connector that
moves nothing, with sparse decode offload or with hybrid residency), one engine's part of
a round (a prefill-only pass, then the timed decode of the same prompts, with the worker
probes read around both) and the hybrid engine's paired rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ascend_offload.harness.engines import (
    explicit_kv_memory,
    ngram_speculative_config,
    owned_engine,
)
from ascend_offload.harness.freeze import EngineFreezer

BLOCK_SIZE = 32
NULL = "null"  # the reference engine's backend: vLLM's connector plumbing alone
MODEL_DIR = Path(os.environ.get("ASCEND_OFFLOAD_TEST_MODELS", "/tmp/ascend-offload-test-models"))
HYBRID_TARGET_RATIO = 1.02
HYBRID_FREE_FRACTION = 0.1  # sparse_offload.hybrid_free_fraction's default (not set here)
PAGE = 4096  # the cut page-aligns each hot region
# the hybrid engine's counters reported per batch size: totals over its rounds (prefill
# passes included) and the resident rows / query tokens of the decode steps only
_HYBRID_TOTALS = ("miss_rows", "resolved_positions", "pool_query_tokens", "offload_rows",
                  "moved_requests", "moved_bytes", "placed_requests")
_HYBRID_DECODE = ("resident_rows", "resident_query_tokens")
# the engines of the hybrid engine's paired rounds
HYBRID_ROUND = ("baseline", "hybrid", "connector", "baseline2")
COUNTED = ("resolve", "miss_copy", "offload")  # connector counters (prefill pass subtracted)


# ---------------------------------------------------------------------- engines


def tiny_model(index_topk: int, spec: bool = False, layers: int = 4) -> str:
    """The bench's random sparse-MLA model; ``layers``: its depth (DeepSeek-V3.2: 61), what
    sets how much per-layer work a step's fixed per-step costs are measured against."""
    from ascend_offload.harness.tiny_sparse_model import (
        NGRAM_INITIALIZER_RANGE,
        make_tiny_sparse_model,
    )

    depth = {} if layers == 4 else {"num_hidden_layers": layers}
    if spec:
        return str(make_tiny_sparse_model(
            MODEL_DIR / f"tiny-sparse-mla-{layers}l-k{index_topk}-ngram", index_topk=index_topk,
            initializer_range=NGRAM_INITIALIZER_RANGE, **depth))
    return str(make_tiny_sparse_model(MODEL_DIR / f"tiny-sparse-mla-{layers}l-k{index_topk}",
                                      index_topk=index_topk, **depth))


def request_blocks(a: argparse.Namespace) -> int:
    return -(-(a.context + a.decode_tokens) // BLOCK_SIZE)


def model_rows(model: str) -> tuple[int, int, int]:
    """Main-KV and indexer row bytes (float32) and layers of the model."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    return ((cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4, cfg["index_head_dim"] * 4,
            cfg["num_hidden_layers"])


def max_model_len(a: argparse.Namespace) -> int:
    return a.context + a.decode_tokens + BLOCK_SIZE


def pool_gb(a: argparse.Namespace, row_bytes: int, layers: int) -> float:
    """The host pool: every request of the batch at ``max_model_len`` (the connector
    refuses a pool that cannot hold one such request)."""
    tokens = max(request_blocks(a), -(-max_model_len(a) // BLOCK_SIZE)) * BLOCK_SIZE
    return a.batch * tokens * layers * row_bytes / 2**30 + 1e-6


def kv_bytes(a: argparse.Namespace, model: str) -> int:
    """Both engines' KV memory: ``--kv-bytes``, or twice what the baseline's batch needs."""
    if a.kv_bytes:
        return int(a.kv_bytes)
    main, index, layers = model_rows(model)
    return 2 * a.batch * request_blocks(a) * BLOCK_SIZE * (main + index) * layers


def hybrid_kv_bytes(a: argparse.Namespace, model: str) -> int:
    """The hybrid engine's KV memory: the others' when every request of the batch fits
    resident there (its main-KV rows in borrowed indexer blocks, ``page // row - 1`` rows
    a block at least, besides its own indexer blocks, with the ``hybrid_free_fraction``
    never borrowed and a quarter to spare), else that much."""
    main, index, layers = model_rows(model)
    page = BLOCK_SIZE * index
    min_rows = page // main - 1
    if min_rows < 1:
        raise SystemExit(f"an indexer page of {page} B cannot hold two main-KV rows of {main} B")
    tokens = a.context + a.decode_tokens + a.spec_tokens
    per_request = -(-tokens // min_rows) + request_blocks(a) + 1
    blocks = math.ceil(1.25 * a.batch * per_request / (1 - HYBRID_FREE_FRACTION)) + 1
    hot_regions = layers * -(-a.batch * a.hot * main // PAGE) * PAGE
    return max(kv_bytes(a, model), blocks * page * layers + hot_regions + PAGE)


@contextlib.contextmanager
def engine(a: argparse.Namespace, model: str, backend: str | None, hybrid: bool = False
            ) -> Iterator[Any]:
    """``backend``: None (no connector), ``NULL`` (a connector that moves nothing) or
    the offload engine's ``residency_backend``; ``hybrid``: hybrid residency on (at
    :func:`hybrid_kv_bytes`)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = a.core
    row_bytes, _, layers = model_rows(model)
    kw: dict[str, Any] = {"kv_cache_memory_bytes": (hybrid_kv_bytes if hybrid else kv_bytes)(
        a, model)}
    explicit_kv_memory(kw)
    if a.spec_tokens:
        kw["speculative_config"] = ngram_speculative_config(a.spec_tokens)
    if backend == NULL:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="NullConnector", kv_role="kv_both",
            kv_connector_module_path="ascend_offload.bench.null_connector")
    elif backend is not None:
        sparse = {"enabled": True, "topk_buffer_size": a.hot, "index_topk": a.index_topk,
                  "dram_size_per_dp_GB": pool_gb(a, row_bytes, layers),
                  "residency_backend": backend}
        if backend == "device":
            sparse["use_native"] = a.device_use_native
        if hybrid:
            sparse["hybrid"] = True
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="AscendSparseDecodeConnector", kv_role="kv_both",
            kv_connector_extra_config={"sparse_offload": sparse})
    with owned_engine(lambda: LLM(
            model=model, dtype="float32", block_size=BLOCK_SIZE, enforce_eager=True, seed=0,
            enable_prefix_caching=False, disable_log_stats=False, max_num_seqs=a.batch,
            max_model_len=max_model_len(a),
            max_num_batched_tokens=a.batch * a.context,
            worker_extension_cls="ascend_offload.bench.sparse_probe.WorkerProbe", **kw)) as llm:
        yield llm


def round_prompts(a: argparse.Namespace, round_no: int) -> list[list[int]]:
    """Fresh random prompts per round (same for both engines of a round)."""
    rng = random.Random(1000 + round_no)
    return [[rng.randrange(3, 512) for _ in range(a.context)] for _ in range(a.batch)]


def decode_round(llm: Any, prompts: list[list[int]], decode_tokens: int) -> tuple[float, list[list[int]]]:
    """One batch; returns the median per-request decode step time (ms) and the tokens."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    steps = []
    for o in outs:
        m, n = o.metrics, len(o.outputs[0].token_ids)
        if m is None or n < 2 or not m.last_token_ts > m.first_token_ts:
            raise RuntimeError(f"request {o.request_id}: no per-token timestamps "
                               f"(metrics={m!r}, {n} tokens); log stats must be on")
        steps.append((m.last_token_ts - m.first_token_ts) / (n - 1) * 1e3)
    return statistics.median(steps), [list(o.outputs[0].token_ids) for o in outs]


def prefill_pass(llm: Any, prompts: list[list[int]]) -> None:
    from vllm import SamplingParams

    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), use_tqdm=False)


def probe(llm: Any) -> dict[str, Any]:
    return llm.collective_rpc("bench_probe_read")[0]


def phases(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """Nanoseconds spent per phase between two probes of one worker."""
    t0, t1 = before["timers_ns"], after["timers_ns"]
    c0, c1 = before["counters"], after["counters"]
    out = {"indexer": sum(t1.get(k, 0) - t0.get(k, 0) for k in ("indexer_scores", "select_topk")),
           "attention": t1.get("sparse_attention", 0) - t0.get("sparse_attention", 0)}
    out["layer"] = t1.get("layer", 0) - t0.get("layer", 0)  # whole layers, decode-only steps
    for phase, key in (("resolve", "resolve_ns"), ("miss_copy", "copy_ns"), ("offload", "offload_ns")):
        if key in c1:
            out[phase] = c1[key] - c0.get(key, 0)
    return out


def counter_delta(before: dict[str, Any], after: dict[str, Any], counter: str) -> int:
    return int(after["counters"].get(counter, 0) - before["counters"].get(counter, 0))


def spec_counts(llm: Any) -> dict[str, int]:
    """vLLM's draft and acceptance totals of this process's Prometheus registry (the
    engine created last exports there)."""
    return {m.name.removeprefix("vllm:spec_decode_"): int(m.value) for m in llm.get_metrics()
            if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                          "vllm:spec_decode_num_accepted_tokens")}


def spread(xs: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs),
            "rounds": [round(x, 4) for x in xs]}



def measure(llm: Any, prompts: list[list[int]], decode_tokens: int, phase_acc: dict[str, float]
             ) -> tuple[float, list[list[int]], tuple[dict[str, Any], ...]]:
    """One engine's part of a round: the prefill-only pass, then the round; adds the decode
    steps' phases to ``phase_acc`` (the prefill pass's counters subtracted, so only the
    decode steps' offload/resolve/copy remain). Returns the step time (ms), the tokens and
    the three probes (before the prefill pass, between, after the round)."""
    b0 = probe(llm)
    prefill_pass(llm, prompts)
    b1 = probe(llm)
    step, toks = decode_round(llm, prompts, decode_tokens)
    b2 = probe(llm)
    pre, full = phases(b0, b1), phases(b1, b2)
    for k, v in full.items():
        phase_acc[k] = phase_acc.get(k, 0.0) + v - (pre[k] if k in COUNTED else 0.0)
    return step, toks, (b0, b1, b2)


def breakdown(phase_ns: dict[str, float], steps: list[float], n_steps: int) -> dict[str, float]:
    bd = {k: v / n_steps / 1e6 for k, v in phase_ns.items()}
    # the rest of the attention layer: cache writes, slot mapping and, offloading,
    # the plan / pool-position building / top-k remap around the counted phases
    bd["layer_rest"] = bd.pop("layer") - sum(bd.get(k, 0.0) for k in (*COUNTED, "indexer",
                                                                      "attention"))
    bd["step"] = statistics.median(steps)
    bd["other"] = bd["step"] - sum(v for k, v in bd.items() if k != "step")
    return bd



class HybridBatch:
    """The paired rounds of one batch size: baseline, hybrid and null-connector step
    times, tokens equal, the hybrid engine's counters and the engines' breakdowns."""

    def __init__(self) -> None:
        self.steps: dict[str, list[float]] = {n: [] for n in HYBRID_ROUND}
        self.phase_ns: dict[str, dict[str, float]] = {n: {} for n in HYBRID_ROUND}
        self.counters: dict[str, int] = dict.fromkeys(_HYBRID_TOTALS + _HYBRID_DECODE, 0)
        self.parity = True
        self.passes = 1  # measurements of each engine per round (2: palindromic rounds)

    def add_hybrid(self, probes: tuple[dict[str, Any], ...]) -> None:
        b0, b1, b2 = probes
        for k in _HYBRID_TOTALS:
            self.counters[k] += counter_delta(b0, b2, k)
        for k in _HYBRID_DECODE:  # the round's decode steps: its prefill = the prefill pass
            self.counters[k] += counter_delta(b1, b2, k) - counter_delta(b0, b1, k)

    def result(self, a: argparse.Namespace, batch: int, layers: int) -> dict[str, Any]:
        def paired(num: str, den: str) -> list[float]:
            return [x / y for x, y in zip(self.steps[num], self.steps[den], strict=True)]

        ratios = paired("hybrid", "baseline")
        vllm_share, ours = paired("connector", "baseline"), paired("hybrid", "connector")
        aa = paired("baseline2", "baseline")
        n_steps = len(ratios) * self.passes * (a.decode_tokens - 1)
        med = {n: statistics.median(s) for n, s in self.steps.items()}
        ratio = statistics.median(ratios)
        out: dict[str, Any] = {
            "batch": batch, "rounds": len(ratios), "passes_per_round": self.passes,
            "step_ms": {n: spread(s) for n, s in self.steps.items()},
            "step_ratio": ratio, "step_ratio_rounds": spread(ratios),
            "step_ratio_of_medians": med["hybrid"] / med["baseline"],
            # vLLM with a connector that moves nothing vs without (vLLM's own per-step
            # connector work), and the hybrid engine vs that engine (ours alone)
            "connector_step_ratio": statistics.median(vllm_share),
            "connector_step_ratio_rounds": spread(vllm_share),
            "vs_connector_step_ratio": statistics.median(ours),
            "vs_connector_step_ratio_rounds": spread(ours),
            # two identical baseline engines in the same rounds: what the measurement
            # itself gives between engines that differ in nothing (the A/A control)
            "aa_step_ratio": statistics.median(aa),
            "aa_step_ratio_rounds": spread(aa),
            "parity": self.parity, "counters": dict(self.counters),
            "breakdown_ms_per_step": {n: breakdown(self.phase_ns[n], self.steps[n], n_steps)
                                      for n in self.steps},
            "target_met": ratio <= HYBRID_TARGET_RATIO and self.counters["miss_rows"] == 0,
        }
        if not a.spec_tokens:  # one query token (and one new row) per request and decode step
            out["expected_decode_resident_query_tokens"] = layers * batch * n_steps
        return out



def palindromic_rounds(hb: HybridBatch, llms: dict[str, Any], freezer: EngineFreezer | None,
                       a: argparse.Namespace, batch: int, load: list[float]) -> dict[str, Any]:
    """``a.rounds`` paired rounds of :data:`HYBRID_ROUND`'s engines at ``batch`` into
    ``hb``, each a palindrome: the engines in order (each first in every fourth round),
    then in reverse order, an engine's figure the mean of its two passes. Why: this
    machine's speed drifts over seconds; a drift linear over the round cancels in every
    pair, and a short step (batch 1) makes that matter more than the second pass costs.
    Appends the load average to ``load`` per round; returns the hybrid engine's last probe."""
    hb.passes = 2
    last: dict[str, Any] = {}
    for r in range(a.rounds):
        k = r % len(HYBRID_ROUND)
        prompts = round_prompts(a, 1000 * batch + r)[:batch]
        engines = HYBRID_ROUND[k:] + HYBRID_ROUND[:k]
        toks: dict[str, list[list[int]]] = {}
        passes: dict[str, list[float]] = {n: [] for n in engines}
        for name in engines + engines[::-1]:
            if freezer is not None:
                freezer.run(name)
            step, got, pr = measure(llms[name], prompts, a.decode_tokens, hb.phase_ns[name])
            hb.parity = hb.parity and toks.setdefault(name, got) == got
            passes[name].append(step)
            if name == "hybrid":
                hb.add_hybrid(pr)
                last = pr[2]
        for name in engines:
            hb.steps[name].append(statistics.fmean(passes[name]))
        hb.parity = hb.parity and all(toks[n] == toks["baseline"] for n in HYBRID_ROUND)
        load.append(os.getloadavg()[0])
        if a.verbose:
            print(f"batch {batch} round {r}: " + ", ".join(
                f"{n} {hb.steps[n][-1]:.3f} ms" for n in HYBRID_ROUND), file=sys.stderr, flush=True)
    return last
