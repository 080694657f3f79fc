"""Runs the proxy on an aiohttp site: binding, the advertised address, shutdown."""

from __future__ import annotations

import logging
import socket

from aiohttp import web

from proxy.app import Proxy
from proxy.config import ProxyConfig

log = logging.getLogger("proxy")


def bound_port(site: web.TCPSite) -> int:
    """The port a site listens on (the chosen one when asked for port 0)."""
    server = getattr(site, "_server", None)
    sockets = getattr(server, "sockets", None)
    if sockets:
        return int(sockets[0].getsockname()[1])
    return int(site.port)


def advertised_host(host: str) -> str:
    """The address decode instances can reach us at when we bind a wildcard."""
    if host not in ("", "0.0.0.0", "::"):
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class ProxyServer:
    """Runs a ``Proxy`` on an aiohttp site; ``port=0`` picks a free port."""

    def __init__(self, cfg: ProxyConfig, shutdown_grace_s: float = 5.0) -> None:
        self.cfg = cfg
        self.proxy = Proxy(cfg)
        self.port = cfg.port
        # In-flight requests get this long to finish on shutdown, then are cut.
        self.shutdown_grace_s = shutdown_grace_s
        self.metaserver_port: int | None = None  # bound port of the separate metaserver listener
        self._runners: list[web.AppRunner] = []

    @property
    def url(self) -> str:
        host = advertised_host(self.cfg.host)
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    async def _site(self, app: web.Application, host: str, port: int) -> int:
        runner = web.AppRunner(
            app,
            access_log=None,
            handler_cancellation=True,
            handle_signals=False,
            shutdown_timeout=self.shutdown_grace_s,
            # A body we refused (413/408/429) is not drained for aiohttp's default
            # 10 s: the connection closes right after the answer.
            lingering_time=0,
        )
        await runner.setup()
        self._runners.append(runner)
        site = web.TCPSite(runner, host, port, backlog=2048, reuse_address=True)
        await site.start()
        return bound_port(site)

    async def start(self) -> int:
        cfg = self.cfg
        separate = cfg.metaserver_port is not None
        try:
            self.port = await self._site(self.proxy.app(metaserver=not separate), cfg.host, cfg.port)
            if cfg.metaserver_port is not None:
                meta_host = cfg.metaserver_host or cfg.host
                self.metaserver_port = await self._site(self.proxy.metaserver_app(), meta_host,
                                                        cfg.metaserver_port)
        except BaseException:
            await self.stop()
            raise
        if not cfg.metaserver_url:
            if self.metaserver_port is None:
                self.proxy.metaserver_url = f"{self.url}/v1/metaserver"
            else:
                host = advertised_host(cfg.metaserver_host or cfg.host)
                if ":" in host:
                    host = f"[{host}]"
                self.proxy.metaserver_url = f"http://{host}:{self.metaserver_port}/v1/metaserver"
        log.info(
            "proxy on %s:%d, metaserver %s, %d prefill, %d decode",
            self.cfg.host,
            self.port,
            self.proxy.metaserver_url,
            len(self.cfg.prefillers),
            len(self.cfg.decoders),
        )
        return self.port

    async def stop(self) -> None:
        runners, self._runners = self._runners, []
        for runner in reversed(runners):
            await runner.cleanup()
