"""Benchmarks: each module has ``main(argv) -> int``, prints a ratio against a
baseline measured in the same run, and writes JSON (``--json PATH``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: str | Path, result: Any) -> None:
    """Write a bench's result where ``--json`` says, creating the folder."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
