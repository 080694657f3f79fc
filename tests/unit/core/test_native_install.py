"""The native host library is built when the package is built (setup.py) and loaded from
the package at run time: no compiler needed then, never a stale library after a source
edit, and a package built without a compiler still installs and runs on the fallbacks.

Each test builds a copy of the checkout (a wheel, or an in-place build like the one
``pip install -e .`` makes) and runs the loader in a fresh interpreter with the compiler
hidden (``CXX`` pointing nowhere, ``PATH`` without g++) and an empty build cache, so a
library that loads cannot have been compiled at run time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")

PROBE = textwrap.dedent("""
    import json, os, sys, torch
    from ascend_offload import native
    lib = native.load()
    out = {"native": native.__file__, "loaded": native.loaded_build(),
           "fastcall": native.fastcall() is not None}
    if lib is not None:
        src, dst = torch.arange(12.).view(4, 3), torch.zeros(2, 3)
        native.copy_rows(src, torch.tensor([3, 1], dtype=torch.int32), dst,
                         torch.tensor([0, 1], dtype=torch.int32))
        out["copied"] = dst.tolist()
    print("PROBE" + json.dumps(out))
""")


def _checkout(dst: Path) -> Path:
    """A copy of the files a build needs (no in-place build, no caches)."""
    ignore = shutil.ignore_patterns("__pycache__", "_native", "*.so")
    for name in ("ascend_offload", "proxy", "csrc_npu"):
        shutil.copytree(REPO / name, dst / name, ignore=ignore)
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dst / name)
    return dst


def _env(tmp: Path, *, compiler: bool, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("ASCEND_OFFLOAD_") and k not in ("CXX", "PYTHONPATH")}
    cache = tmp / f"cache-{len(list(tmp.glob('cache-*')))}"
    cache.mkdir()
    env["ASCEND_OFFLOAD_NATIVE_CACHE"] = str(cache)
    if not compiler:
        empty = tmp / "empty-bin"
        empty.mkdir(exist_ok=True)
        env["CXX"] = "/nonexistent/g++"
        env["PATH"] = str(empty)
    env.update(extra)
    return env


def _probe(cwd: Path, env: dict[str, str]) -> tuple[dict, str]:
    res = subprocess.run([sys.executable, "-c", PROBE], cwd=str(cwd), env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("PROBE"))
    return json.loads(line[len("PROBE"):]), res.stderr


def _cache_files(env: dict[str, str]) -> list[Path]:
    return [p for p in Path(env["ASCEND_OFFLOAD_NATIVE_CACHE"]).rglob("*") if p.is_file()]


def _wheel(src: Path, out: Path, env: dict[str, str]) -> tuple[Path, str]:
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps",
                          "--no-build-isolation", "-w", str(out), str(src)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (whl,) = out.glob("ascend_offload-*.whl")
    return whl, res.stdout + res.stderr


def _install(whl: Path, target: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--target", str(target), str(whl)], check=True, timeout=300,
                   capture_output=True)
    return target


def test_wheel_ships_the_built_library_and_loads_it_without_a_compiler(tmp_path) -> None:
    src = _checkout(tmp_path / "src")
    whl, _ = _wheel(src, tmp_path / "dist", dict(os.environ))
    names = zipfile.ZipFile(whl).namelist()
    assert "ascend_offload/_native/libao_sparse.so" in names
    assert any(n.startswith("ascend_offload/_native/_ao_fastcall.") and n.endswith(".so")
               for n in names)
    assert not [n for n in names if n.endswith((".cpp", ".h"))]  # no sources, no bench baseline
    assert not whl.name.endswith("-none-any.whl")  # a platform wheel: it carries binaries

    site = _install(whl, tmp_path / "site")
    env = _env(tmp_path, compiler=False, PYTHONPATH=str(site))
    out, _ = _probe(tmp_path, env)
    assert out["native"].startswith(str(site))
    assert out["loaded"]["path"] == str(site / "ascend_offload" / "_native" / "libao_sparse.so")
    assert out["loaded"]["march"] == "generic"  # the default: a wheel runs on any CPU
    assert out["fastcall"] is True
    assert out["copied"] == [[9.0, 10.0, 11.0], [3.0, 4.0, 5.0]]
    assert _cache_files(env) == []  # nothing was compiled at run time


def test_package_built_without_a_compiler_installs_and_falls_back(tmp_path) -> None:
    src = _checkout(tmp_path / "src")
    env = dict(os.environ, CXX="/nonexistent/g++")
    whl, log = _wheel(src, tmp_path / "dist", env)
    assert "could not build the native host library" in log
    assert "Install a C++17 compiler" in log
    assert not [n for n in zipfile.ZipFile(whl).namelist() if n.endswith(".so")]

    site = _install(whl, tmp_path / "site")
    out, err = _probe(tmp_path, _env(tmp_path, compiler=True, PYTHONPATH=str(site)))
    assert out["loaded"] == {} and out["fastcall"] is False and "copied" not in out
    assert "built without a working C++ compiler" in err
    assert "pure-torch fallbacks" in err


def test_sdist_carries_the_headers_the_sources_include(tmp_path) -> None:
    """An install from an sdist compiles csrc_npu/ there: the sdist must carry the
    headers the sources include (setup.py lists them as the extensions' depends), not
    only the sources; the library's sources compile from the unpacked sdist."""
    from ascend_offload import native_build

    src = _checkout(tmp_path / "src")
    dist = tmp_path / "dist"
    res = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(dist)],
                         cwd=str(src), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (sdist,) = dist.glob("ascend_offload-*.tar.gz")
    with tarfile.open(sdist) as tf:
        tf.extractall(tmp_path / "unpacked", filter="data")
    (root,) = (tmp_path / "unpacked").iterdir()
    csrc = root / "csrc_npu"
    for names in (native_build.LIB_SOURCES, native_build.FASTCALL_SOURCES):
        files = native_build.source_files(src / "csrc_npu", names)
        missing = [n for n in files if not (csrc / n).is_file()]
        assert not missing, f"{sdist.name} lacks {missing}"
    headers = native_build.source_files(csrc, native_build.LIB_SOURCES)[
        len(native_build.LIB_SOURCES):]
    assert headers  # residency.cpp's parts
    subprocess.run(["g++", "-std=c++17", "-fsyntax-only",
                    *(str(csrc / n) for n in native_build.LIB_SOURCES)],
                   check=True, timeout=300, capture_output=True)


