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
memory enough for every request of the batch to stay resident (:func:`er.hybrid_kv_bytes`):
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
import os
import statistics
import sys
import time
from typing import Any

from ascend_offload.bench import sparse_e2e_rounds as er
from ascend_offload.bench import write_json
from ascend_offload.harness.freeze import EngineFreezer

TARGET_RATIO = 1.10
DEVICE_TARGET_RATIO = 1.15
ENGINES = ("baseline", "offload", "device", "hybrid", "connector", "baseline2")
# started in this order: the device engine last, whose vLLM registry --spec-tokens reads
START_ORDER = ("baseline", "baseline2", "connector", "offload", "hybrid", "device")
# "connector": vLLM with a connector that moves nothing (bench/null_connector.py)
# "baseline2": a second baseline engine, the A/A control (identical engines, same rounds)
BACKENDS = {"baseline": None, "offload": "host", "device": "device", "hybrid": "host",
            "connector": er.NULL, "baseline2": None}


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


def _hybrid_keys(hybrid: dict[str, dict[str, Any]], probes: dict[str, dict[str, Any]]
                 ) -> dict[str, Any]:
    """The JSON's hybrid residency keys (every request resident): per batch size, the
    median of its paired rounds' hybrid / baseline step time, and what the engine did."""
    return {
        "hybrid_step_ratio": {k: v["step_ratio"] for k, v in hybrid.items()},
        # the same rounds' null-connector engine: vLLM's own connector work per step, and
        # the hybrid engine against it (what our connector adds)
        "hybrid_connector_step_ratio": {k: v["connector_step_ratio"] for k, v in hybrid.items()},
        "hybrid_vs_connector_step_ratio": {k: v["vs_connector_step_ratio"]
                                           for k, v in hybrid.items()},
        # the same rounds' second baseline engine / the baseline: the A/A control
        "hybrid_aa_step_ratio": {k: v["aa_step_ratio"] for k, v in hybrid.items()},
        "hybrid_target_step_ratio": er.HYBRID_TARGET_RATIO,
        "hybrid_target_met": {k: v["target_met"] for k, v in hybrid.items()},
        "hybrid_miss_rows": {k: v["counters"]["miss_rows"] for k, v in hybrid.items()},
        "hybrid_moved_requests": {k: v["counters"]["moved_requests"] for k, v in hybrid.items()},
        "hybrid_resident_query_tokens": {k: v["counters"]["resident_query_tokens"]
                                         for k, v in hybrid.items()},
        "hybrid_parity": all(v["parity"] for v in hybrid.values()),
        "hybrid": hybrid,
        "hybrid_counters": probes["hybrid"]["counters"],
        "hybrid_gauges": probes["hybrid"].get("gauges", {}),
    }


