"""``ascend-offload bench sparse-e2e``: decode step time with sparse decode offload vs without.

Six real vLLM CPU engines of the tiny sparse-MLA model (float32, eager, same
engine config, same process, all alive for the whole run): the baseline has no
connector, the other two run ``AscendSparseDecodeConnector`` (colocated mode: the
engine prefills, then one-token rows attend over per-layer hot buffers filled
from the host pool), ``offload`` with the host resolver (``residency_backend:
host``, the native table) and ``device`` with the device resolver
(``residency_backend: device``). Each round sends the same ``--batch`` prompts of
``--context`` tokens (``index_topk`` < context, context >= 4x the hot buffer)
at once with greedy ``max_tokens=--decode-tokens``; ``max_num_batched_tokens``
fits every prompt in one prefill step, so every later step is a pure decode
step of the whole batch. Rounds alternate the engines' order (forward, then
backward) so slow drift of the shared machine hits all alike. The fourth engine,
``hybrid``, is ``offload`` with hybrid residency on (``sparse_offload.hybrid``) and KV
memory enough for every request of the batch to stay resident (:func:`_hybrid_kv_bytes`):
its main-KV rows live in device blocks borrowed from vLLM's free blocks and attention
reads them directly (no resolve, no miss copy). The fifth, ``connector``, is the
baseline with a KV connector that moves nothing (``bench/null_connector.py``): vLLM's
own per-step work for any connector, which no connector can skip. The sixth,
``baseline2``, is a second baseline: the A/A control, two engines that differ in
nothing measured in the same rounds (what a ratio of 1 looks like on this machine).

Step time: per request ``(last_token_ts - first_token_ts) / (n - 1)`` from
vLLM's own per-request engine-core timestamps (``RequestOutput.metrics``); a
round's figure is the median over its requests. ``step_ratio`` is the median
over rounds of the round's offload / baseline step time (the two run back to
back, so each ratio sees the same minute of a shared machine); the ratio of the
two medians and every round are reported too. ``device_step_ratio`` is the same
for the device resolver's engine against the same baseline rounds.

Breakdown (ms per decode step, both engines): ``resolve``, ``miss_copy`` and
``offload`` (new rows into the host pool) are the connector's own counters
(``resolve_ns``/``copy_ns``/``offload_ns``, read from the worker), minus a
prefill-only pass of the same prompts run just before each round (so the
prefill's offload is not counted). ``indexer`` (indexer scores + top-k
selection) and ``attention`` (gather + MQA over the selected rows) are wall
times of the model's ``indexer_scores``/``select_topk``/``sparse_attention``
calls with one query (decode rows), wrapped in the worker by the worker
extension :class:`~ascend_offload.bench.sparse_probe.WorkerProbe` in both engines alike (about a hundred wrapped
calls per step). ``layer_rest`` is the rest of the model's attention-layer
call (``SparseMLACache.run``, timed whole in decode-only steps): cache writes,
slot mapping and, offloading, the plan / pool-position building / top-k remap
around the counted phases. ``other`` is the rest of the step: projections
(the indexer's included), MLP, sampling, scheduling, vLLM's bookkeeping.

``--spec-tokens k`` (k > 0): every engine speculates with vLLM's n-gram proposer
(k draft tokens, prompt lookup 1-3), on the same model with small weights
(initializer range 0.02: its greedy text repeats itself often enough that drafts are
sometimes accepted); the hot buffer defaults to ``(k + 2) x index_topk`` rows (the
``2 x index_topk`` of plain decoding plus a top-k per draft; whole blocks). A round's step time is
then per generated token. ``spec_step_ratio`` is ``step_ratio`` of that run (offload vs
no offload, both speculating), ``spec_device_step_ratio`` the device resolver's, and
``spec_pool_fallback_rows`` the query tokens of the decode steps both offload engines
attended over the host pool instead of the hot buffers (the connector's
``pool_query_tokens`` counter, prefill pass subtracted): 0 when every verification row
was served from the hot buffers. ``spec`` holds the verification rows and the last
engine's (the device resolver's) vLLM draft and acceptance counts. The breakdown's
model timers then cover rows of up to ``1 + k`` query tokens.

``hybrid_step_ratio``: per batch size of ``--hybrid-batches`` (default 1 and
``--batch``), the median over its paired rounds of the hybrid engine's step time / the
baseline's. At ``--batch`` the rounds of all engines serve; every other size runs
``--rounds`` rounds of its own, the baseline, the hybrid, the null-connector engine and
the second baseline only (each first in every fourth round, fresh prompts), each round a
palindrome: the four engines in order, then in reverse order, an engine's figure the
mean of its two passes (this machine's speed drifts over seconds, and a drift linear
over the round then cancels in every pair; a batch-1 step is short enough that this
matters more than the second pass costs). ``hybrid_connector_step_ratio``
(null connector / baseline) and ``hybrid_vs_connector_step_ratio`` (hybrid / null
connector) split the same rounds' ratio into vLLM's share and ours;
``hybrid_aa_step_ratio`` (second baseline / baseline) is the A/A control of the same rounds. Per batch size the JSON (``hybrid``) also has the hybrid engine's
miss rows, resolved positions and pool query tokens (all 0 while every request is
resident), moved and placed requests, the resident rows written and query tokens
attended by the decode steps (prefill pass subtracted: ``layers x batch x (decode_tokens
- 1)`` per round without speculation), parity with the baseline and both engines'
breakdowns.

``decode_device_kv_ratio``: main-KV bytes on the device with / without offload
for the stated batch and context. With: the offload engine's own allocation
for its main-KV layers (the hot buffers of its ``--batch`` request slots, read
from the worker: ``device_main_kv_bytes``). Without: vLLM's paged main KV for
``--batch`` requests of ``context + decode_tokens`` tokens (blocks x page x
layers). Both engines get the same ``kv_cache_memory_bytes`` (``--kv-bytes``,
by default twice what the baseline's batch needs); the baseline's whole
main-KV allocation at that budget is reported too.
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
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ascend_offload.bench import write_json
from ascend_offload.harness.engines import (
    explicit_kv_memory,
    ngram_speculative_config,
    owned_engine,
)
from ascend_offload.harness.freeze import EngineFreezer

BLOCK_SIZE = 32
NULL = "null"  # the reference engine's backend: vLLM's connector plumbing alone
MODEL_DIR = Path(os.environ.get("ASCEND_OFFLOAD_TEST_MODELS", "/tmp/ascend-offload-test-models"))
TARGET_RATIO = 1.10
DEVICE_TARGET_RATIO = 1.15
HYBRID_TARGET_RATIO = 1.02
HYBRID_FREE_FRACTION = 0.1  # sparse_offload.hybrid_free_fraction's default (not set here)
PAGE = 4096  # the cut page-aligns each hot region
ENGINES = ("baseline", "offload", "device", "hybrid", "connector", "baseline2")
# started in this order: the device engine last, whose vLLM registry --spec-tokens reads
START_ORDER = ("baseline", "baseline2", "connector", "offload", "hybrid", "device")
# "connector": vLLM with a connector that moves nothing (bench/null_connector.py)
# "baseline2": a second baseline engine, the A/A control (identical engines, same rounds)
BACKENDS = {"baseline": None, "offload": "host", "device": "device", "hybrid": "host",
            "connector": NULL, "baseline2": None}
# the hybrid engine's counters reported per batch size: totals over its rounds (prefill
# passes included) and the resident rows / query tokens of the decode steps only
_HYBRID_TOTALS = ("miss_rows", "resolved_positions", "pool_query_tokens", "offload_rows",
                  "moved_requests", "moved_bytes", "placed_requests")
_HYBRID_DECODE = ("resident_rows", "resident_query_tokens")
# the engines of the hybrid engine's paired rounds
_HYBRID_ROUND = ("baseline", "hybrid", "connector", "baseline2")
_COUNTED = ("resolve", "miss_copy", "offload")  # connector counters (prefill pass subtracted)


# ---------------------------------------------------------------------- engines


def _model(index_topk: int, spec: bool = False) -> str:
    from ascend_offload.harness.tiny_sparse_model import (
        NGRAM_INITIALIZER_RANGE,
        make_tiny_sparse_model,
    )

    if spec:
        return str(make_tiny_sparse_model(MODEL_DIR / f"tiny-sparse-mla-4l-k{index_topk}-ngram",
                                          index_topk=index_topk,
                                          initializer_range=NGRAM_INITIALIZER_RANGE))
    return str(make_tiny_sparse_model(MODEL_DIR / f"tiny-sparse-mla-4l-k{index_topk}",
                                      index_topk=index_topk))


def _request_blocks(a: argparse.Namespace) -> int:
    return -(-(a.context + a.decode_tokens) // BLOCK_SIZE)


def _rows(model: str) -> tuple[int, int, int]:
    """Main-KV and indexer row bytes (float32) and layers of the model."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    return ((cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4, cfg["index_head_dim"] * 4,
            cfg["num_hidden_layers"])


