"""Run Mooncake's bundled ``mooncake_master`` on loopback (tests, benches, demos).

Why a module and not a shell line: a test must be able to kill the master mid-run
and start it again on the same port (clients reconnect to the address they were set
up with), and every start must be reaped, bounded, whatever the test does.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def master_binary() -> str | None:
    """Path of ``mooncake_master`` (next to this interpreter first, then ``PATH``)."""
    here = Path(sys.executable).parent / "mooncake_master"
    if here.exists():
        return str(here)
    return shutil.which("mooncake_master")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MooncakeMaster:
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
        self.rpc_port = _free_port()
        self.metrics_port = _free_port()
        self.log_path = log_path
        self.extra_args = list(extra_args or [])
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def address(self) -> str:
        """``host:port`` for ``MooncakeStoreConfig.master_address``."""
        return f"127.0.0.1:{self.rpc_port}"

    def start(self) -> None:
        """Start (or restart) the master and wait until its RPC port accepts connections."""
        if self.proc is not None and self.proc.poll() is None:
            return
        cmd = [
            self.binary,
            f"-rpc_port={self.rpc_port}", "-rpc_address=127.0.0.1",
            f"-metrics_port={self.metrics_port}", "-metrics_host=127.0.0.1",
            "-enable_http_metadata_server=false",
            *self.extra_args,
        ]
        with self.log_path.open("ab") as fh:
            self.proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}: "
                                   f"{self.log_path.read_text(errors='replace')[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.rpc_port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"mooncake_master did not listen on {self.address} within {self.start_timeout_s} s")

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

    def stop(self) -> None:
        """SIGKILL the master (what a crash looks like to clients); bounded wait."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(10)

    def __enter__(self) -> MooncakeMaster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
