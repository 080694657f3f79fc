"""Call a module-level function in a fresh Python process and return its result.

For engines that must not start in the test process (vLLM's n-gram proposer loads numba,
after which vLLM 0.32's CPU kernel-override scan fails in any engine started later in
that process) yet need not be split over vLLM's engine-core and worker processes: the
child runs its engines in-process (``owned_engine(..., in_process=True)``), one Python
start for all of them instead of two per engine, and their steps are fixed by the inputs
alone (no engine-core process racing the requests' arrival). The child has its own
Prometheus registry: the function reads the counters of its own engines only.

Arguments and result travel pickled; the child's output goes to this process's
stdout / stderr (pytest's capture).

Usage from a test: ``call_in_child(module_function, *args)``; here as a script:
``python -m tests.e2e.child_call IN OUT`` (IN holds the pickled call, OUT gets the
pickled result or the child's exception).
"""

from __future__ import annotations

import importlib
import os
import pickle
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


class ChildFailed(RuntimeError):
    """The child raised, died or ran past its time."""


def call_in_child(fn: Callable[..., Any], *args: Any, timeout_s: float = 600.0) -> Any:
    """``fn(*args)`` in a new Python process (``fn`` importable by its module and name)."""
    with tempfile.TemporaryDirectory(prefix="child-call-") as tmp:
        src, dst = Path(tmp) / "in.pkl", Path(tmp) / "out.pkl"
        src.write_bytes(pickle.dumps((fn.__module__, fn.__qualname__, args)))
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        try:
            proc = subprocess.run([sys.executable, "-m", __name__, str(src), str(dst)], env=env,
                                  cwd=ROOT, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired as exc:  # subprocess.run killed it
            raise ChildFailed(f"{fn.__qualname__} ran past {timeout_s:g} s in its child") from exc
        if not dst.is_file():
            raise ChildFailed(f"{fn.__qualname__}: child exited with {proc.returncode}, no result")
        ok, value = pickle.loads(dst.read_bytes())
        if not ok:
            raise ChildFailed(f"{fn.__qualname__} failed in its child:\n{value}")
        return value


def _main(src: str, dst: str) -> int:
    module, name, args = pickle.loads(Path(src).read_bytes())
    fn: Any = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    try:
        result: tuple[bool, Any] = (True, fn(*args))
    except BaseException:  # reported to the parent, which raises it as a test failure
        result = (False, traceback.format_exc())
    Path(dst).write_bytes(pickle.dumps(result))
    return 0 if result[0] else 1


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1], sys.argv[2]))
