"""``harness.freeze.EngineFreezer`` on real child processes named as vLLM names its own:
the engines not running are stopped, the running one is not, helpers are left alone and
every engine runs again after ``resume_all``."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest

from ascend_offload.harness.freeze import EngineFreezer

_CHILD = ("import setproctitle, sys, time; setproctitle.setproctitle(sys.argv[1]); "
          "print('up', flush=True); time.sleep(120)")


def _spawn(title: str) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", _CHILD, title], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "up"  # titled by now
    return p


def _is(p: subprocess.Popen[str], want: str) -> bool:
    """``p`` reaches status ``want`` (a signal is delivered asynchronously: bounded wait)."""
    deadline = time.monotonic() + 10
    while psutil.Process(p.pid).status() != want:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


STOPPED, SLEEPING = psutil.STATUS_STOPPED, psutil.STATUS_SLEEPING


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        p.kill()
        p.wait(timeout=10)


def test_only_the_running_engine_runs(procs: list[subprocess.Popen[str]]) -> None:
    fr = EngineFreezer()
    procs.append(_spawn("VLLM::EngineCore"))
    procs.append(_spawn("VLLM::Worker"))
    assert fr.started("a") == tuple(sorted(p.pid for p in procs))
    helper = _spawn("not-an-engine")  # e.g. multiprocessing's resource tracker
    procs.append(helper)
    procs.append(_spawn("VLLM::Worker"))
    assert fr.started("b") == (procs[3].pid,)  # the helper is nobody's
    a, b = procs[:2], procs[3:]

    fr.run("a")
    assert _is(b[0], STOPPED) and all(_is(p, SLEEPING) for p in a)
    fr.run("b")
    assert all(_is(p, STOPPED) for p in a) and _is(b[0], SLEEPING)
    assert _is(helper, SLEEPING)
    fr.resume_all()
    assert all(_is(p, SLEEPING) for p in a + b)
    with pytest.raises(KeyError, match="'c'"):
        fr.run("c")
