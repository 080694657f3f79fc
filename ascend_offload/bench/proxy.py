"""``ascend-offload bench proxy``: proxy overhead against talking to decode directly.

Processes: a fake prefill, a fake decode (both answer instantly, 16 streamed
chunks), our proxy, and a load generator. For each concurrency the load
generator runs twice in the same run — straight at the fake decode (the
baseline) and through the proxy (decode-first flow: forward, metaserver
registration, prefill dispatch, relay) — and reports req/s, latency and
time-to-first-chunk p50/p99. The proxy's CPU seconds per request come from
its process CPU time (``/proc/<pid>/stat``) around each proxied phase.

The figure of merit is proxied req/s divided by direct req/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_CONCURRENCY = (1, 8, 32, 64)
BODY = {"model": "fake-model", "prompt": "the quick brown fox jumps over the lazy dog", "max_tokens": 16}


# ---------------------------------------------------------------------- client process


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q * (len(s) - 1))))
    return s[k]


async def _load(url: str, concurrency: int, duration: float, warmup: float, stream: bool) -> dict[str, Any]:
    import aiohttp

    body = json.dumps(dict(BODY, stream=stream)).encode()
    headers = {"Content-Type": "application/json"}
    lat: list[float] = []
    ttfc: list[float] = []
    errors = 0
    total = 0  # every completed request, warm-up and tail included (for CPU per request)
    t_start = time.perf_counter()
    t_measure = t_start + warmup
    t_end = t_measure + duration
    cpu0 = time.process_time()
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=30)) as s:

        async def worker() -> None:
            nonlocal errors, total
            while True:
                t0 = time.perf_counter()
                if t0 >= t_end:
                    return
                first = 0.0
                try:
                    async with s.post(url, data=body, headers=headers) as r:
                        async for _ in r.content.iter_any():
                            if not first:
                                first = time.perf_counter()
                        ok = r.status == 200
                except (aiohttp.ClientError, TimeoutError):
                    ok = False
                t1 = time.perf_counter()
                total += ok
                # Steady-state throughput: everything that completes inside the window.
                if t_measure <= t1 <= t_end:
                    if ok:
                        lat.append(t1 - t0)
                        ttfc.append((first or t1) - t0)
                    else:
                        errors += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    cpu = time.process_time() - cpu0
    ms = 1e3
    return {
        "concurrency": concurrency,
        "requests": len(lat),
        "errors": errors,
        "seconds": duration,
        "req_s": len(lat) / duration,
        "latency_ms_p50": _pct(lat, 0.5) * ms,
        "latency_ms_p99": _pct(lat, 0.99) * ms,
        "ttfc_ms_p50": _pct(ttfc, 0.5) * ms,
        "ttfc_ms_p99": _pct(ttfc, 0.99) * ms,
        "requests_total": total,
        "client_cpu_ms_per_req": cpu * ms / total if total else None,
    }


def client_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench-proxy-client")
    ap.add_argument("--url", required=True)
    ap.add_argument("--concurrency", type=int, required=True)
    ap.add_argument("--duration", type=float, required=True)
    ap.add_argument("--warmup", type=float, default=0.3)
    ap.add_argument("--no-stream", action="store_true")
    a = ap.parse_args(argv)
    coro = _load(a.url, a.concurrency, a.duration, a.warmup, not a.no_stream)
    try:
        import uvloop

        res = uvloop.run(coro)
    except ImportError:
        res = asyncio.run(coro)
    sys.stdout.write(json.dumps(res) + "\n")
    return 0


# ---------------------------------------------------------------------- FastAPI + httpx baseline


def fastapi_proxy_main(argv: list[str]) -> int:
    """The same decode-first flow on FastAPI + uvicorn + httpx: the stack we chose against.

    Hot path only (one prompt, n = 1; no fan-out, no failure handling), and
    chunks are relayed as raw bytes like ours, so the difference to our proxy
    is the HTTP stack, not extra parsing. One shared ``httpx.AsyncClient``
    (one pool for all backends), as typical proxies do.
    """
    ap = argparse.ArgumentParser(prog="bench-proxy-fastapi")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--decode", required=True)
    a = ap.parse_args(argv)

    import httpx
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()
    client = httpx.AsyncClient(timeout=httpx.Timeout(60.0), limits=httpx.Limits(max_connections=None))
    pending: dict[str, dict[str, Any]] = {}
    background: set[asyncio.Task[Any]] = set()
    ids = iter(range(1 << 62))
    meta_url = f"http://127.0.0.1:{a.port}/v1/metaserver"

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        rid = f"fa-{next(ids)}"
        pending[rid] = body
        fwd = dict(body, kv_transfer_params={"do_remote_prefill": True, "do_remote_decode": False,
                                             "metaserver": meta_url, "proxy_request_id": rid})
        resp = await client.send(client.build_request("POST", a.decode + "/v1/completions", json=fwd),
                                 stream=True)

        async def relay() -> Any:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:
                await resp.aclose()
                pending.pop(rid, None)

        return StreamingResponse(relay(), status_code=resp.status_code,
                                 media_type=resp.headers.get("content-type"))

    async def metaserver(request: Request) -> JSONResponse:
        msg = await request.json()
        body = pending.get(msg.get("proxy_request_id", ""))
        if body is None:
            return JSONResponse({"error": "unknown"}, status_code=404)
        params = {"do_remote_decode": True, "do_remote_prefill": False, **msg["kv_transfer_params"]}
        pbody = dict(body, max_tokens=1, stream=False, kv_transfer_params=params)
        task = asyncio.get_running_loop().create_task(
            client.post(a.prefill + "/v1/completions", json=pbody))
        background.add(task)
        task.add_done_callback(background.discard)
        await asyncio.sleep(0)  # let the request start, as "dispatched" promises
        return JSONResponse({"status": "dispatched"})

    # This module uses postponed annotations; FastAPI resolves them in module
    # globals, where the locally imported Request is not: give it the class.
    for path, fn in (("/v1/completions", completions), ("/v1/metaserver", metaserver)):
        fn.__annotations__["request"] = Request
        app.post(path)(fn)
    uvicorn.run(app, host="127.0.0.1", port=a.port, log_level="warning", access_log=False,
                loop="uvloop" if _has("uvloop") else "asyncio",
                http="httptools" if _has("httptools") else "h11")
    return 0


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# ---------------------------------------------------------------------- orchestration


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc (psutil is not required)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        import psutil  # fallback for systems without /proc

        t = psutil.Process(pid).cpu_times()
        return float(t.user + t.system)


def spawn_server(args: list[str], ready_word: str, timeout: float = 30.0) -> tuple[subprocess.Popen[str], int]:
    """Start a server process and wait for its 'ready on port N' line."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(
        [sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if ready_word in line:
            return proc, int(line.rsplit(" ", 1)[1])
    proc.kill()
    raise RuntimeError(f"{args[:3]} did not become ready within {timeout:g} s")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run_client(url: str, concurrency: int, duration: float, stream: bool) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "ascend_offload.bench.proxy", "--client", "--url", url,
           "--concurrency", str(concurrency), "--duration", str(duration)]
    if not stream:
        cmd.append("--no-stream")
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=duration + 60, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_http(url: str, proc: subprocess.Popen[str], timeout: float = 60.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: server process exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} not up within {timeout:g} s")


