"""A P/D cluster on vLLM CPU for the e2e tests: prefill + decode API servers and our proxy.

Shared by tests/e2e/test_pd_e2e.py and tests/e2e/test_pd_layerwise_e2e.py; each
passes its own ``--kv-transfer-config`` per role and extra arguments/environment.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import httpx

from ascend_offload.harness.servers import Server, free_port, stop_all, wait_health
from tests.e2e.harness import BLOCK_SIZE

ROOT = Path(__file__).resolve().parents[2]
STARTUP_S = 600.0
# The decode registers a request with the proxy's metaserver only when vLLM's scheduler
# first takes it from the waiting queue. Tests that send more requests at once than the
# decode's --max-num-seqs queue the rest behind whole requests, which on a loaded CI
# machine took over the proxy's default 60 s: the deadline here covers that queueing.
REGISTER_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 300
RD2H_MODULE = "ascend_offload.connectors.remote_d2h"


def rd2h_config(role: str, port: int, extra: dict[str, Any]) -> dict[str, Any]:
    """``SfaRemoteD2HConnector`` for one role, recomputing on load failure."""
    return {"kv_connector": "SfaRemoteD2HConnector", "kv_role": role, "kv_port": port,
            "kv_load_failure_policy": "recompute", "kv_connector_module_path": RD2H_MODULE,
            "kv_connector_extra_config": extra}


@contextlib.contextmanager
def pd_cluster(model: str, log_dir: Path, prefill_kv: Any, decode_kv: Any, *,
               prefill_args: tuple[str, ...] = (), prefill_env: dict[str, str] | None = None,
               decode_args: tuple[str, ...] = (), decode_env: dict[str, str | None] | None = None,
               proxy_args: tuple[str, ...] = (), worker_in_core: bool = True,
               early_proxy: bool = False) -> Iterator[dict[str, Any]]:
    """Start prefill (prefix caching off, core 0), decode (core 1) and the proxy; yield
    their URLs and ``servers`` by name; stop them all. ``prefill_kv`` / ``decode_kv``
    are functions of the role's kv port returning the transfer config dict; a ``None`` in
    ``decode_env`` removes that variable from the decode's environment; ``proxy_args`` are
    added to the proxy's command line. ``early_proxy``: a second proxy over the same
    backends with ``--prefill-dispatch early`` (``proxy_early``), so one cluster serves
    both flows.

    ``worker_in_core`` (default): a TP=1 engine runs its worker inside its engine-core
    process (vLLM's uni-process executor, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``; the API
    server still talks to the engine core across processes), ~10 s less per server.
    ``False`` keeps vLLM's default worker process, where the connectors' scheduler-to-
    worker metadata is serialized (test_pd_e2e and the demo check that path)."""
    p_port, d_port, proxy_port = free_port(), free_port(), free_port()
    p_kv, d_kv = free_port(), free_port()
    env = dict(os.environ, VLLM_HOST_IP="127.0.0.1", VLLM_CPU_KVCACHE_SPACE="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if worker_in_core:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    common = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "float32",
              "--block-size", str(BLOCK_SIZE), "--enforce-eager", "--max-model-len", "4096",
              "--seed", "0", "--host", "127.0.0.1"]
    servers: list[Server] = []
    try:
        servers.append(Server("prefill", [*common, "--no-enable-prefix-caching", "--port", str(p_port),
                                          *prefill_args, "--kv-transfer-config", json.dumps(prefill_kv(p_kv))],
                              {**env, "VLLM_CPU_OMP_THREADS_BIND": "0", **(prefill_env or {})}, log_dir))
        servers.append(Server("decode", [*common, "--port", str(d_port), *decode_args, "--kv-transfer-config",
                                         json.dumps(decode_kv(d_kv))],
                              {k: v for k, v in {**env, "VLLM_CPU_OMP_THREADS_BIND": "1",
                                                 **(decode_env or {})}.items() if v is not None},
                              log_dir))
        ports = [p_port, d_port]
        proxies = {"proxy": (proxy_port, proxy_args)}
        if early_proxy:
            proxies["proxy_early"] = (free_port(), ("--prefill-dispatch", "early"))
        for name, (port, args) in proxies.items():
            servers.append(Server(name, [sys.executable, "-m", "proxy.cli", "--host", "127.0.0.1", "--port",
                                         str(port), "--prefiller-hosts", "127.0.0.1", "--prefiller-ports",
                                         str(p_port), "--decoder-hosts", "127.0.0.1", "--decoder-ports",
                                         str(d_port), "--register-timeout-s", str(REGISTER_TIMEOUT_S), *args],
                                  env, log_dir))
            ports.append(port)
        deadline = time.monotonic() + STARTUP_S
        for port, server in zip(ports, servers, strict=True):
            wait_health(f"http://127.0.0.1:{port}/health", servers, deadline, serving=server)
        yield {"model": model, "prefill": f"http://127.0.0.1:{p_port}", "decode": f"http://127.0.0.1:{d_port}",
               **{name: f"http://127.0.0.1:{port}" for name, (port, _) in proxies.items()},
               "servers": {s.name: s for s in servers}}
    finally:
        stop_all(servers)


def body(model: str, prompt: list[int], stream: bool, max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A greedy completion request of exactly ``max_tokens`` tokens."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": stream, **extra}


class Answer(NamedTuple):
    """A completion's text and, when the request asked for them (``return_token_ids``), its token ids."""

    text: str
    token_ids: tuple[int, ...] | None


def complete(url: str, request: dict[str, Any]) -> Answer:
    r = httpx.post(f"{url}/v1/completions", json=request, timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ids = choice.get("token_ids")
    return Answer(choice["text"], tuple(ids) if ids is not None else None)


def stream(url: str, request: dict[str, Any]) -> Answer:
    text: list[str] = []
    ids: list[int] | None = None
    with httpx.stream("POST", f"{url}/v1/completions", json=request, timeout=180) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for ch in json.loads(line[6:]).get("choices", []):
                text.append(ch.get("text", ""))
                if ch.get("token_ids") is not None:
                    ids = (ids or []) + list(ch["token_ids"])
    return Answer("".join(text), tuple(ids) if ids is not None else None)


def log_sizes(cluster: dict[str, Any]) -> dict[str, int]:
    return {name: len(s.text()) for name, s in cluster["servers"].items()}


def log_lines(cluster: dict[str, Any], since: dict[str, int], needle: str) -> list[str]:
    """Lines containing ``needle`` that any server logged after ``since`` (log_sizes)."""
    return [line for name, s in cluster["servers"].items() for line in s.text()[since[name]:].splitlines()
            if needle in line]


def metric(text: str, name: str) -> float:
    """A metric family's sum over its label sets in a ``/metrics`` page (asserted present)."""
    vals = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(name + "{") or line.startswith(name + " ")]
    assert vals, f"metric {name} missing"
    return sum(vals)


def idle_state(url: str, timeout_s: float) -> tuple[float, float, float]:
    """(running, waiting, KV usage) of the server at ``url`` once all three are 0, or at the
    deadline: an idle engine holds no request and no block (borrowed ones included)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        state = (metric(text, "vllm:num_requests_running"), metric(text, "vllm:num_requests_waiting"),
                 metric(text, "vllm:kv_cache_usage_perc"))
        if state == (0.0, 0.0, 0.0) or time.monotonic() > deadline:
            return state
        time.sleep(0.5)
