"""Server subprocesses for e2e tests and benches: start in their own process group
(in the caller's session), wait for health with a deadline, always reap the whole
process group."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

STOP_GRACE_S = 20.0  # SIGTERM to SIGKILL
# ... for a server that never answered its health check: a vLLM API server still
# starting up ignores SIGTERM (its engine core exits at once), and has nothing to drain
STARTING_GRACE_S = 3.0
_SLICES = 16  # disjoint port slices: one per test worker (pytest-xdist ``gwN``) or process


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _port_slice() -> range:
    """This process's ports: below the kernel's ephemeral range (so no outgoing connection
    of any process is ever given one between our probe and the server's bind), in a
    slice of its own (so two test workers never pick the same one)."""
    low, high = 10000, min(_ephemeral_low(), 65535)
    if high - low < _SLICES * 64:
        low, high = 1024, high  # an unusual ephemeral range: use what lies below it
    size = (high - low) // _SLICES
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else os.getpid()
    start = low + (index % _SLICES) * size
    return range(start, start + size)


_next_port: list[int] = []  # position in this process's slice (successive calls never repeat)


def free_port() -> int:
    """A loopback port free right now, for a server the caller starts soon after.

    Ports come round-robin from this process's own slice below the ephemeral range,
    each checked by a bind; see :func:`_port_slice` for why no other process takes it
    meanwhile."""
    ports = _port_slice()
    if not _next_port:
        _next_port.append(os.getpid() % len(ports))
    for _ in range(len(ports)):
        port = ports[_next_port[0] % len(ports)]
        _next_port[0] += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {ports}")


def free_port_range(n: int) -> int:
    """A base port with ``n`` consecutive free loopback ports (decode TP ranks listen on
    base + rank), from this process's slice like :func:`free_port`; later calls start
    after the range."""
    for _ in range(100):
        base = free_port()
        if base + n > _port_slice().stop:
            continue
        socks: list[socket.socket] = []
        try:
            for i in range(n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", base + i))
            _next_port[0] += n - 1
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
        self.ready = False  # answered its health check (set by whoever polled it)
        self.log = log_dir / f"{name}.log"
        self._fh = self.log.open("wb")
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=self._fh, stderr=subprocess.STDOUT, process_group=0
        )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM the group, SIGKILL after ``grace_s``; bounded either way, and never raises:
        a killed process that a loaded machine has not reaped within 60 s more is left to
        the kernel (its group got SIGKILL), so a caller's own teardown still runs."""
        stop_all([self], grace_s)

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)


def stop_all(servers: Iterable[Server], grace_s: float = STOP_GRACE_S) -> None:
    """Stop ``servers`` together: SIGTERM every group at once, then one shared ``grace_s``
    before SIGKILL (``STARTING_GRACE_S`` for a server not yet ``ready``), so a cluster
    stops in the time of its slowest server, not the sum. Never raises; stragglers left
    in a group after its leader exited are killed too."""
    servers = list(servers)
    for s in servers:
        if s.proc.poll() is None:
            s._signal(signal.SIGTERM)
    start = time.monotonic()
    for s in servers:
        deadline = start + (grace_s if s.ready else min(grace_s, STARTING_GRACE_S))
        with contextlib.suppress(subprocess.TimeoutExpired):
            s.proc.wait(max(0.0, deadline - time.monotonic()))
    late = [s for s in servers if s.proc.poll() is None]
    for s in late:
        s._signal(signal.SIGKILL)
    reap_deadline = time.monotonic() + 60.0
    for s in late:
        with contextlib.suppress(subprocess.TimeoutExpired):
            s.proc.wait(max(0.0, reap_deadline - time.monotonic()))
    for s in servers:
        s._signal(signal.SIGKILL)  # stragglers left in the group after the leader exited
        s._fh.close()


def wait_health(url: str, servers: list[Server], deadline: float, serving: Server | None = None) -> None:
    """Poll ``url`` until 200 (then ``serving``, the server behind it, is ``ready``); fail
    fast if any server exited, fail at ``deadline``."""
    import httpx

    while time.monotonic() < deadline:
        for s in servers:
            if s.proc.poll() is not None:
                raise RuntimeError(f"{s.name} exited with {s.proc.returncode}:\n{s.text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                if serving is not None:
                    serving.ready = True
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} not healthy before the deadline")