def run(a: argparse.Namespace) -> dict[str, Any]:
    if not a.index_topk < a.context:
        raise SystemExit(f"--index-topk {a.index_topk} must be < --context {a.context}")
    if a.decode_tokens < 2 or a.rounds < 1 or a.batch < 1 or a.spec_tokens < 0 or a.layers < 1:
        raise SystemExit("--decode-tokens >= 2, --rounds >= 1, --batch >= 1, --spec-tokens >= 0 "
                         "and --layers >= 1")
    if a.hot is None:  # whole blocks
        a.hot = -(-(a.spec_tokens + 2) * a.index_topk // er.BLOCK_SIZE) * er.BLOCK_SIZE
    if a.hot < (1 + a.spec_tokens) * a.index_topk:
        raise SystemExit(f"--hot {a.hot}: a verification row of 1 + {a.spec_tokens} tokens needs "
                         f">= {(1 + a.spec_tokens) * a.index_topk} rows")
    hybrid_batches = _hybrid_batches(a)
    model = er.tiny_model(a.index_topk, spec=a.spec_tokens > 0, layers=a.layers)
    engines = er.HYBRID_ROUND if a.hybrid_only else ENGINES
    t_start = time.time()
    steps: dict[str, list[float]] = {n: [] for n in ENGINES}
    phase_ns: dict[str, dict[str, float]] = {n: {} for n in ENGINES}
    hy = {b: er.HybridBatch() for b in hybrid_batches}
    pool_queries = 0  # decode steps' query tokens attended over the pool (both offload engines)
    probes: dict[str, dict[str, Any]] = {}
    parity = True
    load = [os.getloadavg()[0]]
    with contextlib.ExitStack() as stack:
        # baseline first, then the offload engines (vLLM's Prometheus loggers of a later
        # engine replace an earlier one's; this bench reads the workers, not Prometheus)
        freezer = EngineFreezer() if a.freeze else None
        llms = {}
        for n in (n for n in START_ORDER if n in engines):
            llms[n] = stack.enter_context(er.engine(a, model, BACKENDS[n], hybrid=n == "hybrid"))
            if freezer is not None:
                freezer.started(n)
        if freezer is not None:  # runs first on exit: no engine is shut down frozen
            stack.callback(freezer.resume_all)
        for name in engines:  # warm-up (first-call allocations), not timed
            er.decode_round(llms[name], er.round_prompts(a, -1)[: max(1, a.batch // 2)], 4)
            llms[name].collective_rpc("bench_probe_timers", args=(True, 1 + a.spec_tokens))
        # the batch-size rounds of all engines serve the hybrid's too
        main_hy = None if a.hybrid_only else hy.get(a.batch)
        for r in range(0 if a.hybrid_only else a.rounds):
            order = ENGINES if r % 2 == 0 else ENGINES[::-1]  # drift hits all alike
            prompts = er.round_prompts(a, r)
            toks: dict[str, list[list[int]]] = {}
            for name in order:
                if freezer is not None:
                    freezer.run(name)
                step, toks[name], pr = er.measure(llms[name], prompts, a.decode_tokens,
                                                phase_ns[name])
                probes[name] = pr[2]
                steps[name].append(step)
                if name in ("offload", "device"):
                    pool_queries += er.counter_delta(pr[1], pr[2], "pool_query_tokens") - er.counter_delta(
                        pr[0], pr[1], "pool_query_tokens")
                if name == "hybrid" and main_hy is not None:
                    main_hy.add_hybrid(pr)
            same = all(toks[n] == toks["baseline"] for n in ENGINES)
            parity = parity and same
            if main_hy is not None:
                main_hy.parity = main_hy.parity and toks["hybrid"] == toks["baseline"]
                for n in er.HYBRID_ROUND:
                    main_hy.steps[n].append(steps[n][-1])
            load.append(os.getloadavg()[0])
            if a.verbose:
                print(f"round {r}: " + ", ".join(f"{n} {steps[n][-1]:.3f} ms" for n in ENGINES),
                      file=sys.stderr, flush=True)
        # the other batch sizes (every one with --hybrid-only): palindromic rounds of the
        # baseline, the hybrid, the null-connector engine and the second baseline only
        for b in hybrid_batches:
            if b == a.batch and main_hy is not None:
                continue
            probes["hybrid"] = er.palindromic_rounds(hy[b], llms, freezer, a, b, load)
            parity = parity and hy[b].parity
        if main_hy is not None:  # its phases: those of the all-engine rounds
            main_hy.phase_ns = {n: phase_ns[n] for n in er.HYBRID_ROUND}
        spec_counts = er.spec_counts(llms["device"]) if a.spec_tokens and not a.hybrid_only else {}
    main_row, _, layers = er.model_rows(model)
    hybrid = {str(b): hy[b].result(a, b, layers) for b in hybrid_batches}
    config = {**{k: getattr(a, k) for k in ("batch", "context", "decode_tokens", "hot",
                                            "index_topk", "rounds", "core", "device_use_native",
                                            "spec_tokens", "freeze", "hybrid_only", "layers")},
              "hybrid_batches": hybrid_batches,
              "kv_cache_memory_bytes": er.kv_bytes(a, model),
              "hybrid_kv_cache_memory_bytes": er.hybrid_kv_bytes(a, model)}
    if a.hybrid_only:
        return {"bench": "sparse-e2e",
                "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(t_start)),
                "config": config, **_hybrid_keys(hybrid, probes), "loadavg_1m": load}
    n_steps = a.rounds * (a.decode_tokens - 1)
    breakdown = {name: er.breakdown(phase_ns[name], steps[name], n_steps) for name in ENGINES}
    paired = [o / b for o, b in zip(steps["offload"], steps["baseline"], strict=True)]
    paired_dev = [o / b for o, b in zip(steps["device"], steps["baseline"], strict=True)]
    medians = {n: statistics.median(steps[n]) for n in ENGINES}
    kv_base = a.batch * er.request_blocks(a) * er.BLOCK_SIZE * main_row * layers  # stated context
    kv_off = probes["offload"]["device_kv"]["device_main_kv_bytes"]
    ratio = statistics.median(paired)
    dev_ratio = statistics.median(paired_dev)
    return {
        "bench": "sparse-e2e",
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(t_start)),
        "config": config,
        "step_ms": {n: er.spread(steps[n]) for n in ENGINES},
        "step_ratio": ratio,
        "step_ratio_rounds": er.spread(paired),
        "step_ratio_of_medians": medians["offload"] / medians["baseline"],
        "target_step_ratio": TARGET_RATIO,
        "target_met": ratio <= TARGET_RATIO,
        "device_step_ratio": dev_ratio,
        "device_step_ratio_rounds": er.spread(paired_dev),
        "device_step_ratio_of_medians": medians["device"] / medians["baseline"],
        "device_target_step_ratio": DEVICE_TARGET_RATIO,
        "device_target_met": dev_ratio <= DEVICE_TARGET_RATIO,
        **_hybrid_keys(hybrid, probes),
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


def _hybrid_report(res: dict[str, Any]) -> list[str]:
    lines = []
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
    return lines


_BREAKDOWN_KEYS = ("indexer", "attention", "resolve", "miss_copy", "offload", "layer_rest",
                   "other", "step")


def _breakdown_lines(title: str, rows: list[tuple[str, dict[str, float]]]) -> list[str]:
    keys = _BREAKDOWN_KEYS
    return [f"  {title:28s}  " + "  ".join(f"{k:>9s}" for k in keys)] + [
        f"  {n:28s}  " + "  ".join(f"{bd[k]:9.3f}" if k in bd else f"{'-':>9s}" for k in keys)
        for n, bd in rows]


def report(res: dict[str, Any]) -> str:
    c = res["config"]
    head = (f"sparse-e2e: batch {c['batch']} x {c['context']}-token contexts, "
            f"{c['decode_tokens']} tokens each, hot buffer {c['hot']} rows, index_topk "
            f"{c['index_topk']}, {c['rounds']} alternating rounds (worker core {c['core']})")
    hybrid_rows = [(f"{n} (batch {b})", h["breakdown_ms_per_step"][n])
                   for b, h in res["hybrid"].items()
                   if c.get("hybrid_only") or int(b) != c["batch"] for n in er.HYBRID_ROUND]
    if c.get("hybrid_only"):
        return "\n".join([head + "; hybrid residency engines only", *_hybrid_report(res),
                          *_breakdown_lines("breakdown ms/step", hybrid_rows)])
    lines = [head]
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
    lines += _hybrid_report(res)
    lines += _breakdown_lines(f"breakdown ms/step (batch {c['batch']})",
                              [(n, res["breakdown_ms_per_step"][n]) for n in ENGINES]
                              + hybrid_rows)
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
    p.add_argument("--layers", type=int, default=4,
                   help="the model's sparse-MLA layers (DeepSeek-V3.2 has 61): per-step costs "
                        "weigh less against a deeper model's step")
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
    p.add_argument("--hybrid-only", action="store_true",
                   help="start only the engines of the hybrid engine's paired rounds and run "
                        "--rounds palindromic rounds at every --hybrid-batches size (the JSON "
                        "then has the hybrid keys only)")
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
