"""A store service (``mooncake_master``, the Memcache meta service) run as a child
process on loopback: tests, benches, demos and one-host deployments.

Why shared: a test must kill the service mid-run and start it again on the same
ports (clients reconnect to the address they were set up with), and every start must
be reaped, bounded, whatever the test does. Subclasses name the command, the port
that says "listening" and the log file.
"""

from __future__ import annotations

import abc
import os
import signal
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LoopbackService(abc.ABC):
    """One service process on 127.0.0.1; ``stop()`` then ``start()`` restarts it."""

    #: names the service in errors
    what = "service"
    start_timeout_s: float
    proc: subprocess.Popen[bytes] | None = None

    @abc.abstractmethod
    def _command(self) -> list[str]: ...

    @abc.abstractmethod
    def _listen_port(self) -> int: ...

    @abc.abstractmethod
    def _log_file(self) -> Path: ...

    @property
    @abc.abstractmethod
    def listen_url(self) -> str: ...

    def start(self) -> None:
        """Start (or restart) the service; wait until its port accepts connections."""
        if self.proc is not None and self.proc.poll() is None:
            return
        log_file = self._log_file()
        with log_file.open("ab") as fh:
            self.proc = subprocess.Popen(self._command(), stdout=fh, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        port = self._listen_port()
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.what} exited with {self.proc.returncode}: "
                                   f"{log_file.read_text(errors='replace')[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.what} did not listen on {self.listen_url} within {self.start_timeout_s} s")

    def stop(self) -> None:
        """SIGKILL the service's process group (what a crash looks like to clients);
        bounded wait."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(10)

    def __exit__(self, *exc: object) -> None:
        self.stop()