def _build_in_place(src: Path, **env: str) -> None:
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=str(src),
                   env=dict(os.environ, **env), check=True, capture_output=True, timeout=600)


def test_in_place_build_is_loaded_and_never_stale(tmp_path) -> None:
    """The editable-install case: the in-place build loads with no compiler; after a
    source edit it is refused (no compiler: the fallbacks) or replaced by a build of the
    edited sources in the cache (with one)."""
    src = _checkout(tmp_path / "src")
    _build_in_place(src)
    in_place = src / "ascend_offload" / "_native" / "libao_sparse.so"
    env = _env(tmp_path, compiler=False, PYTHONPATH=str(src))
    out, _ = _probe(tmp_path, env)
    assert out["loaded"]["path"] == str(in_place) and out["fastcall"] is True
    assert _cache_files(env) == []

    for name in ("rowcopy.cpp", "fastcall.cpp"):
        with open(src / "csrc_npu" / name, "a") as f:
            f.write("\n// edited after the in-place build\n")
    out, err = _probe(tmp_path, _env(tmp_path, compiler=False, PYTHONPATH=str(src)))
    assert out["loaded"] == {} and out["fastcall"] is False and "copied" not in out
    assert "is stale" in err and "pure-torch fallbacks" in err

    env = _env(tmp_path, compiler=True, PYTHONPATH=str(src))
    out, err = _probe(tmp_path, env)
    assert out["loaded"]["path"].startswith(env["ASCEND_OFFLOAD_NATIVE_CACHE"])
    assert out["fastcall"] is True
    assert out["copied"] == [[9.0, 10.0, 11.0], [3.0, 4.0, 5.0]]
    assert "is stale" in err and "on first use" in err
