"""Generated test artefacts (tiny models) written once per spec, safe across processes.

Why a lock: test workers run in parallel and ask for the same model directory at
the same time; without one, a second writer truncates files the first worker's
engine is already reading. The spec marker is written last, so a directory with
a matching marker is complete and is never rewritten.
"""

from __future__ import annotations

import fcntl
import hashlib
import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def generator_digest(write: Callable[[Path], None]) -> str:
    """A digest of the source file that defines ``write``: a directory made by an older
    generator (same spec, other code) is not reused."""
    src = inspect.getsourcefile(write)
    data = Path(src).read_bytes() if src else repr(write.__code__.co_code).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def generated_dir(out: Path, marker_name: str, spec: dict[str, Any], write: Callable[[Path], None]) -> Path:
    """``out`` holding what ``write(out)`` produces for ``spec`` (and the code that writes
    it); written at most once at a time."""
    spec = {**spec, "generator": generator_digest(write)}
    marker = out / marker_name

    def done() -> bool:
        return marker.exists() and json.loads(marker.read_text()) == spec

    if done():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done():
            marker.unlink(missing_ok=True)
            out.mkdir(parents=True, exist_ok=True)
            write(out)
            marker.write_text(json.dumps(spec))
    return out
