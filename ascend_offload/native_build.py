"""How the C++ host library in ``csrc_npu/`` is compiled: the one recipe for the build at
install (``setup.py``, into ``ascend_offload/_native/``) and for the development fallback
of :mod:`ascend_offload.native` (a checkout whose in-place build is missing or stale).

Why a module of its own, standard library only: ``setup.py`` loads this file by path in
the build environment, which has no torch and must not import the package.

Every build embeds a build-info string (:func:`build_info`, in a generated translation unit:
the C++ sources know nothing of it): the digest of the sources it was compiled from and the
CPU tuning. The loader reads it from the file without loading it (:func:`read_build_info`),
so an edited checkout never runs a library built from the old sources, and a library tuned
for one CPU is never loaded on another.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path

LIB_NAME = "ao_sparse"
LIB_FILE = f"lib{LIB_NAME}.so"
LIB_SOURCES = ("residency.cpp", "rowcopy.cpp", "copyqueue.cpp", "device_table.cpp")
FASTCALL_MODULE = "_ao_fastcall"
FASTCALL_SOURCES = ("fastcall.cpp",)
BASE_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fno-strict-aliasing", "-pthread")
MARCH_ENV = "ASCEND_OFFLOAD_NATIVE_MARCH"
GENERIC = "generic"
TUNED = "native"

_INFO_MARK = "ascend_offload-native-build:"
_INFO_RE = re.compile(rb"ascend_offload-native-build:([0-9A-Za-z=;_-]{1,200})")
_INCLUDE_RE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def compiler() -> str | None:
    """``$CXX``, else ``g++`` on ``PATH``, else ``None``."""
    return os.environ.get("CXX") or shutil.which("g++")


def compiler_id(cxx: str) -> str:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0] if out.stdout else cxx
    except (OSError, subprocess.SubprocessError):
        return cxx


def wanted_march(march: str | None = None) -> str:
    """:data:`TUNED` when ``march`` (default: ``$ASCEND_OFFLOAD_NATIVE_MARCH``) is
    ``native``, else :data:`GENERIC`. Generic is the default: a wheel or a shared venv
    must run on any CPU of its architecture (the SIMD paths are chosen at run time
    either way); tuning gave 0.92-0.98x of the generic batch-1 resolve time."""
    value = os.environ.get(MARCH_ENV, "") if march is None else march
    return TUNED if value == TUNED else GENERIC


def cpu_features() -> str:
    """This CPU's feature list (``/proc/cpuinfo``), sorted; ``""`` when unknown."""
    field = {"x86_64": "flags", "aarch64": "Features"}.get(platform.machine())
    if field is None:
        return ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == field:
                    return " ".join(sorted(value.split()))
    except OSError:
        pass
    return ""


def tune_flags(march: str | None = None) -> tuple[tuple[str, ...], str]:
    """The compiler flags of a :data:`TUNED` build for this host (``-march=native`` on
    x86-64, ``-mcpu=native`` on aarch64) and the CPU feature list they depend on; ``((),
    "")`` for a generic build, an unknown machine or unknown features (then generic is
    the safe choice)."""
    if wanted_march(march) != TUNED:
        return (), ""
    flag = {"x86_64": "-march=native", "aarch64": "-mcpu=native"}.get(platform.machine())
    features = cpu_features()
    if flag is None or not features:
        return (), ""
    return (flag,), features


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def source_files(src_dir: Path, names: Iterable[str]) -> list[str]:
    """``names`` followed by the headers they include from ``src_dir``: every
    ``#include "x.h"`` naming a file there, transitively, each once, in the order first
    seen. Everything a build of ``names`` reads from ``src_dir``: what :func:`source_digest`
    covers and the package build lists as the sources' dependencies (so an sdist ships
    them). A quoted include that names no file there is left to the compiler."""
    files = list(dict.fromkeys(names))
    seen = set(files)
    for name in files:  # grows while it is walked: the includes of includes
        path = src_dir / name
        if not path.is_file():
            continue
        for m in _INCLUDE_RE.finditer(path.read_bytes()):
            inc = m.group(1).decode()
            if inc not in seen and (src_dir / inc).is_file():
                seen.add(inc)
                files.append(inc)
    return files


