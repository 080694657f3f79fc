"""Speculative decoding (vLLM's n-gram proposer) and decode-side prefix caching with
sparse decode offload, each alone and together: real vLLM CPU engines (colocated
``AscendSparseDecodeConnector``), float32.

Our 4-layer sparse-MLA model (index_topk 32) with small weights (initializer range
0.02: its greedy text repeats itself often enough that n-gram drafts are sometimes
accepted, sometimes rejected). Six engines, the same prompts, greedy:

* ``plain``: no speculation, no connector (the reference tokens);
* ``prefix``: sparse decode offload with the decode-side prefix cache
  (``prefix_cache_blocks``), no speculation;
* ``spec``: n-gram speculation (3 draft tokens), no connector;
* ``spec_offload``: the same speculation with sparse decode offload, no prefix cache;
* ``spec_hybrid``: the same speculation with hybrid residency (main KV on the device in
  borrowed blocks while they are spare, moved to the pool under pressure) and the prefix
  cache (a finished resident request's kept blocks get its device rows in the pool; a
  request starting from cached blocks decodes from the pool);
* ``offload``: the same speculation with sparse decode offload and the prefix cache,
  hot buffers of 4 x 32 = 128 rows (a verification row of 1 + 3 query tokens resolves
  the union of its top-k sets at once), so little KV memory that vLLM preempts decoding
  requests.

32 prompts in 8 shared-prefix groups (a group's prompts start with the same 5-11
blocks, cut to leave each prompt a tail of its own), 16 of them 512-700 tokens (>= 4x
the hot buffer), at most 4 running: a group's later prompts start from the blocks its
finished ones left in the cache. What must hold: tokens identical on all six; cached
blocks served (external prefix hits, rows shared in the pool, indexer rows loaded) with
no load failure; acceptance strictly between 0 and 1 and the
same with and without offload; every verification row attended over the hot buffers
(``verify_rows`` = vLLM's draft count; the pool served only prompt tokens); at least
one preemption, resumed from the stash without recomputation; rolled-back drafts were
rewritten but not counted as recomputed. The draft and acceptance counts can be compared
exactly because the schedules are fixed by the inputs: every request is added before the
first long prompt's chunks have used up the first steps' token budget, and the offload
engines preempted at the same points in every run (2 preemptions each). Accepted tokens
are equal with and without offload; the drafts proposed may differ by one step's
drafts per preemption (a preemption moves the request's later steps): 398 / 399 against
the speculating engine's 398 here. (In P/D, where requests arrive as their
pulls land, the counts differ from run to run: tests/e2e/test_sparse_preemption_pd_e2e.py.)

The speculating engines run in their own processes: vLLM's n-gram proposer loads numba
(llvmlite), after which vLLM 0.32's CPU kernel-override scan fails in any engine
started later in the same process (``'_lib_fn_wrapper' object has no attribute 'get'``).
They run in-process, one after another, in one child Python process
(tests/e2e/child_call.py; the kernel scan steps past llvmlite there): one process start
instead of an engine-core and a worker process per engine, and every engine steps
synchronously, so the schedules depend on the inputs alone.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from ascend_offload.harness.engines import (
    StepRecorder,
    ngram_speculative_config,
    owned_engine,
    run_requests,
    stepped_engine,
)
from tests.e2e.child_call import call_in_child
from tests.e2e.harness import ngram_sparse_model, registry_value, sparse_decode_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

N_LAYERS = 4
TOPK = 32
DRAFTS = 3
HOT = (1 + DRAFTS) * TOPK
BLOCK = 32
ROW_BYTES = (64 + 16) * 4  # latent + rope, float32
MAX_SEQS = 4
SPEC = ngram_speculative_config(DRAFTS)
ENGINE_ARGS: dict[str, Any] = dict(
    dtype="float32", block_size=BLOCK, enforce_eager=True, enable_prefix_caching=False, seed=0,
    max_num_batched_tokens=128, max_model_len=800, max_num_seqs=MAX_SEQS)
# Offload engine: hot buffers (4 layers x 4 requests x 128 rows x 320 B = 640 KiB) plus
# about 50 indexer blocks of 16 KiB: about two of the long requests at full length while
# four run, so decoding requests are preempted. (vLLM checks max_model_len against this
# memory before the cut, at main KV + indexer bytes.)
OFFLOAD_KV_BYTES = 1_500_000
PLAIN_KV_BYTES = 256 * 2**20
# Hybrid residency: about 140 indexer blocks, so short requests stay resident to the end
# while long ones (60+ borrowed blocks each at full length) run out of spare blocks
HYBRID_KV_BYTES = 3_000_000
POOL_BLOCKS = 32 * 26  # every reservation at once: preemption never frees pool rows
POOL_GB = POOL_BLOCKS * BLOCK * N_LAYERS * ROW_BYTES / 2**30 + 1e-9

PREFIX_CACHE_BLOCKS = 256

_rng = random.Random(17)
LENGTHS = [_rng.randrange(512, 701) if i % 2 == 0 else _rng.randrange(40, 300) for i in range(32)]
MAX_TOKENS = [_rng.randrange(12, 33) for _ in LENGTHS]
GROUPS = [[_rng.randrange(3, 512) for _ in range(BLOCK * _rng.randrange(5, 12))] for _ in range(8)]
# prompt i: the start of its group's prefix (at most all but 8 of its tokens), then its own
PROMPTS = [GROUPS[i % 8][:n - 8] + [_rng.randrange(3, 512) for _ in range(n - len(GROUPS[i % 8][:n - 8]))]
           for i, n in enumerate(LENGTHS)]


SPARSE = ("prefix_kept_blocks", "prefix_loaded_blocks", "prefix_load_failures", "verify_rows", "pool_query_tokens", "preempted_requests", "resumed_tokens",
          "recomputed_tokens", "stash_failures", "offload_rows", "resolved_positions",
          "hit_positions", "miss_rows", "admission_failures", "unmatched_rows")

HYBRID = ("placed_requests", "moved_requests", "moved_bytes", "resident_query_tokens")


RESET_STEP = 120  # the prefix engine's cache is reset after this step, requests running


def _reset_once(eng: Any, out: dict[str, Any]) -> Any:
    def after(step: int) -> None:
        if step == RESET_STEP:
            out["reset"] = {"ok": eng.reset_prefix_cache(reset_connector=True),
                            "entries": registry_value("vllm:ascend_offload_sparse_prefix_cache_blocks"),
                            "evicted": registry_value(
                                "vllm:ascend_offload_sparse_prefix_evicted_blocks"),
                            "running": eng.get_num_unfinished_requests()}
        elif step == RESET_STEP + 2:
            out["reset"]["evicted_after"] = registry_value(
                "vllm:ascend_offload_sparse_prefix_evicted_blocks")
    return after


def _engines() -> tuple[tuple[str, dict[str, Any], bool], ...]:
    """(name, engine arguments, in this process) of the six engines, in the order they run."""
    offload = sparse_decode_config({"topk_buffer_size": HOT, "index_topk": TOPK,
                                    "dram_size_per_dp_GB": POOL_GB,
                                    "prefix_cache_blocks": PREFIX_CACHE_BLOCKS})
    return (("plain", {"kv_cache_memory_bytes": PLAIN_KV_BYTES}, True),
            ("prefix", {"kv_cache_memory_bytes": OFFLOAD_KV_BYTES,
                        "kv_transfer_config": offload}, True),
            ("spec", {"kv_cache_memory_bytes": PLAIN_KV_BYTES, "speculative_config": SPEC}, False),
            ("spec_offload", {"kv_cache_memory_bytes": OFFLOAD_KV_BYTES, "speculative_config": SPEC,
                              "kv_transfer_config": sparse_decode_config(
                                  {"topk_buffer_size": HOT, "index_topk": TOPK,
                                   "dram_size_per_dp_GB": POOL_GB})}, False),
            ("offload", {"kv_cache_memory_bytes": OFFLOAD_KV_BYTES, "speculative_config": SPEC,
                         "kv_transfer_config": offload}, False),
            ("spec_hybrid", {"kv_cache_memory_bytes": HYBRID_KV_BYTES,
                             "speculative_config": SPEC,
                             "kv_transfer_config": sparse_decode_config(
                                 {"topk_buffer_size": HOT, "index_topk": TOPK,
                                  "dram_size_per_dp_GB": POOL_GB, "hybrid": True,
                                  "prefix_cache_blocks": PREFIX_CACHE_BLOCKS})}, False))


def _run_engine(name: str, kw: dict[str, Any]) -> dict[str, Any]:
    """Every prompt on one engine of :func:`_engines`, started in this process and stopped
    after: its tokens and the counters of its run (this process's Prometheus registry
    holds the counters of the engine started last)."""
    from vllm import SamplingParams

    model = ngram_sparse_model(TOPK)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    out: dict[str, Any] = {}
    rec = StepRecorder()
    with owned_engine(lambda: stepped_engine(rec, model=model, **ENGINE_ARGS, **kw),
                      in_process=True) as eng:
        d0 = {n: registry_value(f"vllm:spec_decode_{n}") for n in ("num_drafts", "num_draft_tokens",
                                                       "num_accepted_tokens")}
        h0 = {n: registry_value(f"vllm:external_prefix_cache_{n}") for n in ("queries", "hits")}
        out["tokens"] = run_requests(eng, PROMPTS, params, after_step=(
            _reset_once(eng, out) if name == "prefix" else None))
        out["spec"] = {n: registry_value(f"vllm:spec_decode_{n}") - v for n, v in d0.items()}
        out["preempted"] = rec.preempted()
        out["peak"] = rec.peak_running()
        out["hits"] = {n: registry_value(f"vllm:external_prefix_cache_{n}") - v for n, v in h0.items()}
        if name in ("prefix", "spec_offload", "offload", "spec_hybrid"):
            out["metrics"] = {n: registry_value(f"vllm:ascend_offload_sparse_{n}")
                              for n in SPARSE + HYBRID}
    return out


@contextlib.contextmanager
def _kernel_scan_past_llvmlite() -> Iterator[None]:
    """Let one process start engines after an n-gram proposer loaded numba: vLLM's CPU
    kernel-override scan (``vllm.triton_utils.dispatcher._rebind_kernels``, at every
    engine start) reads every module attribute's ``__dict__``, and ``llvmlite.binding.ffi.lib``
    answers that with a foreign function (``'_lib_fn_wrapper' object has no attribute
    'get'``). The module holds no Triton kernel, so the scan skips it unchanged; used only
    in a child process of its own (:func:`_run_speculating`)."""
    from vllm.triton_utils import dispatcher

    scan = dispatcher._rebind_kernels

    def without_llvmlite(overrides: Any) -> None:
        hidden = sys.modules.pop("llvmlite.binding.ffi", None)
        try:
            scan(overrides)
        finally:
            if hidden is not None:
                sys.modules["llvmlite.binding.ffi"] = hidden

    dispatcher._rebind_kernels = without_llvmlite
    try:
        yield
    finally:
        dispatcher._rebind_kernels = scan


def _run_speculating(engines: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """:func:`_run_engine` for each of ``engines`` in turn, in this (child) process."""
    with _kernel_scan_past_llvmlite():
        return [_run_engine(name, kw) for name, kw in engines]


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    out: dict[str, Any] = {"tokens": {}, "preempted": {}, "peak": {}, "spec": {}, "metrics": {},
                           "hits": {}}
    ngram_sparse_model(TOPK)  # generated once, before the child reads it
    engines = _engines()
    # the speculating engines one after another in a child process (see the module
    # docstring), meanwhile the others here: each engine steps on one thread, and neither
    # process's counters or schedules see the other's engines
    speculating = [(name, kw) for name, kw, in_process in engines if not in_process]
    with ThreadPoolExecutor(1) as pool:
        child = pool.submit(call_in_child, _run_speculating, speculating, timeout_s=800)
        got = {name: _run_engine(name, kw) for name, kw, in_process in engines if in_process}
        got.update(zip([name for name, _ in speculating], child.result(), strict=True))
    for name, _, _ in engines:
        for key in ("tokens", "spec", "preempted", "peak", "hits", "metrics"):
            if key in got[name]:
                out[key][name] = got[name][key]
    out["reset"] = got["prefix"]["reset"]
    return out


def test_greedy_tokens_identical_with_speculation_and_offload(runs: dict[str, Any]) -> None:
    toks = runs["tokens"]
    assert len(PROMPTS) >= 30 and sum(n >= 4 * HOT for n in LENGTHS) >= 16
    assert [len(t) for t in toks["offload"]] == MAX_TOKENS
    assert toks["spec"] == toks["plain"]
    assert toks["prefix"] == toks["plain"]
    assert toks["spec_offload"] == toks["plain"]
    assert toks["offload"] == toks["plain"]
    assert toks["spec_hybrid"] == toks["plain"]
    assert len({tuple(t) for t in toks["plain"]}) == len(PROMPTS)


def test_cached_prefix_blocks_served_with_and_without_speculation(runs: dict[str, Any]) -> None:
    """The groups' later prompts started from blocks their finished ones left: vLLM counted
    them as external hits, the workers shared their pool rows and loaded their indexer
    rows (one block per hit block), and none was recomputed."""
    print(f"\nprefix hits {runs['hits']}")
    for name in ("prefix", "offload", "spec_hybrid"):
        m, h = runs["metrics"][name], runs["hits"][name]
        assert m["prefix_load_failures"] == 0 and m["recomputed_tokens"] == 0, (name, m)
        assert m["prefix_kept_blocks"] > 0 and m["prefix_loaded_blocks"] > 0, (name, m)
        assert h["hits"] == BLOCK * m["prefix_loaded_blocks"] > 0, (name, h, m)
        # the pool served the prompt tokens that were computed: fewer than every prompt token
        assert m["pool_query_tokens"] <= N_LAYERS * (sum(LENGTHS) - h["hits"]), (name, m, h)
    assert runs["hits"]["plain"]["hits"] == runs["hits"]["spec"]["hits"] == 0
    assert runs["hits"]["spec_offload"]["hits"] == 0


def test_reset_with_requests_in_flight_drops_the_entries(runs: dict[str, Any]) -> None:
    """``reset_prefix_cache(reset_connector=True)`` mid-run: the connector's cache drops its
    entries (those of running requests once they finish) and the run still ends with the
    reference tokens (the greedy test above)."""
    r = runs["reset"]
    print(f"\nreset {r}")
    assert r["running"] > 0 and r["entries"] > 0, r
    assert r["evicted_after"] - r["evicted"] > 0, r


def test_acceptance_between_0_and_1_and_equal_with_and_without_offload(
        runs: dict[str, Any]) -> None:
    spec = runs["spec"]
    print(f"\nspeculation {spec}, preemptions {runs['preempted']}, peak {runs['peak']}")
    s = spec["spec"]
    assert 0 < s["num_accepted_tokens"] < s["num_draft_tokens"], s  # accepted and rejected
    # the same tokens accepted with and without offload. The proposals can differ by a
    # step's drafts per preemption (a preemption moves a request's later steps, and with
    # them where its drafts are proposed); only the offload engines preempt
    for name in ("spec_offload", "offload"):
        o, pre = spec[name], runs["preempted"][name]
        assert o["num_accepted_tokens"] == s["num_accepted_tokens"], (name, o, s)
        assert abs(o["num_drafts"] - s["num_drafts"]) <= pre, (name, o, s, pre)
        assert abs(o["num_draft_tokens"] - s["num_draft_tokens"]) <= pre * DRAFTS, (name, o, s)
    assert spec["plain"]["num_drafts"] == 0


@pytest.mark.parametrize("name", ["spec_offload", "offload"])
def test_every_verification_row_went_through_the_hot_buffers(runs: dict[str, Any], name: str) -> None:
    m, s = runs["metrics"][name], runs["spec"][name]
    print(f"\nsparse metrics {m}")
    assert m["admission_failures"] == 0 and m["unmatched_rows"] == 0, m
    # one verification row per request-step with drafts, each resolved in the hot buffers
    assert m["verify_rows"] == s["num_drafts"] > 0, (m, s)
    # the pool itself served prompt tokens only (prefill chunks): not one output token
    assert 0 < m["pool_query_tokens"] <= N_LAYERS * sum(LENGTHS), m
    assert m["hit_positions"] > 0 and m["miss_rows"] > 0, m


@pytest.mark.parametrize("name", ["spec_offload", "offload"])
def test_preempted_requests_resumed_without_recomputation(runs: dict[str, Any], name: str) -> None:
    m, pre = runs["metrics"][name], runs["preempted"]
    assert pre[name] > 0 and pre["plain"] == pre["spec"] == 0, pre
    assert runs["peak"][name] >= 2, runs["peak"]
    assert m["preempted_requests"] == pre[name], (m, pre)
    assert m["stash_failures"] == 0 and m["resumed_tokens"] > 0, m
    # rejected drafts' positions were written again by later steps: not a recomputation
    assert m["recomputed_tokens"] == 0, m
    # every layer wrote each computed position once, plus the rewrites of rejected drafts
    # (cached prefix blocks are shared, not written)
    computed = sum(n + k - 1 for n, k in zip(LENGTHS, MAX_TOKENS, strict=True))
    computed -= runs["hits"][name]["hits"]
    assert m["offload_rows"] >= N_LAYERS * computed, m


def test_hybrid_residency_with_speculation(runs: dict[str, Any]) -> None:
    """Speculation with hybrid residency: requests start resident (their verification rows
    attend over their device rows, rejected drafts rewritten in place), some move to the
    pool under pressure and verify through the hot buffers from then on; the same tokens
    accepted as without offload (greedy tokens: above)."""
    m, s, ref = runs["metrics"]["spec_hybrid"], runs["spec"]["spec_hybrid"], runs["spec"]["spec"]
    print(f"\nhybrid + speculation: {m}, {s}, preemptions {runs['preempted']['spec_hybrid']}")
    assert m["placed_requests"] > 0 and 0 < m["moved_requests"] <= m["placed_requests"], m
    assert m["moved_bytes"] > 0 and m["resident_query_tokens"] > 0, m
    assert m["admission_failures"] == 0 and m["unmatched_rows"] == 0, m
    assert m["recomputed_tokens"] == 0 and m["stash_failures"] == 0, m
    assert s["num_accepted_tokens"] == ref["num_accepted_tokens"] > 0, (s, ref)
    # the moved requests' verification rows went through the hot buffers, the residents'
    # over their device rows
    assert 0 < m["verify_rows"] < s["num_drafts"], (m, s)
    assert m["moved_requests"] < m["placed_requests"], m
