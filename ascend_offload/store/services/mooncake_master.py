"""Run Mooncake's bundled ``mooncake_master`` on loopback (tests, benches, demos).

Why a module and not a shell line: a test must be able to kill the master mid-run
and start it again on the same port (clients reconnect to the address they were set
up with), and every start must be reaped, bounded, whatever the test does.
"""

from __future__ import annotations

import shutil
import sys
import urllib.request
from pathlib import Path

from ascend_offload.store.services.loopback import LoopbackService, free_port


def master_binary() -> str | None:
    """Path of ``mooncake_master`` (next to this interpreter first, then ``PATH``)."""
    here = Path(sys.executable).parent / "mooncake_master"
    if here.exists():
        return str(here)
    return shutil.which("mooncake_master")


class MooncakeMaster(LoopbackService):
    """One ``mooncake_master`` bound to 127.0.0.1 (RPC and metrics ports picked free).

    ``stop()`` then ``start()`` restarts it on the same ports, which is what a client
    set up with ``address`` reconnects to. The master keeps no state across restarts:
    objects stored before are gone (their bytes stay in the clients' segments until
    the clients remount them)."""

    def __init__(self, log_path: Path, *, extra_args: list[str] | None = None,
                 start_timeout_s: float = 20.0) -> None:
        binary = master_binary()
        if binary is None:
            raise FileNotFoundError("mooncake_master not found (pip install mooncake-transfer-engine-non-cuda)")
        self.binary = binary
        self.rpc_port = free_port()
        self.metrics_port = free_port()
        self.log_path = log_path
        self.extra_args = list(extra_args or [])
        self.start_timeout_s = start_timeout_s
        self.proc = None
        self.start()

    @property
    def address(self) -> str:
        """``host:port`` for ``MooncakeStoreConfig.master_address``."""
        return f"127.0.0.1:{self.rpc_port}"

    what = "mooncake_master"

    @property
    def listen_url(self) -> str:
        return self.address

    def _listen_port(self) -> int:
        return self.rpc_port

    def _log_file(self) -> Path:
        return self.log_path

    def _command(self) -> list[str]:
        return [
            self.binary,
            f"-rpc_port={self.rpc_port}", "-rpc_address=127.0.0.1",
            f"-metrics_port={self.metrics_port}", "-metrics_host=127.0.0.1",
            "-enable_http_metadata_server=false",
            *self.extra_args,
        ]

    def key_count(self) -> int:
        """Objects the master indexes now (its ``master_key_count`` metric): tests check
        that publishes reached the store without knowing the keys."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
        for line in text.splitlines():
            if line.startswith("master_key_count "):
                return int(float(line.split()[1]))
        raise RuntimeError(f"no master_key_count in {url}")

    def __enter__(self) -> MooncakeMaster:
        return self
