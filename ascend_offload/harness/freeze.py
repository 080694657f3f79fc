"""Run one of several engines of a process at a time: the others are frozen (SIGSTOP).

Why: a vLLM CPU engine's worker and engine core keep busy-waiting (``sched_yield``)
for a second after their last message (vLLM's shared-memory queue,
``SpinCondition.busy_loop_s``). A bench that measures engines one after another on
the same pinned core would otherwise run each one beside the spinning processes of
the engines measured just before it: measured here, the engine under test got about
half of its core in that second, which is most of a batch-1 round. A frozen process
takes no CPU; resumed, it finds its last read over a second ago and waits for the
next message without spinning.
"""

from __future__ import annotations

import contextlib
import os
import signal

import psutil


class EngineFreezer:
    """The processes each engine started (its engine core and workers), and which
    engines are frozen: :meth:`run` resumes one and freezes all the others."""

    def __init__(self) -> None:
        self._me = psutil.Process(os.getpid())
        self._seen = self._children()
        self._pids: dict[str, tuple[int, ...]] = {}
        self._frozen: set[str] = set()

    def _children(self) -> set[int]:
        """vLLM's own processes below this one (it names them ``VLLM::...``), not helpers
        engines share, such as multiprocessing's resource tracker."""
        out = set()
        for p in self._me.children(recursive=True):
            with contextlib.suppress(psutil.Error):  # gone meanwhile
                if p.name().startswith("VLLM"):
                    out.add(p.pid)
        return out

    def started(self, name: str) -> tuple[int, ...]:
        """Call right after engine ``name`` started: the processes that appeared since the
        last call are its own."""
        now = self._children()
        self._pids[name] = tuple(sorted(now - self._seen))
        self._seen = now
        return self._pids[name]

    def run(self, name: str) -> None:
        """Resume ``name``'s processes and freeze every other engine's."""
        if name not in self._pids:
            raise KeyError(f"engine {name!r} was not registered with started()")
        for other in self._pids:
            if other != name and other not in self._frozen:
                self._signal(other, signal.SIGSTOP)
                self._frozen.add(other)
        if name in self._frozen:
            self._signal(name, signal.SIGCONT)
            self._frozen.discard(name)

    def resume_all(self) -> None:
        """Every engine running again (before any of them is shut down)."""
        for name in self._frozen:
            self._signal(name, signal.SIGCONT)
        self._frozen.clear()

    def _signal(self, name: str, sig: signal.Signals) -> None:
        for pid in self._pids[name]:
            with contextlib.suppress(ProcessLookupError):  # already gone: nothing to do
                os.kill(pid, sig)
