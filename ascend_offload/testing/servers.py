"""Server subprocesses for e2e tests and benches: start in their own process group
(in the caller's session), wait for health with a deadline, always reap the whole
process group."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    """A loopback port free right now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_range(n: int) -> int:
    """A base port with ``n`` consecutive free loopback ports (decode TP ranks listen on
    base + rank); best effort, like any free-port probe."""
    for _ in range(100):
        base = free_port()
        if base + n >= 65535:
            continue
        socks: list[socket.socket] = []
        try:
            for i in range(n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {n} consecutive free ports")


class Server:
    """One subprocess in its own process group, so teardown reaps the engine core and
    workers too.

    Why a process group and not a session: with ``kernel.sched_autogroup_enabled``
    (on here, and in most distros) every session is one scheduling group, and the
    kernel shares a CPU between groups before it looks at their threads. vLLM's CPU
    workers are pinned (``VLLM_CPU_OMP_THREADS_BIND``) and busy-wait (``sched_yield``
    for 1 s after every message on its shared-memory queue), so with one session per
    server each core always carried another group's spinning worker: engine cores,
    API servers, proxy and client waited 2-16 ms per wake-up on the run queue, a
    decode engine core once 1 s with its request's KV already pulled, and P/D TTFT
    stalled by 200-900 ms with bunched tokens (docs/bench-e2e-pd.md, "Reading it").
    In one session they compete as threads and the yields give the core away.
    """

    def __init__(
        self, name: str, cmd: list[str], env: dict[str, str], log_dir: Path, cwd: Path | None = None
    ) -> None:
        self.name = name
        self.log = log_dir / f"{name}.log"
        self._fh = self.log.open("wb")
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=self._fh, stderr=subprocess.STDOUT, process_group=0
        )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        """SIGTERM the group, SIGKILL after 20 s; bounded either way."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
            except ProcessLookupError:
                pass
        try:  # stragglers left in the group after the leader exited
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._fh.close()


def wait_health(url: str, servers: list[Server], deadline: float) -> None:
    """Poll ``url`` until 200; fail fast if any server exited, fail at ``deadline``."""
    import httpx

    while time.monotonic() < deadline:
        for s in servers:
            if s.proc.poll() is not None:
                raise RuntimeError(f"{s.name} exited with {s.proc.returncode}:\n{s.text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} not healthy before the deadline")
