"""``ascend-offload demo`` end to end: the table, exit 0, every process gone; Ctrl-C mid-run too.

The demo is run as ``make demo`` runs it (``python -m ascend_offload.cli demo``)
in its own process group, with a marker in its environment that every process
it starts inherits: after it exits, no process on this machine may still carry
the marker (engine cores and workers included).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("mooncake.engine")
pytest.importorskip("tqdm")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
MARKER = "ASCEND_OFFLOAD_DEMO_TEST_RUN"


def _carriers(token: str) -> list[int]:
    """PIDs of live processes whose environment holds ``MARKER=token``."""
    needle = f"{MARKER}={token}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours
            continue
    return pids


def _stop_signals_blocked(pid: int) -> int:
    """SIGINT / SIGTERM bits of the process's blocked-signal mask (0 if it is gone, or if
    it is CPython's multiprocessing resource tracker: that one starts with both blocked, by
    design, until its ``main`` has set them to be ignored; it ends when its parent does,
    which ``_gone`` checks)."""
    try:
        if b"multiprocessing.resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return 0
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:")), 16)
    return mask & ((1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1)))


_STARTED: list[tuple[subprocess.Popen[str], str]] = []


def _start(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[str], str]:
    token = uuid.uuid4().hex
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **{MARKER: token})
    proc = subprocess.Popen([sys.executable, "-m", "ascend_offload.cli", "demo", "--log-dir", str(tmp_path / "logs"),
                             *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            process_group=0)
    _STARTED.append((proc, token))
    return proc, token


def _gone(token: str, timeout_s: float = 30.0) -> list[int]:
    """Processes still carrying the marker after up to ``timeout_s`` (reaping is asynchronous)."""
    deadline = time.monotonic() + timeout_s
    while (left := _carriers(token)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def _kill_all(proc: subprocess.Popen[str], token: str) -> None:
    """Test cleanup after a failure: the demo's group and anything that carries the marker."""
    alive = [proc.pid] if proc.poll() is None else []  # an exited demo's pid may be reused
    for pid in [*alive, *_carriers(token)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(autouse=True)
def _no_demo_outlives_its_test() -> Iterator[None]:
    """Whatever a test asserted, every process it started is gone afterwards: a demo that
    failed while stopping (or a straggler the test found) is never left running."""
    _STARTED.clear()
    yield
    for proc, token in _STARTED:
        _kill_all(proc, token)


def test_demo_prints_the_table_and_leaves_nothing_running(tmp_path: Path) -> None:
    proc, token = _start(tmp_path)
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            _kill_all(proc, token)
    assert proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{err[-3000:]}"
    lines = out.strip().splitlines()
    final = [line for line in lines if line.startswith("demo: ")]
    assert final == ["demo: 16/16 requests identical"], out
    assert lines[-1].startswith("vLLM logs: ")
    assert all((tmp_path / "logs" / f"{n}.log").is_file() for n in ("prefill", "decode", "proxy"))
    # the counters came from /metrics: the decode pulled KV over RD2H and resolved top-k via hot buffers
    pulled = re.search(r"RD2H prefill->decode pool ([0-9.]+) KiB \((\d+) layer reads, (\d+) failed\)", out)
    assert pulled and float(pulled.group(1)) > 0 and pulled.group(3) == "0", out
    assert re.search(r"hit rate [0-9.]+% of \d+ top-k positions", out), out
    # the decode speculated: every verification row was served from the hot buffers
    spec = re.search(r"speculation   accepted (\d+) of (\d+) draft tokens \([0-9.]+%\) in (\d+) "
                     r"verification rows, (\d+) of them on the hot buffers", out)
    assert spec and int(spec.group(2)) > 0 and spec.group(3) == spec.group(4), out
    decode_ratio = re.search(r"decode ([0-9.]+)$", next(x for x in lines if x.startswith("device KV")))
    assert decode_ratio and float(decode_ratio.group(1)) < 1.0, out
    assert _gone(token) == []


def test_ctrl_c_mid_run_stops_every_process(tmp_path: Path) -> None:
    proc, token = _start(tmp_path)
    logs = tmp_path / "logs"
    try:
        # wait until both engines have spawned their engine-core processes, then Ctrl-C
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            texts = [(logs / f"{n}.log").read_text(errors="replace") if (logs / f"{n}.log").is_file() else ""
                     for n in ("prefill", "decode")]
            if all("EngineCore pid=" in t for t in texts):
                break
            time.sleep(0.25)  # two small files; a 1 s poll left the Ctrl-C ~0.5 s late on average
        assert proc.poll() is None, proc.communicate()
        carriers = _carriers(token)
        assert len(carriers) >= 5  # demo, 2 API servers, 2 engine cores, proxy
        # the servers can be stopped by SIGTERM: none was started with it blocked
        blocked = {pid: mask for pid in carriers if (mask := _stop_signals_blocked(pid))}
        assert blocked == {}, blocked
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            _kill_all(proc, token)
    assert proc.returncode == 130, err[-3000:]
    assert "demo: interrupted" in err
    assert _gone(token) == []
