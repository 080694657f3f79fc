"""Tensor parallelism in real vLLM CPU engines (gloo, ``mp`` executor), our sparse-MLA model.

The model replicates its weights on every TP rank (see ``models/sparse_mla.py``),
so a TP=2 engine must answer exactly like a TP=1 one.

* Decode TP=2 with sparse decode offload (``AscendSparseDecodeConnector``): the two
  ranks share one host pool through ``/dev/shm``. Rank 0 creates it and writes every
  new main-KV row; rank 1 attaches and reads only after rank 0's per-layer publish
  fence. Greedy tokens equal a plain TP=1 engine's; the pool received every computed
  row exactly once (a second writer would double the count); rank 0 removed the pool's
  file once both ranks had mapped it.
* Prefill TP=2 (RD2H producer) -> decode TP=1 (RD2H consumer with sparse offload)
  through our proxy: prefill member 0 sends the replicated main KV into decode's host
  pool, the two members send disjoint halves of each request's indexer blocks into
  decode's device cache. Tokens equal the prefill engine's own plain answer, and no
  load failed (parity after a silent recompute would prove nothing). The same requests
  again through a second proxy with early dispatch: the prefill computes before the
  decode registered and each of its two ranks claims the registration itself (two
  claims per request at the proxy), with the same tokens.

Two cores: a TP=2 engine binds one OpenMP thread per rank (``VLLM_CPU_OMP_THREADS_BIND="0|1"``).
"""

from __future__ import annotations

import random
import uuid
from pathlib import Path
from typing import Any

import pytest

from ascend_offload.harness.tiny_sparse_model import make_tiny_sparse_model
from tests.e2e.harness import MODEL_CACHE, make_engine

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

N_LAYERS = 4
TOPK = 32
HOT = 64
BLOCK = 32
ROW_BYTES = (64 + 16) * 4  # latent + rope, float32
LENGTHS = (300, 512, 20, 420, 64, 600)
MAX_TOKENS = (12, 8, 10, 6, 9, 12)
MAX_SEQS = 4
POOL_ROWS = 3264
POOL_GB = POOL_ROWS * N_LAYERS * ROW_BYTES / 2**30 + 1e-9
ENGINE_ARGS: dict[str, Any] = dict(max_num_batched_tokens=128, max_model_len=1024, max_num_seqs=MAX_SEQS,
                                   block_size=BLOCK, disable_log_stats=False)
TP2: dict[str, Any] = dict(tensor_parallel_size=2, distributed_executor_backend="mp")


def _prompts() -> list[list[int]]:
    rng = random.Random(31)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in LENGTHS]


PROMPTS = _prompts()


def _sparse(**over: Any) -> dict[str, Any]:
    return {"enabled": True, "topk_buffer_size": HOT, "index_topk": TOPK, "dram_size_per_dp_GB": POOL_GB, **over}


def _generate(llm: Any) -> list[list[int]]:
    from vllm import SamplingParams

    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _metric(name: str) -> float:
    from prometheus_client import REGISTRY

    want = {f"vllm:ascend_offload_sparse_{name}", f"vllm:ascend_offload_sparse_{name}_total"}
    return sum(s.value for fam in REGISTRY.collect() for s in fam.samples if s.name in want)


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(make_tiny_sparse_model(MODEL_CACHE / "tiny-sparse-mla-4l", index_topk=TOPK))


@pytest.fixture(scope="module")
def baseline(model_dir: str) -> list[list[int]]:
    with make_engine(model=model_dir, core=0, **ENGINE_ARGS) as llm:
        return _generate(llm)


