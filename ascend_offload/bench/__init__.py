"""Benchmarks: each module has ``main(argv) -> int``, prints a ratio against a
baseline measured in the same run, and writes JSON (``--json PATH``)."""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_json(path: str | Path, result: Any) -> None:
    """Write a bench's result where ``--json`` says, creating the folder."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_server_bench(tag: str, run: Callable[[], dict[str, Any]],
                     report: Callable[[dict[str, Any]], str], json_path: str | None
                     ) -> dict[str, Any] | int:
    """Drive a bench that starts servers: SIGTERM tears them down like Ctrl-C (130), a
    ``RuntimeError`` / ``ValueError`` is reported as a failed run (1); otherwise the
    report is printed, the JSON written, and the result returned for the exit check."""
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        res = run()
    except KeyboardInterrupt:
        print(f"[{tag}] interrupted; servers stopped", file=sys.stderr)
        return 130
    except (RuntimeError, ValueError) as e:
        print(f"[{tag}] failed: {e}", file=sys.stderr)
        return 1
    print(report(res))
    if json_path:
        write_json(json_path, res)
    return res