def _max_model_len(a: argparse.Namespace) -> int:
    return a.context + a.decode_tokens + BLOCK_SIZE


def _pool_gb(a: argparse.Namespace, row_bytes: int, layers: int) -> float:
    """The host pool: every request of the batch at ``max_model_len`` (the connector
    refuses a pool that cannot hold one such request)."""
    tokens = max(_request_blocks(a), -(-_max_model_len(a) // BLOCK_SIZE)) * BLOCK_SIZE
    return a.batch * tokens * layers * row_bytes / 2**30 + 1e-6


def _kv_bytes(a: argparse.Namespace, model: str) -> int:
    """Both engines' KV memory: ``--kv-bytes``, or twice what the baseline's batch needs."""
    if a.kv_bytes:
        return int(a.kv_bytes)
    main, index, layers = _rows(model)
    return 2 * a.batch * _request_blocks(a) * BLOCK_SIZE * (main + index) * layers


def _hybrid_kv_bytes(a: argparse.Namespace, model: str) -> int:
    """The hybrid engine's KV memory: the others' when every request of the batch fits
    resident there (its main-KV rows in borrowed indexer blocks, ``page // row - 1`` rows
    a block at least, besides its own indexer blocks, with the ``hybrid_free_fraction``
    never borrowed and a quarter to spare), else that much."""
    main, index, layers = _rows(model)
    page = BLOCK_SIZE * index
    min_rows = page // main - 1
    if min_rows < 1:
        raise SystemExit(f"an indexer page of {page} B cannot hold two main-KV rows of {main} B")
    tokens = a.context + a.decode_tokens + a.spec_tokens
    per_request = -(-tokens // min_rows) + _request_blocks(a) + 1
    blocks = math.ceil(1.25 * a.batch * per_request / (1 - HYBRID_FREE_FRACTION)) + 1
    hot_regions = layers * -(-a.batch * a.hot * main // PAGE) * PAGE
    return max(_kv_bytes(a, model), blocks * page * layers + hot_regions + PAGE)


@contextlib.contextmanager
def _engine(a: argparse.Namespace, model: str, backend: str | None, hybrid: bool = False
            ) -> Iterator[Any]:
    """``backend``: None (no connector), ``NULL`` (a connector that moves nothing) or
    the offload engine's ``residency_backend``; ``hybrid``: hybrid residency on (at
    :func:`_hybrid_kv_bytes`)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = a.core
    row_bytes, _, layers = _rows(model)
    kw: dict[str, Any] = {"kv_cache_memory_bytes": (_hybrid_kv_bytes if hybrid else _kv_bytes)(
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
                  "dram_size_per_dp_GB": _pool_gb(a, row_bytes, layers),
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
            max_model_len=_max_model_len(a),
            max_num_batched_tokens=a.batch * a.context,
            worker_extension_cls="ascend_offload.bench.sparse_probe.WorkerProbe", **kw)) as llm:
        yield llm


def _prompts(a: argparse.Namespace, round_no: int) -> list[list[int]]:
    """Fresh random prompts per round (same for both engines of a round)."""
    rng = random.Random(1000 + round_no)
    return [[rng.randrange(3, 512) for _ in range(a.context)] for _ in range(a.batch)]


def _round(llm: Any, prompts: list[list[int]], decode_tokens: int) -> tuple[float, list[list[int]]]:
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


def _round_prefill(llm: Any, prompts: list[list[int]]) -> None:
    from vllm import SamplingParams

    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), use_tqdm=False)


def _probe(llm: Any) -> dict[str, Any]:
    return llm.collective_rpc("bench_probe_read")[0]


def _phases(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
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


def _delta(before: dict[str, Any], after: dict[str, Any], counter: str) -> int:
    return int(after["counters"].get(counter, 0) - before["counters"].get(counter, 0))


def _spec_counts(llm: Any) -> dict[str, int]:
    """vLLM's draft and acceptance totals of this process's Prometheus registry (the
    engine created last exports there)."""
    return {m.name.removeprefix("vllm:spec_decode_"): int(m.value) for m in llm.get_metrics()
            if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                          "vllm:spec_decode_num_accepted_tokens")}


def _spread(xs: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs),
            "rounds": [round(x, 4) for x in xs]}


# ---------------------------------------------------------------------- run


def _hybrid_batches(a: argparse.Namespace) -> list[int]:
    """``--hybrid-batches`` (default: 1 and ``--batch``), each within ``--batch``."""
    spec = a.hybrid_batches if a.hybrid_batches is not None else f"1,{a.batch}"
    try:
        batches = sorted({int(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        raise SystemExit(f"--hybrid-batches {spec!r}: comma-separated batch sizes") from None
    if not batches or not all(1 <= b <= a.batch for b in batches):
        raise SystemExit(f"--hybrid-batches {spec!r}: each between 1 and --batch {a.batch}")
    return batches


def _measure(llm: Any, prompts: list[list[int]], decode_tokens: int, phase_acc: dict[str, float]
             ) -> tuple[float, list[list[int]], tuple[dict[str, Any], ...]]:
    """One engine's part of a round: the prefill-only pass, then the round; adds the decode
    steps' phases to ``phase_acc`` (the prefill pass's counters subtracted, so only the
    decode steps' offload/resolve/copy remain). Returns the step time (ms), the tokens and
    the three probes (before the prefill pass, between, after the round)."""
    b0 = _probe(llm)
    _round_prefill(llm, prompts)
    b1 = _probe(llm)
    step, toks = _round(llm, prompts, decode_tokens)
    b2 = _probe(llm)
    pre, full = _phases(b0, b1), _phases(b1, b2)
    for k, v in full.items():
        phase_acc[k] = phase_acc.get(k, 0.0) + v - (pre[k] if k in _COUNTED else 0.0)
    return step, toks, (b0, b1, b2)


def _breakdown(phase_ns: dict[str, float], steps: list[float], n_steps: int) -> dict[str, float]:
    bd = {k: v / n_steps / 1e6 for k, v in phase_ns.items()}
    # the rest of the attention layer: cache writes, slot mapping and, offloading,
    # the plan / pool-position building / top-k remap around the counted phases
    bd["layer_rest"] = bd.pop("layer") - sum(bd.get(k, 0.0) for k in (*_COUNTED, "indexer",
                                                                      "attention"))
    bd["step"] = statistics.median(steps)
    bd["other"] = bd["step"] - sum(v for k, v in bd.items() if k != "step")
    return bd


class _HybridBatch:
    """The paired rounds of one batch size: baseline, hybrid and null-connector step
    times, tokens equal, the hybrid engine's counters and the engines' breakdowns."""

    def __init__(self) -> None:
        self.steps: dict[str, list[float]] = {n: [] for n in _HYBRID_ROUND}
        self.phase_ns: dict[str, dict[str, float]] = {n: {} for n in _HYBRID_ROUND}
        self.counters: dict[str, int] = dict.fromkeys(_HYBRID_TOTALS + _HYBRID_DECODE, 0)
        self.parity = True
        self.passes = 1  # measurements of each engine per round (2: palindromic rounds)

    def add_hybrid(self, probes: tuple[dict[str, Any], ...]) -> None:
        b0, b1, b2 = probes
        for k in _HYBRID_TOTALS:
            self.counters[k] += _delta(b0, b2, k)
        for k in _HYBRID_DECODE:  # the round's decode steps: its prefill = the prefill pass
            self.counters[k] += _delta(b1, b2, k) - _delta(b0, b1, k)

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
            "step_ms": {n: _spread(s) for n, s in self.steps.items()},
            "step_ratio": ratio, "step_ratio_rounds": _spread(ratios),
            "step_ratio_of_medians": med["hybrid"] / med["baseline"],
            # vLLM with a connector that moves nothing vs without (vLLM's own per-step
            # connector work), and the hybrid engine vs that engine (ours alone)
            "connector_step_ratio": statistics.median(vllm_share),
            "connector_step_ratio_rounds": _spread(vllm_share),
            "vs_connector_step_ratio": statistics.median(ours),
            "vs_connector_step_ratio_rounds": _spread(ours),
            # two identical baseline engines in the same rounds: what the measurement
            # itself gives between engines that differ in nothing (the A/A control)
            "aa_step_ratio": statistics.median(aa),
            "aa_step_ratio_rounds": _spread(aa),
            "parity": self.parity, "counters": dict(self.counters),
            "breakdown_ms_per_step": {n: _breakdown(self.phase_ns[n], self.steps[n], n_steps)
                                      for n in self.steps},
            "target_met": ratio <= HYBRID_TARGET_RATIO and self.counters["miss_rows"] == 0,
        }
        if not a.spec_tokens:  # one query token (and one new row) per request and decode step
            out["expected_decode_resident_query_tokens"] = layers * batch * n_steps
        return out


def run(a: argparse.Namespace) -> dict[str, Any]:
    if not a.index_topk < a.context:
        raise SystemExit(f"--index-topk {a.index_topk} must be < --context {a.context}")
    if a.decode_tokens < 2 or a.rounds < 1 or a.batch < 1 or a.spec_tokens < 0:
        raise SystemExit("--decode-tokens >= 2, --rounds >= 1, --batch >= 1 and --spec-tokens >= 0")
    if a.hot is None:  # whole blocks
        a.hot = -(-(a.spec_tokens + 2) * a.index_topk // BLOCK_SIZE) * BLOCK_SIZE
    if a.hot < (1 + a.spec_tokens) * a.index_topk:
        raise SystemExit(f"--hot {a.hot}: a verification row of 1 + {a.spec_tokens} tokens needs "
                         f">= {(1 + a.spec_tokens) * a.index_topk} rows")
    hybrid_batches = _hybrid_batches(a)
    model = _model(a.index_topk, spec=a.spec_tokens > 0)
    t_start = time.time()
    steps: dict[str, list[float]] = {n: [] for n in ENGINES}
    phase_ns: dict[str, dict[str, float]] = {n: {} for n in ENGINES}
    hy = {b: _HybridBatch() for b in hybrid_batches}
    pool_queries = 0  # decode steps' query tokens attended over the pool (both offload engines)
    probes: dict[str, dict[str, Any]] = {}
    parity = True
    load = [os.getloadavg()[0]]
    with contextlib.ExitStack() as stack:
        # baseline first, then the offload engines (vLLM's Prometheus loggers of a later
        # engine replace an earlier one's; this bench reads the workers, not Prometheus)
        freezer = EngineFreezer() if a.freeze else None
        llms = {}
        for n in START_ORDER:
            llms[n] = stack.enter_context(_engine(a, model, BACKENDS[n], hybrid=n == "hybrid"))
            if freezer is not None:
                freezer.started(n)
        if freezer is not None:  # runs first on exit: no engine is shut down frozen
            stack.callback(freezer.resume_all)
        for name in ENGINES:  # warm-up (first-call allocations), not timed
            _round(llms[name], _prompts(a, -1)[: max(1, a.batch // 2)], 4)
            llms[name].collective_rpc("bench_probe_timers", args=(True, 1 + a.spec_tokens))
        main_hy = hy.get(a.batch)  # the batch-size rounds of all engines serve the hybrid's too
        for r in range(a.rounds):
            order = ENGINES if r % 2 == 0 else ENGINES[::-1]  # drift hits all alike
            prompts = _prompts(a, r)
            toks: dict[str, list[list[int]]] = {}
            for name in order:
                if freezer is not None:
                    freezer.run(name)
                step, toks[name], pr = _measure(llms[name], prompts, a.decode_tokens,
                                                phase_ns[name])
                probes[name] = pr[2]
                steps[name].append(step)
                if name in ("offload", "device"):
                    pool_queries += _delta(pr[1], pr[2], "pool_query_tokens") - _delta(
                        pr[0], pr[1], "pool_query_tokens")
                if name == "hybrid" and main_hy is not None:
                    main_hy.add_hybrid(pr)
            same = all(toks[n] == toks["baseline"] for n in ENGINES)
            parity = parity and same
            if main_hy is not None:
                main_hy.parity = main_hy.parity and toks["hybrid"] == toks["baseline"]
                for n in _HYBRID_ROUND:
                    main_hy.steps[n].append(steps[n][-1])
            load.append(os.getloadavg()[0])
            if a.verbose:
                print(f"round {r}: " + ", ".join(f"{n} {steps[n][-1]:.3f} ms" for n in ENGINES),
                      file=sys.stderr, flush=True)
        # the other batch sizes: rounds of the baseline, the hybrid, the null-connector
        # engine and the second baseline only, each engine first in every fourth round
        for b in hybrid_batches:
            if b == a.batch:
                continue
            hb = hy[b]
            hb.passes = 2
            for r in range(a.rounds):
                k = r % len(_HYBRID_ROUND)
                prompts = _prompts(a, 1000 * b + r)[:b]
                engines = _HYBRID_ROUND[k:] + _HYBRID_ROUND[:k]
                toks = {}
                passes: dict[str, list[float]] = {n: [] for n in engines}
                for name in engines + engines[::-1]:  # a palindrome (module doc)
                    if freezer is not None:
                        freezer.run(name)
                    step, got, pr = _measure(llms[name], prompts, a.decode_tokens,
                                             hb.phase_ns[name])
                    hb.parity = hb.parity and toks.setdefault(name, got) == got
                    passes[name].append(step)
                    if name == "hybrid":
                        hb.add_hybrid(pr)
                        probes["hybrid"] = pr[2]
                for name in engines:
                    hb.steps[name].append(statistics.fmean(passes[name]))
                hb.parity = hb.parity and toks["hybrid"] == toks["baseline"] == toks["connector"] == toks["baseline2"]
                load.append(os.getloadavg()[0])
                if a.verbose:
                    print(f"batch {b} round {r}: " + ", ".join(
                        f"{n} {hb.steps[n][-1]:.3f} ms" for n in _HYBRID_ROUND),
                        file=sys.stderr, flush=True)
            parity = parity and hb.parity
        if main_hy is not None:  # its phases: those of the all-engine rounds
            main_hy.phase_ns = {n: phase_ns[n] for n in _HYBRID_ROUND}
        spec_counts = _spec_counts(llms["device"]) if a.spec_tokens else {}
    n_steps = a.rounds * (a.decode_tokens - 1)
    breakdown = {name: _breakdown(phase_ns[name], steps[name], n_steps) for name in ENGINES}
    paired = [o / b for o, b in zip(steps["offload"], steps["baseline"], strict=True)]
    paired_dev = [o / b for o, b in zip(steps["device"], steps["baseline"], strict=True)]
    medians = {n: statistics.median(steps[n]) for n in ENGINES}
    main_row, _, layers = _rows(model)
    kv_base = a.batch * _request_blocks(a) * BLOCK_SIZE * main_row * layers  # stated context
    kv_off = probes["offload"]["device_kv"]["device_main_kv_bytes"]
    ratio = statistics.median(paired)
    dev_ratio = statistics.median(paired_dev)
    hybrid = {str(b): hy[b].result(a, b, layers) for b in hybrid_batches}
    return {
        "bench": "sparse-e2e",
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(t_start)),
        "config": {**{k: getattr(a, k) for k in ("batch", "context", "decode_tokens", "hot",
                                                 "index_topk", "rounds", "core",
                                                 "device_use_native", "spec_tokens",
                                                 "freeze")},
                   "hybrid_batches": hybrid_batches,
                   "kv_cache_memory_bytes": _kv_bytes(a, model),
                   "hybrid_kv_cache_memory_bytes": _hybrid_kv_bytes(a, model)},
        "step_ms": {n: _spread(steps[n]) for n in ENGINES},
        "step_ratio": ratio,
        "step_ratio_rounds": _spread(paired),
        "step_ratio_of_medians": medians["offload"] / medians["baseline"],
        "target_step_ratio": TARGET_RATIO,
        "target_met": ratio <= TARGET_RATIO,
        "device_step_ratio": dev_ratio,
        "device_step_ratio_rounds": _spread(paired_dev),
        "device_step_ratio_of_medians": medians["device"] / medians["baseline"],
        "device_target_step_ratio": DEVICE_TARGET_RATIO,
        "device_target_met": dev_ratio <= DEVICE_TARGET_RATIO,
        # hybrid residency (every request resident): per batch size, the median of its
        # paired rounds' hybrid / baseline step time, and what the engine did
        "hybrid_step_ratio": {k: v["step_ratio"] for k, v in hybrid.items()},
        # the same rounds' null-connector engine: vLLM's own connector work per step, and
        # the hybrid engine against it (what our connector adds)
        "hybrid_connector_step_ratio": {k: v["connector_step_ratio"] for k, v in hybrid.items()},
        "hybrid_vs_connector_step_ratio": {k: v["vs_connector_step_ratio"]
                                           for k, v in hybrid.items()},
        # the same rounds' second baseline engine / the baseline: the A/A control
        "hybrid_aa_step_ratio": {k: v["aa_step_ratio"] for k, v in hybrid.items()},
        "hybrid_target_step_ratio": HYBRID_TARGET_RATIO,
        "hybrid_target_met": {k: v["target_met"] for k, v in hybrid.items()},
        "hybrid_miss_rows": {k: v["counters"]["miss_rows"] for k, v in hybrid.items()},
        "hybrid_moved_requests": {k: v["counters"]["moved_requests"] for k, v in hybrid.items()},
        "hybrid_resident_query_tokens": {k: v["counters"]["resident_query_tokens"]
                                         for k, v in hybrid.items()},
        "hybrid_parity": all(v["parity"] for v in hybrid.values()),
        "hybrid": hybrid,
        "parity": parity,
        "breakdown_ms_per_step": breakdown,
        "decode_device_kv_ratio": kv_off / kv_base,
        "main_kv_device_bytes": {
            "offload": kv_off, "offload_hot_buffers": probes["offload"]["hot_buffer_bytes"],
            "offload_indexer": probes["offload"]["device_kv"]["device_indexer_kv_bytes"],
            "baseline_for_context": kv_base,
            "baseline_allocated": probes["baseline"]["paged_main_kv_bytes"]},
        "offload_counters": probes["offload"]["counters"],
        "device_counters": probes["device"]["counters"],
        "hybrid_counters": probes["hybrid"]["counters"],
        "hybrid_gauges": probes["hybrid"].get("gauges", {}),
        # the device engine's table and kernel ("native": the C++ kernel of a host device;
        # "ops": the tensor ops an accelerator runs)
        "device_residency": probes["device"].get("residency"),
        "loadavg_1m": load,
        **({"spec_step_ratio": ratio, "spec_device_step_ratio": dev_ratio,
            "spec_pool_fallback_rows": pool_queries,
            "spec": {"verify_rows": {n: probes[n]["counters"].get("verify_rows", 0)
                                     for n in ("offload", "device")},
                     "device_engine_vllm": spec_counts}} if a.spec_tokens else {}),
    }


def report(res: dict[str, Any]) -> str:
    c = res["config"]
    lines = [f"sparse-e2e: batch {c['batch']} x {c['context']}-token contexts, {c['decode_tokens']} "
             f"tokens each, hot buffer {c['hot']} rows, index_topk {c['index_topk']}, "
             f"{c['rounds']} alternating rounds (worker core {c['core']})"]
    for n in ENGINES:
        s = res["step_ms"][n]
        lines.append(f"  {n:9s} decode step {s['median']:.3f} ms median "
                     f"(min {s['min']:.3f}, max {s['max']:.3f})")
    verdict = "met" if res["target_met"] else "NOT met"
    sr = res["step_ratio_rounds"]
    lines.append(f"  step_ratio {res['step_ratio']:.3f} (median of per-round ratios, min "
                 f"{sr['min']:.3f}, max {sr['max']:.3f}; ratio of medians "
                 f"{res['step_ratio_of_medians']:.3f}); target <= {res['target_step_ratio']:.2f}: "
                 f"{verdict}; greedy tokens identical: {res['parity']}")
    dr = res["device_step_ratio_rounds"]
    kernel = (res.get("device_residency") or {}).get("kernel")
    lines.append(f"  device_step_ratio {res['device_step_ratio']:.3f} (device resolver, kernel "
                 f"{kernel}; min "
                 f"{dr['min']:.3f}, max {dr['max']:.3f}; ratio of medians "
                 f"{res['device_step_ratio_of_medians']:.3f}); target <= "
                 f"{res['device_target_step_ratio']:.2f}: "
                 f"{'met' if res['device_target_met'] else 'NOT met'}")
    if c.get("spec_tokens"):
        sp = res["spec"]
        lines.append(f"  speculating ({c['spec_tokens']} n-gram drafts): spec_step_ratio "
                     f"{res['spec_step_ratio']:.3f}, spec_device_step_ratio "
                     f"{res['spec_device_step_ratio']:.3f}, spec_pool_fallback_rows "
                     f"{res['spec_pool_fallback_rows']}; verification rows {sp['verify_rows']}; "
                     f"device engine {sp['device_engine_vllm']}")
    for b, h in res["hybrid"].items():
        sm, hr, cn = h["step_ms"], h["step_ratio_rounds"], h["counters"]
        want = h.get("expected_decode_resident_query_tokens")
        lines.append(
            f"  hybrid batch {b}: decode step {sm['hybrid']['median']:.3f} ms vs baseline "
            f"{sm['baseline']['median']:.3f} ms, hybrid_step_ratio {h['step_ratio']:.3f} "
            f"(median of {h['rounds']} paired rounds, min {hr['min']:.3f}, max {hr['max']:.3f}; "
            f"ratio of medians {h['step_ratio_of_medians']:.3f}); null-connector engine "
            f"{sm['connector']['median']:.3f} ms: vLLM's connector work "
            f"{h['connector_step_ratio']:.3f}x the baseline, the hybrid engine "
            f"{h['vs_connector_step_ratio']:.3f}x that engine; A/A (a second baseline engine) "
            f"{h['aa_step_ratio']:.3f}x the baseline; miss rows {cn['miss_rows']}, "
            f"moved requests {cn['moved_requests']}, placed {cn['placed_requests']}, resident "
            f"query tokens {cn['resident_query_tokens']}"
            + (f" (expected {want})" if want is not None else "")
            + f", pool query tokens {cn['pool_query_tokens']}; target <= "
            f"{res['hybrid_target_step_ratio']:.2f} with 0 misses: "
            f"{'met' if h['target_met'] else 'NOT met'}; greedy tokens identical: {h['parity']}")
    keys = ("indexer", "attention", "resolve", "miss_copy", "offload", "layer_rest", "other",
            "step")
    lines.append(f"  {'breakdown ms/step (batch ' + str(c['batch']) + ')':28s}  "
                 + "  ".join(f"{k:>9s}" for k in keys))
    rows = [(n, res["breakdown_ms_per_step"][n]) for n in ENGINES]
    rows += [(f"{n} (batch {b})", h["breakdown_ms_per_step"][n])
             for b, h in res["hybrid"].items() if int(b) != c["batch"]
             for n in _HYBRID_ROUND]
    for n, bd in rows:
        lines.append(f"  {n:28s}  " + "  ".join(
            f"{bd[k]:9.3f}" if k in bd else f"{'-':>9s}" for k in keys))
    kv = res["main_kv_device_bytes"]
    lines.append(f"  decode_device_kv_ratio {res['decode_device_kv_ratio']:.4f}: main KV on the "
                 f"device {kv['offload']} B (hot buffers {kv['offload_hot_buffers']} B, "
                 f"page-aligned) vs {kv['baseline_for_context']} B paged for {c['batch']} x "
                 f"{c['context'] + c['decode_tokens']} tokens (the baseline allocated "
                 f"{kv['baseline_allocated']} B of main KV in {c['kv_cache_memory_bytes']} B)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ascend-offload bench sparse-e2e", description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8, help="concurrent decodes per round")
    p.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    p.add_argument("--decode-tokens", type=int, default=48, help="generated tokens per request")
    p.add_argument("--hot", type=int, default=None,
                   help="hot-buffer rows per request and layer (default: (spec tokens + 2) x "
                        "index_topk, rounded up to whole blocks)")
    p.add_argument("--spec-tokens", type=int, default=0,
                   help="n-gram speculative decoding with this many draft tokens in every "
                        "engine (0: none)")
    p.add_argument("--index-topk", type=int, default=32, help="the model's index_topk")
    p.add_argument("--rounds", type=int, default=24,
                   help="rounds per engine (alternating; a round is ~1 s, so the median of many "
                        "paired rounds is what resists a shared machine's minute-to-minute swings)")
    p.add_argument("--core", default="0", help="VLLM_CPU_OMP_THREADS_BIND of both engines' workers")
    p.add_argument("--kv-bytes", type=int, default=0,
                   help="kv_cache_memory_bytes of both engines (default: twice the batch's need)")
    p.add_argument("--device-use-native", choices=("auto", "off"), default="auto",
                   help="use_native of the device engine: auto (on this CPU the table's C++ "
                        "kernel), off (its tensor ops, what an accelerator runs)")
    p.add_argument("--hybrid-batches", default=None,
                   help="batch sizes of the hybrid engine's paired rounds against the baseline, "
                        "comma-separated, each <= --batch (default: 1 and --batch); --batch "
                        "reuses the rounds of all engines, any other runs --rounds pairs of its own")
    p.add_argument("--no-freeze", dest="freeze", action="store_false",
                   help="leave the engines not being measured running (by default they are "
                        "frozen, so their vLLM processes' post-step busy-wait cannot take "
                        "the measured engine's core)")
    p.add_argument("--json", help="write the result as JSON here")
    p.add_argument("-v", "--verbose", action="store_true", help="print each round")
    a = p.parse_args(argv)
    res = run(a)
    print(report(res))
    if a.json:
        write_json(a.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
