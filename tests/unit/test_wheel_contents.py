"""The built wheel ships the package and nothing only the tests use.

Why build one: what setuptools packages follows ``packages.find`` in pyproject.toml, so a
fake or a piece of test scaffolding put back under ``ascend_offload/`` would ship with
nothing else noticing. The wheel is built once per test session, offline (``--no-deps
--no-build-isolation --no-index``: the venv's setuptools), from a copy of the checkout's
files (tracked and untracked, not ignored), so a stale ``build/`` of the checkout cannot
leak into it. It is the whole wheel a user installs, native library included: about 5 s
on an idle 2-core machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Modules that exist only for the tests: what tests/support/ holds (pd_ranks there extends
# the bench's module of that name, which ships), and the P/D rank scaffolding's old name.
TEST_ONLY_MODULES = ({p.stem for p in (ROOT / "tests" / "support").glob("*.py")} - {"__init__", "pd_ranks"}
                     | {"fake_ascend", "fake_device", "sparse_reference", "procs"})


def _checkout_files() -> list[str]:
    """The checkout's files as a fresh clone plus local edits would have them."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p and (ROOT / p).is_file()]


@pytest.fixture(scope="session")
def wheel_files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout (the files to build from are the checkout's)")
    src = tmp_path_factory.mktemp("wheel-src")
    for rel in _checkout_files():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    out = tmp_path_factory.mktemp("wheel")
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "--no-index",
         "-q", "-w", str(out)],
        cwd=src, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (wheel,) = out.glob("ascend_offload-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        return zf.namelist()


def _test_only(name: str) -> bool:
    """A wheel entry that only the tests use: the tests' tree, a test module, a fake."""
    path = PurePosixPath(name)
    if path.parts[0].endswith(".dist-info"):
        return False
    stem = path.stem if path.suffix == ".py" else ""
    return (path.parts[0] == "tests" or "testing" in path.parts or stem == "testing"
            or stem in TEST_ONLY_MODULES or stem == "conftest" or stem.startswith("test_"))


def test_wheel_ships_no_test_code(wheel_files: list[str]) -> None:
    assert [f for f in wheel_files if _test_only(f)] == []


def test_wheel_ships_what_demo_and_benches_run_on(wheel_files: list[str]) -> None:
    """Not vacuous: the package, the proxy and the harness the demo and benches import are in."""
    for name in ("ascend_offload/config.py", "ascend_offload/harness/servers.py", "ascend_offload/demo/run.py",
                 "ascend_offload/harness/fake_backends.py", "ascend_offload/bench/pd_ranks.py",
                 "ascend_offload/py.typed", "proxy/app.py"):
        assert name in wheel_files, name


@pytest.mark.parametrize(("name", "test_only"), [
    ("tests/support/fake_device.py", True),
    ("ascend_offload/testing/servers.py", True),
    ("ascend_offload/harness/fake_ascend.py", True),
    ("ascend_offload/pd/procs.py", True),
    ("ascend_offload/store/test_store.py", True),
    ("ascend_offload/clock.py", True),
    ("ascend_offload/harness/servers.py", False),
    ("ascend_offload/bench/pd_ranks.py", False),
    ("ascend_offload-0.1.0.dist-info/RECORD", False),
])
def test_what_counts_as_test_code(name: str, test_only: bool) -> None:
    assert _test_only(name) is test_only
