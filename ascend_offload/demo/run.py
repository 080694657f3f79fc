"""Start the P/D cluster, run the workload through the proxy, compare with plain answers.

The prefill, the decode and the proxy are started as their own process groups
(``ascend_offload.harness.servers.Server``), with their logs in files; on any
exit path (end, error, Ctrl-C, SIGTERM) every group is stopped and reaped.
Requests run one at a time so the counter deltas around a request are that
request's. Plain answers come from a third server of the same model with no KV
connector at all (the prefill's own answers would not do: its store serves
prefixes the P/D pass saved); it answers as soon as it is healthy, while the
prefill and the decode may still be starting, since its answers depend on
nothing else and no P/D request is timed meanwhile.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from ascend_offload.demo.footprint import footprint_ratio
from ascend_offload.demo.prom import Metrics, delta, parse
from ascend_offload.demo.table import Footprint, RequestResult, render
from ascend_offload.demo.workload import Request, workload
from ascend_offload.harness.engines import ngram_speculative_config
from ascend_offload.harness.servers import Server, free_port, stop_all

ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = ROOT / "configs" / "cpu-demo"
BLOCK_SIZE = 32
MAX_MODEL_LEN = 4096
REQUEST_TIMEOUT_S = 120.0
IDLE_TIMEOUT_S = 30.0
HEALTH_POLL_S = 0.25  # a refused /health costs next to nothing; a 1 s poll lost ~0.5 s a server
# The decode's speculative decoding (vLLM's --speculative-config): n-gram drafts, one per
# step, whose verification rows of two tokens fit the decode's 64-row hot buffers.
SPECULATIVE: dict[str, Any] = ngram_speculative_config(1)
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


@contextlib.contextmanager
def _stop_signals_held(deliver: bool) -> Iterator[None]:
    """Hold Ctrl-C / SIGTERM during the block: raise KeyboardInterrupt after it
    (``deliver``) or drop them. A handler that records, not the signal mask: a child
    spawned inside the block inherits the mask, and a server started with SIGTERM
    blocked never stops on it (each then waits out its SIGKILL grace)."""
    got: list[int] = []
    old = {sig: signal.signal(sig, lambda signum, frame: got.append(signum)) for sig in _STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if got and deliver:
        raise KeyboardInterrupt


def with_kv_port(config: Any, port: int) -> Any:
    """``config`` with every ``kv_port`` (top level and children) set to ``port``: the
    shipped files name fixed ports for a start by hand; the demo takes free ones."""
    if isinstance(config, dict):
        return {k: (port if k == "kv_port" else with_kv_port(v, port)) for k, v in config.items()}
    if isinstance(config, list):
        return [with_kv_port(v, port) for v in config]
    return config


def index_topk(decode_config: dict[str, Any]) -> int:
    """The sparse top-k the decode config expects; the generated model must match it."""
    sparse = (decode_config.get("kv_connector_extra_config") or {}).get("sparse_offload") or {}
    return int(sparse.get("index_topk", 32))


class Cluster:
    """Prefill + decode API servers and the proxy; ``stop`` reaps them all (idempotent)."""

    def __init__(self, model: str, prefill_cfg: dict[str, Any], decode_cfg: dict[str, Any], log_dir: Path,
                 speculative: dict[str, Any] | None = None) -> None:
        """``speculative``: the decode's ``--speculative-config`` (None: no speculation)."""
        self.model = model
        self.log_dir = log_dir
        self.servers: list[Server] = []
        ports = {k: free_port() for k in ("prefill", "decode", "proxy", "plain", "p_kv", "d_kv")}
        self.urls = {k: f"http://127.0.0.1:{ports[k]}" for k in ("prefill", "decode", "proxy", "plain")}
        env = dict(os.environ, VLLM_HOST_IP="127.0.0.1", VLLM_CPU_KVCACHE_SPACE="1",
                   PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        common = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                  "--dtype", "float32", "--block-size", str(BLOCK_SIZE), "--enforce-eager",
                  "--max-model-len", str(MAX_MODEL_LEN), "--seed", "0", "--host", "127.0.0.1",
                  "--no-enable-prefix-caching"]
        # layer sharing plans one cache group; the hybrid manager would split the indexer out
        p_extra = ["--disable-hybrid-kv-cache-manager"] if "use_layerwise" in json.dumps(prefill_cfg) else []
        d_extra = [] if speculative is None else ["--speculative-config", json.dumps(speculative)]
        self._cmds = [
            ("prefill", [*common, "--port", str(ports["prefill"]), *p_extra, "--kv-transfer-config",
                         json.dumps(with_kv_port(prefill_cfg, ports["p_kv"]))], dict(env, VLLM_CPU_OMP_THREADS_BIND="0")),
            ("decode", [*common, "--port", str(ports["decode"]), "--max-num-seqs", "4", *d_extra,
                        "--kv-transfer-config",
                        json.dumps(with_kv_port(decode_cfg, ports["d_kv"]))], dict(env, VLLM_CPU_OMP_THREADS_BIND="1")),
            # No KV connector, so no scheduler-to-worker connector metadata to serialize
            # (the prefill and decode keep vLLM's worker process for that path): its worker
            # runs inside its engine core, one vLLM import fewer while start-up saturates
            # the CPUs. Core 1, not the prefill's core 0: the prefill's model load and warm-up
            # (the longest) held core 0 while core 1 idled.
            ("plain", [*common, "--port", str(ports["plain"]), "--max-num-seqs", "4"],
             dict(env, VLLM_CPU_OMP_THREADS_BIND="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")),
            ("proxy", [sys.executable, "-m", "proxy.cli", "--host", "127.0.0.1", "--port", str(ports["proxy"]),
                       "--prefiller-hosts", "127.0.0.1", "--prefiller-ports", str(ports["prefill"]),
                       "--decoder-hosts", "127.0.0.1", "--decoder-ports", str(ports["decode"])], env),
        ]

    def start(self, deadline: float, refresh: Callable[[], None] = lambda: None) -> Iterator[str]:
        """Start every server, then yield each name as it turns healthy; ``refresh`` is
        called every ``HEALTH_POLL_S`` meanwhile (the progress bar's clock). The caller
        may work with a server when its name is yielded; the deadline is checked after."""
        for name, cmd, env in self._cmds:
            # a Ctrl-C between spawn and bookkeeping would leak the group: held meanwhile
            with _stop_signals_held(deliver=True):
                self.servers.append(Server(name, cmd, env, self.log_dir))
        waiting = [name for name, _, _ in self._cmds]
        with httpx.Client() as client:
            while waiting:
                for s in self.servers:
                    if s.proc.poll() is not None:
                        raise RuntimeError(f"{s.name} exited with {s.proc.returncode} during start-up "
                                           f"(log: {s.log}):\n{s.text()[-2000:]}")
                for name in list(waiting):
                    try:
                        healthy = client.get(f"{self.urls[name]}/health", timeout=2).status_code == 200
                    except httpx.HTTPError:
                        healthy = False
                    if healthy:
                        next(s for s in self.servers if s.name == name).ready = True
                        waiting.remove(name)
                        yield name
                if waiting and time.monotonic() > deadline:
                    raise RuntimeError(f"{', '.join(waiting)} not healthy before the start-up deadline")
                if waiting:
                    refresh()
                    time.sleep(HEALTH_POLL_S)

    def exited(self) -> list[str]:
        """``name (exit code N)`` of every server that is no longer running."""
        return [f"{s.name} (exit code {s.proc.returncode})" for s in self.servers if s.proc.poll() is not None]

    def log(self, name: str) -> str:
        return next((s.text() for s in self.servers if s.name == name), "")

    def stop(self) -> None:
        """Stop every server together (bounded: SIGTERM, SIGKILL after 20 s, 3 s for one
        still starting); a second Ctrl-C meanwhile is ignored, so it cannot cut the
        teardown short."""
        with _stop_signals_held(deliver=False):
            servers, self.servers = self.servers, []
            stop_all(servers)


