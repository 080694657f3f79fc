"""``ascend-offload bench sparse-multiturn``: multi-turn chat on a P/D pair whose decode runs
sparse offload, with and without its decode-side prefix cache, in one run.

Real vLLM CPU servers on our tiny sparse-MLA model: a prefill (``SfaRemoteD2HConnector``
producer), a decode (the consumer with ``sparse_offload`` and ``prefix_cache_blocks``)
behind our proxy, and a plain server (no connector) for parity. Conversations of
several turns: turn ``t + 1``'s prompt is turn ``t``'s prompt, its answer and a follow-up.
Every turn after the first is sent twice, one request at a time (streamed):

* ``with``: the decode's cache holds what the conversation's earlier turns left (the
  blocks of their prompts and answers): the decode pulls only the blocks it lacks;
* ``without``: right after, the decode's cache is reset
  (``POST /reset_prefix_cache?reset_external=true``, a dev-mode endpoint) and the same
  prompt is sent again: the whole prompt is pulled. (Its own blocks are kept at its
  finish, so the next turn's ``with`` finds the conversation as it would have.)

Per request: the client's TTFT (proxy to first token: prefill compute, the pull and
the first decode step), the decode's own TTFT (its ``time_to_first_token`` histogram:
arrival at the decode to the first token), the RD2H bytes pulled and the blocks served
from the cache (decode ``/metrics`` deltas once the servers are idle). Reported: the
per-turn sums and medians, ``multiturn_bytes_ratio`` (bytes with / without) and
``multiturn_ttft_ratio`` / ``multiturn_decode_ttft_ratio`` (medians, with / without),
``bytes_saved_equal_cached`` (the bytes not pulled equal the cached blocks times one
block of every layer's main and indexer rows), and parity: every answer, with and
without, equals the plain server's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ascend_offload.bench import run_server_bench
from ascend_offload.bench.e2e_pd import ROOT, _body, _pct, _stream_one
from ascend_offload.demo.prom import delta
from ascend_offload.demo.run import settled
from ascend_offload.harness.servers import Server, free_port, stop_all, wait_health

BLOCK_SIZE = 32
N_LAYERS = 4
TOPK = 32
MAIN_ROW_BYTES = (64 + 16) * 4  # latent + rope, float32
INDEX_ROW_BYTES = 32 * 4  # index_head_dim, float32
WIRE_BLOCK_BYTES = N_LAYERS * BLOCK_SIZE * (MAIN_ROW_BYTES + INDEX_ROW_BYTES)
STARTUP_S = 420.0
IDLE_TIMEOUT_S = 60.0
SEED = 5
RD2H = "vllm:ascend_offload_rd2h_"
BAD_LOG = ("Recovered from KV load failure", "blocks failed to load", "Traceback",
           "cannot receive", "cannot send", "admission failed", "not served")


@contextmanager
def _cluster(model: str, log_dir: Path, cache_blocks: int, startup_s: float
             ) -> Iterator[tuple[str, str, str, list[Server]]]:
    """Prefill (core 0), decode (core 1), our proxy and a plain server (core 0); yields
    (proxy URL, decode URL, plain URL, servers) and stops them all."""
    env = dict(os.environ, VLLM_HOST_IP="127.0.0.1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    api = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype",
           "float32", "--block-size", str(BLOCK_SIZE), "--enforce-eager", "--max-model-len", "4096",
           "--seed", "0", "--host", "127.0.0.1", "--no-enable-prefix-caching"]
    p_port, d_port, proxy_port, plain_port, p_kv, d_kv = (free_port() for _ in range(6))
    extra: dict[str, Any] = {"ack_timeout_s": 30, "request_timeout_s": 60, "registration_timeout_s": 30}

    def kv(role: str, kv_port: int, more: dict[str, Any]) -> str:
        return json.dumps({"kv_connector": "SfaRemoteD2HConnector", "kv_role": role, "kv_port": kv_port,
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_module_path": "ascend_offload.connectors.remote_d2h",
                           "kv_connector_extra_config": {**extra, **more}})

    sparse = {"enabled": True, "topk_buffer_size": 64, "index_topk": TOPK, "dram_size_per_dp_GB": 0.02,
              "prefix_cache_blocks": cache_blocks}
    servers: list[Server] = []
    try:
        servers.append(Server("prefill", [*api, "--port", str(p_port), "--kv-transfer-config",
                                          kv("kv_producer", p_kv, {})],
                              dict(env, VLLM_CPU_OMP_THREADS_BIND="0"), log_dir))
        servers.append(Server("decode", [*api, "--port", str(d_port), "--max-num-seqs", "4",
                                         "--kv-transfer-config",
                                         kv("kv_consumer", d_kv, {"sparse_offload": sparse})],
                              dict(env, VLLM_CPU_OMP_THREADS_BIND="1", VLLM_SERVER_DEV_MODE="1"),
                              log_dir))
        servers.append(Server("proxy", [sys.executable, "-m", "proxy.cli", "--host", "127.0.0.1", "--port",
                                        str(proxy_port), "--prefiller-hosts", "127.0.0.1",
                                        "--prefiller-ports", str(p_port), "--decoder-hosts", "127.0.0.1",
                                        "--decoder-ports", str(d_port)], env, log_dir))
        servers.append(Server("plain", [*api, "--port", str(plain_port)],
                              dict(env, VLLM_CPU_OMP_THREADS_BIND="0"), log_dir))
        deadline = time.monotonic() + startup_s
        for port, server in zip((p_port, d_port, proxy_port, plain_port), servers, strict=True):
            wait_health(f"http://127.0.0.1:{port}/health", servers, deadline, serving=server)
        yield (f"http://127.0.0.1:{proxy_port}", f"http://127.0.0.1:{d_port}",
               f"http://127.0.0.1:{plain_port}", servers)
    finally:
        stop_all(servers)


def conversations(n: int, seed: int = SEED) -> tuple[list[list[int]], list[list[list[int]]]]:
    """``n`` first prompts (200-800 tokens) and, per conversation, its follow-ups (30-120)."""
    rng = random.Random(seed)
    first = [[rng.randrange(3, 512) for _ in range(rng.randrange(200, 801))] for _ in range(n)]
    follow = [[[rng.randrange(3, 512) for _ in range(rng.randrange(30, 121))] for _ in range(8)]
              for _ in range(n)]
    return first, follow


def run(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    from ascend_offload.harness.tiny_sparse_model import make_tiny_sparse_model

    cache = Path(os.environ.get("ASCEND_OFFLOAD_TEST_MODELS", "/tmp/ascend-offload-test-models"))
    model = str(make_tiny_sparse_model(cache / "tiny-sparse-mla-4l", index_topk=TOPK))
    first, follow = conversations(args.conversations)
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="bench-multiturn-"))
    rows: list[dict[str, Any]] = []
    with _cluster(model, log_dir, args.cache_blocks, args.startup_s) as (proxy, decode, plain, servers), \
            httpx.Client() as client:
        sizes = {s.name: len(s.text()) for s in servers}

        def send(prompt: list[int]) -> tuple[Any, dict[str, float]]:
            before = settled(client, [decode], IDLE_TIMEOUT_S)[0]
            r = _stream_one(client, proxy, _body(model, prompt, args.output_tokens))
            if r.error:
                raise RuntimeError(f"request failed: {r.error}")
            return r, delta(before, settled(client, [decode], IDLE_TIMEOUT_S)[0])

        def reset() -> None:
            resp = client.post(f"{decode}/reset_prefix_cache", params={"reset_external": "true"}, timeout=30)
            resp.raise_for_status()

        for c in range(args.conversations):
            prompt = first[c]
            for turn in range(args.turns):
                with_r, with_m = send(prompt)
                row: dict[str, Any] = {"conversation": c, "turn": turn + 1, "prompt_tokens": len(prompt)}
                plain_r = _stream_one(client, plain, _body(model, prompt, args.output_tokens))
                row["parity_with"] = with_r.tokens == plain_r.tokens and not plain_r.error
                row["with"] = _measure(with_r, with_m)
                if turn:
                    reset()
                    without_r, without_m = send(prompt)
                    row["without"] = _measure(without_r, without_m)
                    row["parity_without"] = without_r.tokens == plain_r.tokens
                rows.append(row)
                print(f"[sparse-multiturn] conversation {c} turn {turn + 1}: {len(prompt)} tokens, "
                      f"with {row['with']}, without {row.get('without')}", file=sys.stderr, flush=True)
                prompt = prompt + with_r.tokens + follow[c][turn]
        bad = [f"{s.name}: {line.strip()[:200]}" for s in servers
               for line in s.text()[sizes[s.name]:].splitlines() if any(b in line for b in BAD_LOG)]
    return _summary(args, rows, bad, str(log_dir))


def _measure(r: Any, m: dict[str, float]) -> dict[str, float]:
    ttft_n = m.get("vllm:time_to_first_token_seconds_count", 0.0)
    return {"ttft_ms": round(r.ttft_ms, 2),
            "decode_ttft_ms": round(1e3 * m.get("vllm:time_to_first_token_seconds_sum", 0.0)
                                    / max(1.0, ttft_n), 2),
            "bytes_pulled": m.get(RD2H + "bytes_pulled", 0.0),
            "cached_blocks": m.get(RD2H + "sparse_prefix_loaded_blocks", 0.0)}


def _summary(args: argparse.Namespace, rows: list[dict[str, Any]], bad: list[str], log_dir: str
             ) -> dict[str, Any]:
    later = [r for r in rows if "without" in r]
    w = [r["with"] for r in later]
    wo = [r["without"] for r in later]

    def med(xs: list[dict[str, float]], k: str) -> float:
        return _pct([x[k] for x in xs], 0.5)

    bytes_with, bytes_without = sum(x["bytes_pulled"] for x in w), sum(x["bytes_pulled"] for x in wo)
    cached = sum(x["cached_blocks"] for x in w)
    res: dict[str, Any] = {
        "config": {"model": "tiny sparse-MLA, 4 layers, index_topk 32, float32", "block_size": BLOCK_SIZE,
                   "conversations": args.conversations, "turns": args.turns,
                   "output_tokens": args.output_tokens, "prefix_cache_blocks": args.cache_blocks,
                   "concurrency": 1, "wire_block_bytes": WIRE_BLOCK_BYTES, "cpus": os.cpu_count(),
                   "log_dir": log_dir},
        "requests": rows,
        "later_turns": len(later),
        "bytes_pulled": {"with": bytes_with, "without": bytes_without},
        "cached_blocks": cached,
        "bytes_saved_equal_cached": bytes_without - bytes_with == cached * WIRE_BLOCK_BYTES,
        "multiturn_bytes_ratio": bytes_with / bytes_without if bytes_without else float("nan"),
        "ttft_ms": {"with": med(w, "ttft_ms"), "without": med(wo, "ttft_ms")},
        "decode_ttft_ms": {"with": med(w, "decode_ttft_ms"), "without": med(wo, "decode_ttft_ms")},
        "parity": f"{sum(r['parity_with'] + r.get('parity_without', 0) for r in rows)}/"
                  f"{len(rows) + len(later)}",
        "bad_log_lines": bad[:20],
    }
    res["multiturn_ttft_ratio"] = res["ttft_ms"]["with"] / res["ttft_ms"]["without"]
    res["multiturn_decode_ttft_ratio"] = res["decode_ttft_ms"]["with"] / res["decode_ttft_ms"]["without"]
    return res


def report(res: dict[str, Any]) -> str:
    b = res["bytes_pulled"]
    return "\n".join([
        f"sparse-multiturn: {res['config']['conversations']} conversations x {res['config']['turns']} "
        f"turns, {res['later_turns']} later turns sent with and without the decode's prefix cache",
        f"  RD2H bytes pulled  with {b['with'] / 2**20:.2f} MiB, without {b['without'] / 2**20:.2f} MiB "
        f"(ratio {res['multiturn_bytes_ratio']:.3f}); {res['cached_blocks']:.0f} blocks from the cache, "
        f"saved bytes = cached blocks x {WIRE_BLOCK_BYTES} B: {res['bytes_saved_equal_cached']}",
        f"  TTFT median (client)  with {res['ttft_ms']['with']:.1f} ms, without "
        f"{res['ttft_ms']['without']:.1f} ms (ratio {res['multiturn_ttft_ratio']:.3f})",
        f"  TTFT median (decode)  with {res['decode_ttft_ms']['with']:.1f} ms, without "
        f"{res['decode_ttft_ms']['without']:.1f} ms (ratio {res['multiturn_decode_ttft_ratio']:.3f})",
        f"  parity with the plain server: {res['parity']}; bad log lines: {len(res['bad_log_lines'])}",
    ])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ascend-offload bench sparse-multiturn",
                                description=(__doc__ or "").splitlines()[0])
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=3, help="turns per conversation (>= 2)")
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--cache-blocks", type=int, default=256, help="the decode's prefix_cache_blocks")
    p.add_argument("--startup-s", type=float, default=STARTUP_S)
    p.add_argument("--log-dir", default=None, help="server logs (default: a new temp dir)")
    p.add_argument("--json", default=None, help="write the results here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.conversations < 1 or args.turns < 2 or args.output_tokens < 2 or args.cache_blocks < 1:
        print("--conversations >= 1, --turns >= 2, --output-tokens >= 2, --cache-blocks >= 1",
              file=sys.stderr)
        return 2
    res = run_server_bench("sparse-multiturn", lambda: run(args), report, args.json)
    if isinstance(res, int):
        return res
    total = res["parity"].split("/")
    ok = total[0] == total[1] and res["bytes_saved_equal_cached"] and not res["bad_log_lines"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
