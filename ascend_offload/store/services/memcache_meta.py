"""Run a Memcache meta service (``memcache_hybrid.MetaService``) on loopback (tests,
demos, a one-host deployment); clients to it are built in store/shared/memcache.py.

Why a module: a test must kill the meta service mid-run and start it again on the same
ports (clients reconnect to the address they were set up with), and every start must
be reaped, bounded, whatever the test does. The meta service needs no Ascend driver;
a client's data path does (``init(device_id, init_bm=True)``), its metadata path does
not (``init_bm=False``: existence and size lookups, no puts or gets).

``python -m ascend_offload.store.services.memcache_meta --meta-port 5000 --config-store-port 6000``
runs one in the foreground (what configs/ascend/mmc-meta.conf describes).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ascend_offload.store.services.loopback import LoopbackService, free_port

_SERVE = """
import sys
from memcache_hybrid import MetaConfig, MetaService
c = MetaConfig()
c.meta_service_url, c.config_store_url, c.metrics_url, c.log_path = sys.argv[1:5]
c.log_level = "warn"
rc = MetaService.setup(c)
if rc != 0:
    sys.exit(f"MetaService.setup failed ({rc})")
MetaService.main()
"""


def available() -> bool:
    """``memcache_hybrid`` is importable here (the ``ascend`` extra)."""
    import importlib.util

    return importlib.util.find_spec("memcache_hybrid") is not None


class MemcacheMeta(LoopbackService):
    """One meta service on 127.0.0.1 (meta, config-store and metrics ports picked free
    unless given). ``stop()`` then ``start()`` restarts it on the same ports."""

    def __init__(self, log_dir: Path, *, meta_port: int = 0, config_store_port: int = 0,
                 metrics_port: int = 0, start_timeout_s: float = 30.0) -> None:
        self.meta_port = meta_port or free_port()
        self.config_store_port = config_store_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.log_dir = log_dir
        self.start_timeout_s = start_timeout_s
        self.proc = None
        self.start()

    @property
    def meta_service_url(self) -> str:
        return f"tcp://127.0.0.1:{self.meta_port}"

    @property
    def config_store_url(self) -> str:
        return f"tcp://127.0.0.1:{self.config_store_port}"

    what = "Memcache meta service"

    @property
    def listen_url(self) -> str:
        return self.meta_service_url

    def _listen_port(self) -> int:
        return self.meta_port

    def _log_file(self) -> Path:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return self.log_dir / "meta.out"

    def _command(self) -> list[str]:
        return [sys.executable, "-c", _SERVE, self.meta_service_url, self.config_store_url,
                f"http://127.0.0.1:{self.metrics_port}", str(self.log_dir)]

    def __enter__(self) -> MemcacheMeta:
        return self


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ascend_offload.store.services.memcache_meta", description=__doc__)
    ap.add_argument("--meta-port", type=int, default=5000)
    ap.add_argument("--config-store-port", type=int, default=6000)
    ap.add_argument("--metrics-port", type=int, default=8000)
    ap.add_argument("--log-dir", default="/tmp/memcache-meta")
    args = ap.parse_args(argv)
    with MemcacheMeta(Path(args.log_dir), meta_port=args.meta_port, config_store_port=args.config_store_port,
                      metrics_port=args.metrics_port) as meta:
        print(f"meta service on {meta.meta_service_url}, config store {meta.config_store_url}", flush=True)
        try:
            while meta.proc is not None and meta.proc.poll() is None:
                time.sleep(1)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