def scrape(client: httpx.Client, url: str) -> Metrics:
    r = client.get(f"{url}/metrics", timeout=10)
    r.raise_for_status()
    return parse(r.text)


def settled(client: httpx.Client, urls: list[str], timeout_s: float = IDLE_TIMEOUT_S
            ) -> list[Metrics]:
    """The servers' metrics once no request runs or waits and two scrapes 0.2 s apart agree
    (a step's counters reach ``/metrics`` with that step's output; async saves a bit later)."""
    deadline = time.monotonic() + timeout_s
    last: list[Metrics] | None = None
    while True:
        now = [scrape(client, u) for u in urls]
        idle = all(m.get("vllm:num_requests_running", 0) == 0 and m.get("vllm:num_requests_waiting", 0) == 0
                   for m in now)
        if idle and now == last:
            return now
        if time.monotonic() > deadline:
            raise RuntimeError(f"servers not idle {timeout_s:.0f} s after a request")
        last = now
        time.sleep(0.2)


def _body(model: str, req: Request, stream: bool, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "prompt": list(req.prompt), "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": stream, "return_token_ids": True}


def complete(client: httpx.Client, url: str, body: dict[str, Any]) -> tuple[list[int], float, float | None, float | None]:
    """Token ids, end-to-end seconds, TTFT and TPOT (streamed requests only) of one completion."""
    t0 = time.perf_counter()
    if not body["stream"]:
        r = client.post(f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:500]}")
        got = r.json()["choices"][0].get("token_ids") or []
        return list(got), time.perf_counter() - t0, None, None
    ids: list[int] = []
    stamps: list[float] = []
    with client.stream("POST", f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.read()[:500]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for ch in json.loads(line[6:]).get("choices", []):
                new = ch.get("token_ids") or []
                if new:
                    ids += new
                    stamps += [time.perf_counter()] * len(new)
    end = time.perf_counter()
    ttft = stamps[0] - t0 if stamps else None
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
    return ids, end - t0, ttft, tpot


def _attempt(client: httpx.Client, url: str, body: dict[str, Any], index: int
             ) -> tuple[list[int] | None, float, float | None, float | None]:
    """``complete``, with a failed request reported once on stderr and answered ``None``
    (it counts as not identical; the other requests still run)."""
    try:
        return complete(client, url, body)
    except (httpx.HTTPError, RuntimeError, ValueError, KeyError, IndexError, TypeError) as e:
        print(f"\ndemo: request {index} via {url} failed: {e}", file=sys.stderr)
        return None, 0.0, None, None


def plain_answers(cluster: Cluster, requests: list[Request], max_tokens: int, tick: Any
                  ) -> dict[int, list[int] | None]:
    """Every request on the plain server (full responses: only the token ids count), by
    request index; ``None`` for one that failed."""
    answers: dict[int, list[int] | None] = {}
    with httpx.Client() as client:
        for req in requests:
            answers[req.index], *_ = _attempt(client, cluster.urls["plain"],
                                              _body(cluster.model, req, False, max_tokens), req.index)
            tick(f"plain request {req.index}")
    return answers


def run_workload(cluster: Cluster, requests: list[Request], max_tokens: int, tick: Any,
                 plain: dict[int, list[int] | None]) -> list[RequestResult]:
    """Every request through the proxy (metrics deltas around each), compared with its
    ``plain`` answer (:func:`plain_answers`)."""
    urls = [cluster.urls["prefill"], cluster.urls["decode"]]
    results = []
    with httpx.Client() as client:
        before = settled(client, urls)
        for req in requests:
            ids, e2e, ttft, tpot = _attempt(client, cluster.urls["proxy"],
                                            _body(cluster.model, req, req.stream, max_tokens), req.index)
            after = settled(client, urls)
            ref = plain.get(req.index)
            same = ids is not None and ref is not None and len(ref) == max_tokens and ids == ref
            results.append(RequestResult(req.index, len(req.prompt), req.prefix, req.stream, e2e, ttft, tpot,
                                         same, delta(before[0], after[0]), delta(before[1], after[1])))
            before = after
            tick(f"P/D request {req.index}")
    return results


def footprint(cluster: Cluster) -> Footprint:
    return Footprint(footprint_ratio(cluster.log("prefill")), footprint_ratio(cluster.log("decode")))


def model_dir() -> Path:
    return Path(os.environ.get("ASCEND_OFFLOAD_DEMO_MODELS", Path(tempfile.gettempdir()) / "ascend-offload-demo-models"))


def load_json(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def demo(prefill_path: Path, decode_path: Path, n_requests: int | None, max_tokens: int, log_dir: Path,
         startup_s: float, speculative: dict[str, Any] | None = SPECULATIVE) -> int:
    """Run the demo; the table on stdout, progress on stderr; 0 iff every answer is identical."""
    from tqdm import tqdm

    from ascend_offload.check_config import check
    from ascend_offload.harness.tiny_sparse_model import (
        NGRAM_INITIALIZER_RANGE,
        make_tiny_sparse_model,
    )

    prefill_cfg, decode_cfg = load_json(prefill_path), load_json(decode_path)
    check(prefill_cfg)
    check(decode_cfg)
    requests = workload(n_requests)
    log_dir.mkdir(parents=True, exist_ok=True)
    # SIGINT too, explicitly: a process started with SIGINT ignored (a background job of a
    # non-interactive shell, as CI runs) gets no KeyboardInterrupt from Python by default
    for sig in _STOP_SIGNALS:
        signal.signal(sig, _raise_interrupt)
    bar = tqdm(total=4 + 2 * len(requests), desc="model", unit="step", file=sys.stderr, leave=False,
               bar_format="{desc:<22} {bar} {n_fmt}/{total_fmt} [{elapsed}]")

    def tick(desc: str) -> None:
        bar.set_description_str(desc)
        bar.update(1)

    topk = index_topk(decode_cfg)
    cluster: Cluster | None = None
    try:
        init = NGRAM_INITIALIZER_RANGE  # n-gram drafts are sometimes accepted
        model = str(make_tiny_sparse_model(model_dir() / f"tiny-sparse-mla-4l-topk{topk}-ir{init}",
                                           index_topk=topk, initializer_range=init))
        tick("starting engines")
        cluster = Cluster(model, prefill_cfg, decode_cfg, log_dir, speculative)
        plain: dict[int, list[int] | None] = {}
        for name in cluster.start(time.monotonic() + startup_s, bar.refresh):
            tick(f"{name} up")
            if name == "plain":  # the reference answers, while the others may still start
                plain = plain_answers(cluster, requests, max_tokens, tick)
        results = run_workload(cluster, requests, max_tokens, tick, plain)
        fp = footprint(cluster)
    except KeyboardInterrupt:
        bar.close()
        print("\ndemo: interrupted; stopping the servers", file=sys.stderr)
        return 130
    except Exception as e:  # reported with the log files, the servers stopped
        bar.close()
        print(f"\ndemo: FAILED: {e}", file=sys.stderr)
        if cluster is not None and cluster.exited():
            print(f"demo: exited before the end: {', '.join(cluster.exited())}", file=sys.stderr)
        print(f"logs: {', '.join(str(log_dir / f'{n}.log') for n in ('prefill', 'decode', 'proxy'))}", file=sys.stderr)
        return 1
    finally:
        if cluster is not None:
            cluster.stop()
    bar.close()
    spec = ("" if speculative is None else
            f", speculating: {speculative['method']}, {speculative['num_speculative_tokens']} draft")
    print(f"ascend-offload demo: proxy -> prefill ({prefill_path.name}) -> decode ({decode_path.name}{spec}), "
          f"tiny sparse-MLA model (4 layers, top-k {topk}), {max_tokens} greedy tokens per request\n")
    print(render(results, fp))
    print(f"vLLM logs: {', '.join(str(log_dir / f'{n}.log') for n in ('prefill', 'decode', 'proxy'))}")
    return 0 if all(r.identical for r in results) else 1
