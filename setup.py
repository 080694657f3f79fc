"""Builds the C++ host library (``csrc_npu/``) into the package: ``pip install .`` and
``pip install -e .`` (the Makefile bootstrap) alike; metadata lives in pyproject.toml.

Two outputs in ``ascend_offload/_native/``: ``libao_sparse.so``, a plain shared library
with a C ABI loaded through ctypes (no Python or torch headers: one build serves every
torch version), and ``_ao_fastcall``, a real CPython extension module (the fast-call
trampoline). Both are compiled with the recipe in ``ascend_offload/native_build.py``
(loaded by path: the build environment has no torch), the one the development fallback
of ``ascend_offload/native.py`` uses too. They are optional extensions: on a host with
no working C++ compiler the package still installs, says why at install, and runs on
the pure-torch fallbacks.

Generic code by default (wheels run on any CPU of their architecture);
``ASCEND_OFFLOAD_NATIVE_MARCH=native`` at install tunes the build for the building
host's CPU. The bench-only baseline (``csrc_npu/ref_lru_baseline.cpp``) is not built
or installed: ``ascend-offload bench sparse`` compiles it from a checkout.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError

ROOT = Path(__file__).resolve().parent


def _recipe() -> ModuleType:
    path = ROOT / "ascend_offload" / "native_build.py"
    spec = importlib.util.spec_from_file_location("_ascend_offload_native_build", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


nb = _recipe()
LIB = f"ascend_offload._native.{nb.LIB_FILE.removesuffix('.so')}"
FASTCALL = f"ascend_offload._native.{nb.FASTCALL_MODULE}"


class BuildNative(build_ext):
    """``build_ext`` that compiles with the package's own recipe (``$CXX`` or g++, the
    project's flags, OpenMP when it builds) and names the C library ``libao_sparse.so``
    rather than a per-interpreter extension file name."""

    def get_ext_filename(self, fullname: str) -> str:
        # distutils passes the last name component, setuptools' in-place copy the full name.
        if fullname.rsplit(".", 1)[-1] == LIB.rsplit(".", 1)[-1]:
            return os.path.join(*fullname.split(".")[:-1], nb.LIB_FILE)
        return super().get_ext_filename(fullname)

    def copy_extensions_to_source(self) -> None:
        # In-place builds (editable installs): the folder holds build outputs only, so
        # it is not in git and may not exist yet.
        for ext in self.extensions:
            Path(self.get_ext_fullpath(ext.name)).parent.mkdir(parents=True, exist_ok=True)
        super().copy_extensions_to_source()

    def build_extension(self, ext: Extension) -> None:
        # Always rebuilt (a few seconds): distutils' timestamp check cannot see a change
        # of ASCEND_OFFLOAD_NATIVE_MARCH or of the compiler.
        out = Path(self.get_ext_fullpath(ext.name))
        sources = [ROOT / s for s in ext.sources]
        if ext.name == FASTCALL:
            include = sysconfig.get_paths().get("include") or ""
            errors = nb.compile_library(sources, out, flags=(f"-I{include}",),
                                        march=nb.GENERIC, openmp=False)
            what = "the fast-call trampoline (callers use ctypes without it)"
        else:
            tuned = nb.wanted_march() == nb.TUNED
            print("ascend-offload: compiling the native host library ("
                  + ("tuned for this CPU" if tuned else
                     "generic code; ASCEND_OFFLOAD_NATIVE_MARCH=native tunes it for this CPU")
                  + ")", file=sys.stderr)
            errors = nb.compile_library(sources, out)
            what = ("the native host library (the package runs on the slower pure-torch "
                    "fallbacks without it)")
        if errors:
            detail = " | ".join(e.strip().splitlines()[-1] if e.strip() else "?" for e in errors)
            msg = (f"ascend-offload: could not build {what}: {detail}. Install a C++17 "
                   "compiler (g++, or set CXX) and reinstall to get it.")
            print(f"WARNING: {msg}", file=sys.stderr)
            raise CompileError(msg)


def _extension(name: str, sources: tuple[str, ...]) -> Extension:
    # depends: the headers the sources include, so an sdist ships them (setuptools adds
    # an extension's depends to it) and `pip install` from one still builds.
    headers = nb.source_files(ROOT / "csrc_npu", sources)[len(sources):]
    return Extension(name, sources=[f"csrc_npu/{s}" for s in sources],
                     depends=[f"csrc_npu/{h}" for h in headers], optional=True)


setup(
    ext_modules=[_extension(LIB, nb.LIB_SOURCES), _extension(FASTCALL, nb.FASTCALL_SOURCES)],
    cmdclass={"build_ext": BuildNative},
)