def source_digest(src_dir: Path, names: Iterable[str]) -> str:
    """Digest of the named sources' and their headers' names and bytes
    (:func:`source_files`; the ``src`` of :func:`build_info`): editing a header makes a
    build stale like editing a source."""
    h = hashlib.sha256()
    for name in source_files(src_dir, names):
        h.update(name.encode() + b"\0")
        h.update((src_dir / name).read_bytes())
    return h.hexdigest()[:16]


def build_info(src: str, features: str) -> str:
    """``src=<digest>;march=<generic|native>;cpu=<digest of the CPU features or empty>``:
    ``features`` is empty for a generic build."""
    march = TUNED if features else GENERIC
    return f"src={src};march={march};cpu={digest(features) if features else ''}"


def parse_build_info(info: str) -> dict[str, str]:
    return dict(part.partition("=")[::2] for part in info.split(";") if part)


def read_build_info(path: Path) -> dict[str, str] | None:
    """The build info embedded in a built library or extension, without loading it
    (the string sits in its read-only data), or ``None`` when it has none."""
    try:
        m = _INFO_RE.search(path.read_bytes())
    except OSError:
        return None
    return parse_build_info(m.group(1).decode()) if m else None


def compile_library(sources: list[Path], out: Path, *, flags: tuple[str, ...] = (),
                    march: str | None = None, openmp: bool = True,
                    timeout_s: float = 300.0) -> list[str]:
    """Compile ``sources`` into the shared object ``out`` (written atomically: a
    concurrent loader sees all or nothing). Tries the wanted tuning
    (:func:`wanted_march`) first, then generic; each with OpenMP first (unless
    ``openmp=False``), then without (a scalar single-thread build is still correct).
    Returns ``[]`` on success, else the reasons each attempt failed."""
    cxx = compiler()
    if cxx is None:
        return ["no C++ compiler found (set CXX or install g++)"]
    missing = [str(p) for p in sources if not p.is_file()]
    if missing:
        return [f"sources missing: {', '.join(missing)}"]
    src = source_digest(sources[0].parent, [p.name for p in sources])
    tune, features = tune_flags(march)
    tunings = [(tune, features), ((), "")] if tune else [((), "")]
    omps = [("-fopenmp",), ()] if openmp else [()]
    out.parent.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []
    with tempfile.TemporaryDirectory(prefix="ao-native-") as tmp_dir:
        for t, feats in tunings:
            # One more translation unit holding the build info: every library built here
            # carries it, whatever its sources (``used``: -O3 must not drop it).
            info_src = Path(tmp_dir) / "ao_build_info.cpp"
            info_src.write_text(
                "// generated by ascend_offload/native_build.py\n"
                'extern "C" __attribute__((used, visibility("default"))) const char '
                f'ao_native_build_info[] = "{_INFO_MARK}{build_info(src, feats)}";\n')
            for omp in omps:
                fd, tmp = tempfile.mkstemp(prefix=f".{out.stem}-", suffix=".so", dir=out.parent)
                os.close(fd)
                cmd = [cxx, *BASE_FLAGS, *flags, *t, *omp, *map(str, sources), str(info_src),
                       "-o", tmp]
                try:
                    res = subprocess.run(cmd, capture_output=True, text=True,
                                         timeout=timeout_s)
                except OSError as exc:  # the compiler cannot run at all: no use retrying
                    os.unlink(tmp)
                    return [*errors, f"cannot run the C++ compiler {cxx}: {exc}"]
                except subprocess.SubprocessError as exc:
                    errors.append(f"{cxx}: {exc}")
                    os.unlink(tmp)
                    continue
                if res.returncode == 0:
                    os.chmod(tmp, 0o755)  # mkstemp's 0600 would keep other users from loading
                    os.replace(tmp, out)
                    return []
                errors.append(res.stderr[-2000:])
                os.unlink(tmp)
    return errors
