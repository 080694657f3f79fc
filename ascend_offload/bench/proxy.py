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
    t_start = time.perf_counter()
    t_measure = t_start + warmup
    t_end = t_measure + duration
    cpu0 = time.process_time()
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=30)) as s:

        async def worker() -> None:
            nonlocal errors
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
                if t0 >= t_measure and t1 <= t_end:
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
        "client_cpu_ms_per_req": cpu * ms / (len(lat) * (duration + warmup) / duration) if lat else None,
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


def run_bench(concurrencies: list[int], duration: float, stream: bool) -> dict[str, Any]:
    fb = "ascend_offload.testing.fake_backends"
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
        _run_client(proxy_url, 4, 0.3, stream)  # warm every connection pool once
        rows = []
        for c in concurrencies:
            d_cpu0 = cpu_seconds(dec.pid)
            direct = _run_client(direct_url, c, duration, stream)
            direct["decode_cpu_ms_per_req"] = _per_req(cpu_seconds(dec.pid) - d_cpu0, direct)
            p_cpu0, d_cpu0, f_cpu0 = cpu_seconds(prx.pid), cpu_seconds(dec.pid), cpu_seconds(pre.pid)
            proxied = _run_client(proxy_url, c, duration, stream)
            proxied["proxy_cpu_ms_per_req"] = _per_req(cpu_seconds(prx.pid) - p_cpu0, proxied)
            proxied["decode_cpu_ms_per_req"] = _per_req(cpu_seconds(dec.pid) - d_cpu0, proxied)
            proxied["prefill_cpu_ms_per_req"] = _per_req(cpu_seconds(pre.pid) - f_cpu0, proxied)
            ratio = proxied["req_s"] / direct["req_s"] if direct["req_s"] else float("nan")
            rows.append({
                "concurrency": c, "direct": direct, "proxied": proxied, "ratio_req_s": ratio,
                "cpu_bound": _cpu_bound(direct, proxied),
            })
        return {
            "bench": "proxy",
            "stream": stream,
            "chunks": 16,
            "duration_s": duration,
            "cpus": os.cpu_count(),
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
    # CPU is measured over the whole client run (warm-up included), requests
    # only over the measured window: scale requests up by the warm-up share.
    n = res["requests"] * (res["seconds"] + 0.3) / res["seconds"]
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
    ap = argparse.ArgumentParser(prog="ascend-offload bench proxy", description=__doc__)
    ap.add_argument("--concurrency", default=",".join(map(str, DEFAULT_CONCURRENCY)),
                    help="comma-separated client concurrencies (default 1,8,32,64)")
    ap.add_argument("--duration", type=float, default=2.0, help="measured seconds per phase")
    ap.add_argument("--no-stream", action="store_true", help="non-streamed requests instead")
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
    res = run_bench(conc, a.duration, not a.no_stream)
    _print(res)
    for r in res["results"]:
        b = r["cpu_bound"]
        print(f"c={r['concurrency']}: CPU ms/req direct {b['direct_total_cpu_ms_per_req']:.2f}, "
              f"proxied {b['proxied_total_cpu_ms_per_req']:.2f} (proxy share "
              f"{b['proxy_share_of_proxied_cpu']:.0%}); CPU-bound ratio "
              f"{b['ratio_if_cpu_bound']:.2f}x, with a zero-cost proxy {b['ratio_if_proxy_were_free']:.2f}x")
    ratios = ", ".join(f"c={r['concurrency']}: {r['ratio_req_s']:.2f}x" for r in res["results"])
    print(f"proxied/direct req/s: {ratios} (target at c=8: >= 0.6x)")
    if a.json:
        path = Path(a.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
