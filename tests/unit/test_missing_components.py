"""The suite refuses to run with a missing optional component unless opted out (tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import conftest

ROOT = Path(__file__).resolve().parents[2]


def test_every_component_is_present_here() -> None:
    assert conftest.missing_components(set()) == []


def test_a_missing_component_is_named_unless_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = dict(conftest.COMPONENTS)
    broken["mooncake"] = (conftest._imports("mooncake_not_installed_here"), "install it")
    monkeypatch.setattr(conftest, "COMPONENTS", broken)
    lines = conftest.missing_components(set())
    assert len(lines) == 1 and lines[0].startswith("mooncake: import mooncake_not_installed_here failed")
    assert conftest.missing_components({"mooncake"}) == []
    assert conftest.missing_components({"all"}) == []


def test_an_unknown_opt_out_is_refused() -> None:
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                        str(ROOT / "tests/unit/test_generated_dir.py")],
                       cwd=ROOT, env={**os.environ, conftest.ALLOW_ENV: "mooncak"},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "unknown component(s) ['mooncak']" in r.stdout + r.stderr
