"""harness/servers.Server: the launcher of every e2e test and bench server."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from ascend_offload.harness.servers import Server, stop_all


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_servers_share_the_caller_session_and_are_reaped(tmp_path: Path) -> None:
    """Servers stay in the caller's session (one autogroup: vLLM's spinning workers yield to the
    other servers) but get their own process group, so teardown still reaps their children."""
    child_pid = tmp_path / "child.pid"
    code = ("import subprocess, sys, time, pathlib; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"pathlib.Path({str(child_pid)!r}).write_text(str(c.pid)); time.sleep(60)")
    srv = Server("fake", [sys.executable, "-c", code], dict(os.environ), tmp_path)
    try:
        deadline = time.monotonic() + 20
        while not child_pid.exists() or not child_pid.read_text():
            assert time.monotonic() < deadline, "fake server did not start its child"
            time.sleep(0.05)
        child = int(child_pid.read_text())
        assert os.getsid(srv.proc.pid) == os.getsid(0)
        assert os.getpgid(srv.proc.pid) == srv.proc.pid != os.getpgid(0)
        assert os.getpgid(child) == srv.proc.pid
    finally:
        srv.stop()
    assert srv.proc.poll() is not None
    deadline = time.monotonic() + 10
    while _alive(child):  # reaped by init once killed; a zombie briefly still answers kill(0)
        try:
            if Path(f"/proc/{child}/stat").read_text().split(")")[-1].split()[0] == "Z":
                break
        except OSError:
            break
        assert time.monotonic() < deadline, "the server's child survived teardown"
        time.sleep(0.05)


def test_stop_all_signals_every_server_at_once_and_kills_one_still_starting(tmp_path: Path) -> None:
    """A server that never turned ready and ignores SIGTERM (a vLLM API server mid-start-up)
    is SIGKILLed after the short start-up grace; ready ones get SIGTERM and exit through
    their handler (each leaves a mark)."""
    def fake(name: str, ignore_term: bool) -> Server:
        mark = tmp_path / f"{name}.term"
        handler = ("signal.SIG_IGN" if ignore_term else
                   f"lambda s, f: (pathlib.Path({str(mark)!r}).write_text('term'), sys.exit(0))")
        code = (f"import pathlib, signal, sys, time; signal.signal(signal.SIGTERM, {handler}); "
                "print('up', flush=True); time.sleep(600)")
        return Server(name, [sys.executable, "-c", code], dict(os.environ), tmp_path)

    starting = fake("starting", ignore_term=True)
    ready = [fake(f"ready{i}", ignore_term=False) for i in range(2)]
    for s in (starting, *ready):
        deadline = time.monotonic() + 20
        while "up" not in s.text():
            assert time.monotonic() < deadline, f"{s.name} did not start"
            time.sleep(0.05)
    for s in ready:
        s.ready = True
    stop_all([*ready, starting])
    assert starting.proc.returncode == -signal.SIGKILL
    assert [s.proc.returncode for s in ready] == [0, 0]
    assert all((tmp_path / f"{s.name}.term").is_file() for s in ready)
