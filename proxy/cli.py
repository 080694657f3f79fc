"""``ascend-offload-proxy``: run the P/D proxy metaserver.

    ascend-offload-proxy --host 0.0.0.0 --port 8000 \\
        --prefiller-hosts 10.0.0.1 10.0.0.2 --prefiller-ports 8100 \\
        --decoder-hosts 10.0.0.3 --decoder-ports 8200 8201

Hosts and ports take one or more values (space- or comma-separated); a single
host with several ports, or several hosts with one port, pair up naturally.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys

from proxy.config import PREFILL_DISPATCH, ProxyConfig
from proxy.server import ProxyServer


def _split(values: list[str]) -> list[str]:
    out: list[str] = []
    for v in values:
        out.extend(x for x in v.split(",") if x)
    return out


def pair_addresses(role: str, hosts: list[str], ports: list[str]) -> list[tuple[str, int]]:
    """Zip hosts with ports; one host or one port is repeated to the other's length."""
    hosts, raw_ports = _split(hosts), _split(ports)
    if not hosts or not raw_ports:
        raise ValueError(f"--{role}-hosts and --{role}-ports need at least one value each")
    try:
        port_list = [int(p) for p in raw_ports]
    except ValueError:
        raise ValueError(f"--{role}-ports must be integers, got {raw_ports}") from None
    for p in port_list:
        if not 0 < p < 65536:
            raise ValueError(f"--{role}-ports: {p} is not a valid port")
    if len(hosts) == len(port_list):
        return list(zip(hosts, port_list, strict=True))
    if len(hosts) == 1:
        return [(hosts[0], p) for p in port_list]
    if len(port_list) == 1:
        return [(h, port_list[0]) for h in hosts]
    raise ValueError(
        f"--{role}-hosts has {len(hosts)} values and --{role}-ports has {len(port_list)}; "
        "give equal counts, or one host, or one port"
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="ascend-offload-proxy", description="OpenAI-compatible P/D proxy with a metaserver endpoint."
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefiller-hosts", nargs="+", default=["127.0.0.1"])
    ap.add_argument("--prefiller-ports", nargs="+", required=True)
    ap.add_argument("--decoder-hosts", nargs="+", default=["127.0.0.1"])
    ap.add_argument("--decoder-ports", nargs="+", required=True)
    ap.add_argument("--metaserver-url", default=None,
                    help="URL decode instances register at (default: the metaserver listener's "
                         "/v1/metaserver)")
    ap.add_argument("--metaserver-port", type=int, default=None,
                    help="serve /v1/metaserver on its own listener at this port (default: on --port)")
    ap.add_argument("--metaserver-host", default=None,
                    help="address of the metaserver listener, e.g. an interface only decodes reach "
                         "(default: --host)")
    ap.add_argument("--timeout-s", type=float, default=600.0,
                    help="deadline for a prefill answer and for each read from a decode")
    ap.add_argument("--register-timeout-s", type=float, default=60.0,
                    help="a decode must register (or answer) within this after being forwarded")
    ap.add_argument("--connect-timeout-s", type=float, default=5.0)
    ap.add_argument("--cooldown-s", type=float, default=2.0,
                    help="skip a backend this long after it refused a connection")
    ap.add_argument("--keepalive-s", type=float, default=4.0,
                    help="idle keep-alive of backend connections; keep below the backends' own")
    ap.add_argument("--max-connections", type=int, default=0,
                    help="connections per backend instance (0 = unlimited)")
    ap.add_argument("--max-fanout", type=int, default=1024,
                    help="limit on prompts x n of one request")
    ap.add_argument("--max-body-mb", type=int, default=64,
                    help="largest accepted client request body (long token-id prompts)")
    ap.add_argument("--body-timeout-s", type=float, default=30.0,
                    help="a request body must arrive within this (else 408, connection closed)")
    ap.add_argument("--write-timeout-s", type=float, default=60.0,
                    help="a client that takes no data for this long is disconnected")
    ap.add_argument("--max-inflight", type=int, default=1024,
                    help="client requests served at once; more get 429 with Retry-After")
    ap.add_argument("--max-inflight-mb", type=int, default=1024,
                    help="request bodies held at once; more get 503 with Retry-After")
    ap.add_argument("--max-pending", type=int, default=16384,
                    help="sub-requests in the metaserver registry at once; more get 503")
    ap.add_argument("--fanout-queue", type=int, default=64,
                    help="stream chunks buffered between a fan-out's decodes and its client")
    ap.add_argument("--max-answer-mb", type=int, default=256,
                    help="largest non-streamed decode answer read, and largest event of a fanned-out "
                         "stream (502 above it)")
    ap.add_argument("--max-model-len", type=int, default=262144,
                    help="the decodes' --max-model-len: with --block-size it caps a registration's "
                         "body (one block id per prompt block; 413 above it)")
    ap.add_argument("--block-size", type=int, default=16,
                    help="the decodes' KV block size (tokens), for the registration cap")
    ap.add_argument("--prefill-dispatch", choices=PREFILL_DISPATCH, default="registered",
                    help="send the prefill once the decode registered ('registered'), or together "
                         "with the decode request ('early': the prefill claims the decode's "
                         "registration at /v1/metaserver/claim)")
    ap.add_argument("--shutdown-grace-s", type=float, default=5.0,
                    help="on SIGTERM, in-flight requests get this long before they are cut")
    ap.add_argument("--log-level", default="INFO")
    return ap


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    return ProxyConfig(
        prefillers=pair_addresses("prefiller", args.prefiller_hosts, args.prefiller_ports),
        decoders=pair_addresses("decoder", args.decoder_hosts, args.decoder_ports),
        host=args.host,
        port=args.port,
        metaserver_url=args.metaserver_url,
        metaserver_host=args.metaserver_host,
        metaserver_port=args.metaserver_port,
        timeout_s=args.timeout_s,
        register_timeout_s=args.register_timeout_s,
        connect_timeout_s=args.connect_timeout_s,
        cooldown_s=args.cooldown_s,
        keepalive_s=args.keepalive_s,
        max_connections=args.max_connections,
        max_fanout=args.max_fanout,
        max_body_mb=args.max_body_mb,
        body_timeout_s=args.body_timeout_s,
        write_timeout_s=args.write_timeout_s,
        max_inflight=args.max_inflight,
        max_inflight_mb=args.max_inflight_mb,
        max_pending=args.max_pending,
        fanout_queue=args.fanout_queue,
        max_answer_mb=args.max_answer_mb,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        prefill_dispatch=args.prefill_dispatch,
    )


async def serve(
    cfg: ProxyConfig, ready: asyncio.Event | None = None, shutdown_grace_s: float = 5.0
) -> None:
    """Serve until SIGINT/SIGTERM."""
    server = ProxyServer(cfg, shutdown_grace_s=shutdown_grace_s)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    sys.stdout.write(f"ascend-offload-proxy ready on port {server.port}\n")
    sys.stdout.flush()
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
    finally:
        await server.stop()


def run_loop(coro: object) -> None:
    """Run on uvloop when installed (vLLM brings it): a cheaper event loop per request."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)  # type: ignore[arg-type]
        return
    uvloop.run(coro)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        sys.stderr.write(f"ascend-offload-proxy: error: {e}\n")
        return 2
    try:
        run_loop(serve(cfg, shutdown_grace_s=max(0.0, args.shutdown_grace_s)))
    except OSError as e:
        sys.stderr.write(f"ascend-offload-proxy: error: cannot serve on {cfg.host}:{cfg.port}: {e}\n")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