def test_decode_tp2_shares_one_host_pool_tokens_equal_tp1(model_dir: str, baseline: list[list[int]],
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capfd: pytest.CaptureFixture[str]) -> None:
    # The pool's name follows from the engine id, so the test looks at exactly its file
    # (another test worker's pools are none of its business).
    engine_id = f"tp-e2e-{uuid.uuid4().hex[:12]}"
    pool = f"sd_{engine_id}_dp0"
    cfg = {"kv_connector": "AscendSparseDecodeConnector", "kv_role": "kv_both", "engine_id": engine_id,
           "kv_connector_extra_config": {"sparse_offload": _sparse()}}
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    with make_engine(model=model_dir, kv_transfer_config=cfg, in_process=False, **TP2, **ENGINE_ARGS) as llm:
        out = _generate(llm)
        m = {n: _metric(n) for n in ("offload_rows", "resolved_positions", "miss_rows", "admission_failures")}
        name_left = (Path("/dev/shm") / f"ascend_offload_{pool}").exists()
    logs = capfd.readouterr()
    seen = logs.out + logs.err
    # both ranks mapped the one pool at startup: rank 0 created and writes it, rank 1 reads it
    assert f"pool shared by the TP ranks ({pool}), rank 0 writes" in seen, seen[-3000:]
    assert f"pool shared by the TP ranks ({pool}), rank 1 reads" in seen, seen[-3000:]
    assert [len(t) for t in out] == list(MAX_TOKENS)
    assert out == baseline
    assert len({tuple(t) for t in baseline}) == len(PROMPTS)
    # every computed main-KV row of every layer went into the pool once: rank 0 wrote it
    computed = sum(n + k - 1 for n, k in zip(LENGTHS, MAX_TOKENS, strict=True))
    assert m["offload_rows"] == N_LAYERS * computed, m
    assert m["resolved_positions"] > 0 and m["miss_rows"] > 0 and m["admission_failures"] == 0, m
    assert not name_left, f"the shared pool's name {pool} outlived the first step"


def test_prefill_tp2_feeds_decode_tp1(model_dir: str, baseline: list[list[int]],
                                      tmp_path_factory: pytest.TempPathFactory) -> None:
    pytest.importorskip("mooncake.engine")
    pytest.importorskip("httpx")
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from tests.e2e.pd_cluster import (
        body,
        complete,
        log_lines,
        log_sizes,
        metric,
        pd_cluster,
        rd2h_config,
    )

    extra = {"ack_timeout_s": 60, "request_timeout_s": 60, "registration_timeout_s": 30}
    pool_gb = (4096 + 512) * N_LAYERS * ROW_BYTES / 2**30 + 1e-9
    decode_extra = {**extra, "prefill_tp_size": 2, "sparse_offload": _sparse(dram_size_per_dp_GB=pool_gb)}
    bad = ("Recovered from KV load failure", "blocks failed to load", "decode did not read", "cannot send",
           "cannot receive", "Traceback", "admission failed")
    with pd_cluster(model_dir, tmp_path_factory.mktemp("pd-tp-e2e"),
                    lambda port: rd2h_config("kv_producer", port, extra),
                    lambda port: rd2h_config("kv_consumer", port, decode_extra),
                    prefill_args=("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"),
                    prefill_env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
                    decode_args=("--no-enable-prefix-caching", "--max-num-seqs", str(MAX_SEQS)),
                    early_proxy=True) as c:
        model = c["model"]
        since = log_sizes(c)
        reqs = [body(model, p, False, k, return_token_ids=True) for p, k in zip(PROMPTS, MAX_TOKENS, strict=True)]
        plain = [complete(c["prefill"], r) for r in reqs]
        with ThreadPoolExecutor(3) as pool:
            pd = list(pool.map(lambda r: complete(c["proxy"], r), reqs))
            early = list(pool.map(lambda r: complete(c["proxy_early"], r), reqs))
        problems = [line for b in bad for line in log_lines(c, since, b)]
        pulled = log_lines(c, {k: 0 for k in since}, "into a host pool of")
        claims = metric(httpx.get(f"{c['proxy_early']}/metrics", timeout=10).text,
                        'ascend_offload_proxy_metaserver_claims_total{result="ok"}')
    assert [list(a.token_ids or ()) for a in plain] == baseline  # TP=2 prefill answers like TP=1
    assert [a.token_ids for a in pd] == [a.token_ids for a in plain]
    assert [a.token_ids for a in early] == [a.token_ids for a in plain]
    assert claims == 2 * len(reqs)  # each prefill rank claimed each registration itself
    assert problems == []
    assert pulled, "decode did not pull into its host pool"