def _proxied_phase(url: str, c: int, duration: float, stream: bool, pids: dict[str, int]) -> dict[str, Any]:
    cpu0 = {k: cpu_seconds(pid) for k, pid in pids.items()}
    res = _run_client(url, c, duration, stream)
    for k, pid in pids.items():
        res[f"{k}_cpu_ms_per_req"] = _per_req(cpu_seconds(pid) - cpu0[k], res)
    return res


def run_bench(
    concurrencies: list[int], duration: float, stream: bool, baseline: bool = True
) -> dict[str, Any]:
    fb = "ascend_offload.harness.fake_backends"
    procs: list[subprocess.Popen[str]] = []
    try:
        pre, pre_port = spawn_server(["-m", fb, "--role", "prefill", "--no-record"], "ready on port")
        procs.append(pre)
        dec, dec_port = spawn_server(["-m", fb, "--role", "decode", "--no-record"], "ready on port")
        procs.append(dec)
        prx, prx_port = spawn_server(
            ["-m", "proxy.cli", "--port", "0", "--prefiller-ports", str(pre_port),
             "--decoder-ports", str(dec_port), "--log-level", "WARNING"],
            "ready on port",
        )
        procs.append(prx)
        direct_url = f"http://127.0.0.1:{dec_port}/v1/completions"
        proxy_url = f"http://127.0.0.1:{prx_port}/v1/completions"
        fa_url = None
        fa: subprocess.Popen[str] | None = None
        if baseline and all(_has(m) for m in ("fastapi", "httpx", "uvicorn")):
            fa_port = _free_port()
            fa = subprocess.Popen(
                [sys.executable, "-m", "ascend_offload.bench.proxy", "--fastapi-proxy",
                 "--port", str(fa_port), "--prefill", f"http://127.0.0.1:{pre_port}",
                 "--decode", f"http://127.0.0.1:{dec_port}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True, env=_env(),
            )
            procs.append(fa)
            _wait_http(f"http://127.0.0.1:{fa_port}/health", fa)
            fa_url = f"http://127.0.0.1:{fa_port}/v1/completions"
            _run_client(fa_url, 4, 0.3, stream)
        _run_client(proxy_url, 4, 0.3, stream)  # warm every connection pool once
        rows = []
        for c in concurrencies:
            d_cpu0 = cpu_seconds(dec.pid)
            direct = _run_client(direct_url, c, duration, stream)
            direct["decode_cpu_ms_per_req"] = _per_req(cpu_seconds(dec.pid) - d_cpu0, direct)
            proxied = _proxied_phase(
                proxy_url, c, duration, stream, {"proxy": prx.pid, "decode": dec.pid, "prefill": pre.pid}
            )
            ratio = proxied["req_s"] / direct["req_s"] if direct["req_s"] else float("nan")
            row: dict[str, Any] = {
                "concurrency": c, "direct": direct, "proxied": proxied, "ratio_req_s": ratio,
                "cpu_bound": _cpu_bound(direct, proxied),
            }
            if fa is not None and fa_url is not None:
                base = _proxied_phase(
                    fa_url, c, duration, stream, {"proxy": fa.pid, "decode": dec.pid, "prefill": pre.pid}
                )
                row["fastapi_httpx"] = base
                row["fastapi_ratio_req_s"] = base["req_s"] / direct["req_s"] if direct["req_s"] else None
            rows.append(row)
        return {
            "bench": "proxy",
            "stream": stream,
            "chunks": 16,
            "duration_s": duration,
            "cpus": os.cpu_count(),
            "loadavg_after": os.getloadavg(),
            "results": rows,
        }
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()


def _cpu_bound(direct: dict[str, Any], proxied: dict[str, Any]) -> dict[str, float]:
    """What CPU alone allows when every process shares the same few cores.

    Total CPU per request of all processes on each path; their quotient is
    the req/s ratio a saturated box can reach. With the proxy's share removed
    it is the ratio even a zero-cost proxy could not beat here: the decode's
    registration call and the prefill request are part of the P/D flow.
    """
    d_total = (direct.get("client_cpu_ms_per_req") or 0) + direct["decode_cpu_ms_per_req"]
    others = ((proxied.get("client_cpu_ms_per_req") or 0) + proxied["decode_cpu_ms_per_req"]
              + proxied["prefill_cpu_ms_per_req"])
    p_total = others + proxied["proxy_cpu_ms_per_req"]
    return {
        "direct_total_cpu_ms_per_req": d_total,
        "proxied_total_cpu_ms_per_req": p_total,
        "proxy_share_of_proxied_cpu": proxied["proxy_cpu_ms_per_req"] / p_total if p_total else float("nan"),
        "ratio_if_cpu_bound": d_total / p_total if p_total else float("nan"),
        "ratio_if_proxy_were_free": d_total / others if others else float("nan"),
    }


def _per_req(cpu_s: float, res: dict[str, Any]) -> float:
    # CPU is read around the whole client run, so divide by every request it completed.
    n = res["requests_total"]
    return cpu_s * 1e3 / n if n else float("nan")


def _print(res: dict[str, Any]) -> None:
    hdr = (f"{'conc':>4} | {'direct req/s':>12} {'p50 ms':>7} {'p99 ms':>7} {'ttfc50':>7} | "
           f"{'proxy req/s':>11} {'p50 ms':>7} {'p99 ms':>7} {'ttfc50':>7} {'ttfc99':>7} "
           f"{'cpu ms/req':>10} | {'ratio':>5}")
    print(hdr)
    print("-" * len(hdr))
    for r in res["results"]:
        d, p = r["direct"], r["proxied"]
        print(f"{r['concurrency']:>4} | {d['req_s']:>12.0f} {d['latency_ms_p50']:>7.2f} "
              f"{d['latency_ms_p99']:>7.2f} {d['ttfc_ms_p50']:>7.2f} | {p['req_s']:>11.0f} "
              f"{p['latency_ms_p50']:>7.2f} {p['latency_ms_p99']:>7.2f} {p['ttfc_ms_p50']:>7.2f} "
              f"{p['ttfc_ms_p99']:>7.2f} {p['proxy_cpu_ms_per_req']:>10.2f} | {r['ratio_req_s']:>5.2f}")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--client":
        return client_main(args[1:])
    if args and args[0] == "--fastapi-proxy":
        return fastapi_proxy_main(args[1:])
    ap = argparse.ArgumentParser(prog="ascend-offload bench proxy", description=__doc__)
    ap.add_argument("--concurrency", default=",".join(map(str, DEFAULT_CONCURRENCY)),
                    help="comma-separated client concurrencies (default 1,8,32,64)")
    ap.add_argument("--duration", type=float, default=2.0, help="measured seconds per phase")
    ap.add_argument("--no-stream", action="store_true", help="non-streamed requests instead")
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip the FastAPI + httpx proxy of the same flow")
    ap.add_argument("--json", default=None, help="write results JSON here")
    a = ap.parse_args(args)
    try:
        conc = [int(x) for x in a.concurrency.split(",") if x]
    except ValueError:
        ap.error(f"--concurrency must be comma-separated integers, got {a.concurrency!r}")
    if not conc or min(conc) < 1:
        ap.error(f"--concurrency values must be >= 1, got {a.concurrency!r}")
    if a.duration <= 0:
        ap.error(f"--duration must be > 0, got {a.duration}")
    load = os.getloadavg()
    res = run_bench(conc, a.duration, not a.no_stream, baseline=not a.no_baseline)
    res["loadavg_before"] = load
    _print(res)
    for r in res["results"]:
        b = r["cpu_bound"]
        print(f"c={r['concurrency']}: CPU ms/req direct {b['direct_total_cpu_ms_per_req']:.2f}, "
              f"proxied {b['proxied_total_cpu_ms_per_req']:.2f} (proxy share "
              f"{b['proxy_share_of_proxied_cpu']:.0%}); CPU-bound ratio "
              f"{b['ratio_if_cpu_bound']:.2f}x, with a zero-cost proxy {b['ratio_if_proxy_were_free']:.2f}x")
    for r in res["results"]:
        b = r.get("fastapi_httpx")
        if b is not None:
            print(f"c={r['concurrency']}: FastAPI+httpx proxy of the same flow: {b['req_s']:.0f} req/s "
                  f"({r['fastapi_ratio_req_s']:.2f}x direct), {b['proxy_cpu_ms_per_req']:.2f} ms CPU/req "
                  f"vs ours {r['proxied']['req_s']:.0f} req/s, "
                  f"{r['proxied']['proxy_cpu_ms_per_req']:.2f} ms CPU/req")
    ratios = ", ".join(f"c={r['concurrency']}: {r['ratio_req_s']:.2f}x" for r in res["results"])
    print(f"proxied/direct req/s: {ratios} (target at c=8: >= 0.6x)")
    if a.json:
        path = Path(a.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
