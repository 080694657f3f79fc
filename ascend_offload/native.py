"""Build-on-first-use loader for the plain C++ host library (``csrc_npu/``): the sparse
residency table and the batched host row copy (used by the sparse onload and by the
local store's row moves).

Why ctypes and a private build: the library has a C ABI and no torch headers,
so one build serves every torch/torch_npu version and architecture (x86-64,
aarch64); it is compiled with the system ``g++`` into a per-user cache keyed by
a hash of the sources, flags, compiler and machine, so an upgrade or a source
edit rebuilds and concurrent processes never load a half-written file
(atomic rename). Anything going wrong returns ``None`` and is logged once; the
callers then use the pure-torch twin.
"""

from __future__ import annotations

import array
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ABI_VERSION = 9
LIB_SOURCES = ("residency.cpp", "rowcopy.cpp", "copyqueue.cpp")
BASE_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fno-strict-aliasing", "-pthread")

def source_dir() -> Path:
    """The C++ sources: ``$ASCEND_OFFLOAD_CSRC``, else ``ascend_offload/csrc_npu``
    (where a wheel would ship them as package data), else ``csrc_npu/`` of the
    checkout (editable installs, CI)."""
    env = os.environ.get("ASCEND_OFFLOAD_CSRC")
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    packaged = here.parent / "csrc_npu"
    if (packaged / LIB_SOURCES[0]).is_file():
        return packaged
    return here.parents[1] / "csrc_npu"


def cache_dir() -> Path:
    env = os.environ.get("ASCEND_OFFLOAD_NATIVE_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ascend_offload" / "native"


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++")


def _compiler_id(cxx: str) -> str:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0] if out.stdout else cxx
    except (OSError, subprocess.SubprocessError):
        return cxx


def _tune_flags() -> tuple[tuple[str, ...], str]:
    """Flags that tune the build for this host's CPU, and the CPU's feature list they
    depend on (part of the cache key, so a cache shared by different CPUs never hands
    one of them a library with instructions it lacks).

    Why: the library is built on the host that runs it, so it may use everything that
    host has; ``-march=native`` made a batch-1 resolve 0.92-0.98x the time of the
    generic x86-64 build (C driver, same trace, identical results), mostly the scalar
    passes (BMI2 shifts, scheduling). ``ASCEND_OFFLOAD_NATIVE_MARCH=0`` builds generic.
    """
    if os.environ.get("ASCEND_OFFLOAD_NATIVE_MARCH") == "0":
        return (), ""
    machine = platform.machine()
    flag, field = {"x86_64": ("-march=native", "flags"),
                   "aarch64": ("-mcpu=native", "Features")}.get(machine, ("", ""))
    if not flag:
        return (), ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == field:
                    return (flag,), " ".join(sorted(value.split()))
    except OSError:
        pass
    return (), ""  # features unknown: a generic build is the safe one


def build(sources: tuple[str, ...], name: str, *, quiet: bool = False,
          flags: tuple[str, ...] = (), openmp: bool = True) -> Path | None:
    """Compile ``sources`` from :func:`source_dir` into a cached shared library.

    Tries tuned for this CPU first (:func:`_tune_flags`), then generic; each with
    OpenMP first (unless ``openmp=False``), then without (a scalar single-thread
    build is still correct). ``flags`` are extra compiler flags (part of the cache
    key). Returns the library path or ``None``.
    """
    cxx = _compiler()
    src_dir = source_dir()
    paths = [src_dir / s for s in sources]
    if cxx is None:
        _log_once(quiet, "no C++ compiler (g++) found")
        return None
    if not all(p.is_file() for p in paths):
        _log_once(quiet, f"native sources missing under {src_dir}")
        return None
    digest = hashlib.sha256()
    for p in paths:
        digest.update(p.name.encode())
        digest.update(p.read_bytes())
    digest.update(" ".join((*BASE_FLAGS, *flags)).encode())
    digest.update(_compiler_id(cxx).encode())
    digest.update(platform.machine().encode())
    tune, features = _tune_flags()
    digest.update(" ".join(tune).encode())
    digest.update(features.encode())
    key = digest.hexdigest()[:20]
    out_dir = cache_dir() / key
    lib = out_dir / f"lib{name}.so"
    if lib.is_file():
        return lib
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _log_once(quiet, f"cannot create native cache dir {out_dir}: {exc}")
        return None
    errors = []
    omp = (("-fopenmp",), ()) if openmp else ((),)
    for extra in [(*t, *o) for t in ((tune, ()) if tune else ((),)) for o in omp]:
        fd, tmp = tempfile.mkstemp(prefix=f".lib{name}-", suffix=".so", dir=out_dir)
        os.close(fd)
        cmd = [cxx, *BASE_FLAGS, *flags, *extra, *map(str, paths), "-o", tmp]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as exc:
            errors.append(str(exc))
            os.unlink(tmp)
            continue
        if res.returncode == 0:
            os.replace(tmp, lib)  # atomic: a concurrent loader sees all or nothing
            return lib
        errors.append(res.stderr[-2000:])
        os.unlink(tmp)
    _log_once(quiet, "native build failed: " + " | ".join(errors))
    return None


_logged: set[str] = set()


def _log_once(quiet: bool, msg: str) -> None:
    if quiet or msg in _logged:
        return
    _logged.add(msg)
    logger.warning("ascend_offload.native: %s; using the pure-torch fallbacks", msg)


@functools.cache
def load() -> ctypes.CDLL | None:
    """The residency/row-copy library, or ``None`` when it cannot be built/loaded."""
    if os.environ.get("ASCEND_OFFLOAD_DISABLE_NATIVE") == "1":
        _log_once(False, "native residency disabled by ASCEND_OFFLOAD_DISABLE_NATIVE=1")
        return None
    path = build(LIB_SOURCES, "ao_sparse")
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        _log_once(False, f"cannot load {path}: {exc}")
        return None
    if lib.ao_res_abi_version() != ABI_VERSION:
        _log_once(False, f"{path} has ABI {lib.ao_res_abi_version()}, expected {ABI_VERSION}")
        return None
    _declare(lib)
    return lib


Call3 = Callable[[int, int, int, int, bool], int]


@functools.cache
def fastcall() -> Call3 | None:
    """``call3(fn, a, b, c, release_gil)``: the CPython fast-call trampoline
    (``csrc_npu/fastcall.cpp``) for C functions taking three pointers, or ``None``
    (no Python headers, build failure, ``ASCEND_OFFLOAD_NATIVE_FASTCALL=0``): the
    callers then use ctypes. Built per interpreter ABI (the headers' path and the
    extension suffix are part of the cache key)."""
    if os.environ.get("ASCEND_OFFLOAD_NATIVE_FASTCALL") == "0":
        return None
    include = sysconfig.get_paths().get("include")
    if not include or not (Path(include) / "Python.h").is_file():
        logger.debug("ascend_offload.native: no Python.h under %s; ctypes it is", include)
        return None
    abi = sysconfig.get_config_var("EXT_SUFFIX") or sys.version
    # The define is unused by the source: it puts the interpreter ABI into the cache key.
    path = build(("fastcall.cpp",), "ao_fastcall", quiet=True, openmp=False,
                 flags=(f"-I{include}", f"-DAO_PY_ABI=\"{abi}\""))
    if path is None:
        return None
    import importlib.machinery
    import importlib.util

    try:
        loader = importlib.machinery.ExtensionFileLoader("_ao_fastcall", str(path))
        spec = importlib.util.spec_from_file_location("_ao_fastcall", str(path), loader=loader)
        assert spec is not None
        mod = importlib.util.module_from_spec(spec)
        loader.exec_module(mod)
    except (ImportError, OSError, AssertionError) as exc:
        logger.debug("ascend_offload.native: fast-call module unusable (%s); ctypes it is", exc)
        return None
    return mod.call3  # type: ignore[no-any-return]


def address_of(lib: ctypes.CDLL, name: str) -> int:
    """The address of C function ``name`` in ``lib`` (for :func:`fastcall`)."""
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0


@functools.cache
def load_bench() -> ctypes.CDLL | None:
    """The benchmark-only baseline (reference design LRU), same compiler and flags."""
    path = build(("ref_lru_baseline.cpp",), "ao_sparse_bench")
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    vp, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    lib.ao_base_create.restype = vp
    lib.ao_base_create.argtypes = [i32, i32, i32, i32]
    lib.ao_base_destroy.restype = None
    lib.ao_base_destroy.argtypes = [vp]
    lib.ao_base_resolve.restype = i64
    lib.ao_base_resolve.argtypes = [vp, i32, i32, vp, vp, i32, vp, i32, i32, vp, vp, vp]
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    # Pointers travel as plain integers (tensor.data_ptr()): cheaper than ctypes.cast.
    vp, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    lib.ao_res_create.restype = vp
    lib.ao_res_create.argtypes = [i32, i32, i32]
    lib.ao_res_create_policy.restype = vp
    lib.ao_res_create_policy.argtypes = [i32, i32, i32, i32]
    lib.ao_res_policy_state.restype = i32
    lib.ao_res_policy_state.argtypes = [vp, i32, i32, vp, vp, vp]
    lib.ao_res_destroy.restype = None
    lib.ao_res_destroy.argtypes = [vp]
    lib.ao_res_release.restype = i32
    lib.ao_res_release.argtypes = [vp, i32]
    lib.ao_res_has_openmp.restype = i32
    lib.ao_res_resolve.restype = i64
    lib.ao_res_resolve.argtypes = [
        vp, i32, i32, vp, vp, vp, vp, vp, i32, vp, i32, i32, vp, vp, vp, vp, i32, vp,
    ]
    lib.ao_res_inspect.restype = i32
    lib.ao_res_inspect.argtypes = [vp, i32, i32, vp, vp]
    lib.ao_res_resolve_packed.restype = i64
    lib.ao_res_resolve_packed.argtypes = [vp, vp]
    lib.ao_res_resolve_layer.restype = i64
    lib.ao_res_resolve_layer.argtypes = [vp, vp, vp]
    lib.ao_res_max_positions.restype = i64
    lib.ao_res_max_positions.argtypes = [vp]
    lib.ao_res_debug_dirty_words.restype = i64
    lib.ao_res_debug_dirty_words.argtypes = []
    lib.ao_copy_rows.restype = i64
    lib.ao_copy_rows.argtypes = [vp, i64, vp, vp, i64, vp, i64, i64, i32]
    for name in ("ao_cq_create", "ao_cq_destroy", "ao_cq_status", "ao_cq_submit", "ao_cq_wait",
                 "ao_cq_take"):  # three pointer-sized arguments each (fast-call shape)
        getattr(lib, name).restype = vp if name == "ao_cq_create" else i64
        getattr(lib, name).argtypes = [vp, vp, vp]


# Slots of the int64 argument block of ``ao_res_resolve_packed`` that change per call
# (the block follows ``ao_res_resolve``'s argument order; see :func:`resolve_args`).
ARG_LAYER, ARG_ROWS, ARG_TAGS, ARG_STABLE, ARG_LENS, ARG_TOPK = 0, 2, 3, 4, 5, 6
ARG_BLOCK_TABLE, ARG_BT_STRIDE, ARG_BLOCK_SIZE = 8, 9, 10


def resolve_args(*, layer: int, batch: int, k: int, out: int, msrc: int, mdst: int, counts: int,
                 err: int, nthreads: int = 1, rows: int = 0, tags: int = 0, block_table: int = 0,
                 bt_stride: int = 0, block_size: int = 0) -> ctypes.Array:
    """The argument block of ``ao_res_resolve_packed`` (pointers as ints). Made once per
    call shape; the caller rewrites the ``ARG_*`` slots that change per call."""
    return (ctypes.c_int64 * 17)(layer, batch, rows, tags, 0, 0, 0, k, block_table, bt_stride,
                                 block_size, out, msrc, mdst, counts, nthreads, err)


def available() -> bool:
    return load() is not None


def has_openmp() -> bool:
    lib = load()
    return bool(lib is not None and lib.ao_res_has_openmp())


_INT32_CODE = next(c for c in "ilh" if array.array(c).itemsize == 4)


def int32_array(values: Iterable[int]) -> array.array:
    """Row indices as an int32 ``array`` for the C ABI (~0.5 us for 16 ints, against
    ~3 us for ``torch.tensor``)."""
    return array.array(_INT32_CODE, values)


def int32_index(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the contiguous int32 index buffer the C ABI takes (no op if it is one)."""
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def copy_byte_rows(src: int, src_rows: int, src_idx: int, dst: int, dst_rows: int, dst_idx: int,
                   n: int, row_bytes: int) -> int:
    """The raw row copy on addresses (int32 index arrays at ``src_idx``/``dst_idx``),
    one thread: 0, or -(i + 1) for the first out-of-range index pair. For callers that
    checked their buffers already (``device.copy_host_rows``): :func:`copy_rows`'
    tensor checks cost ~3 us a call, a lot for an I/O thread holding the GIL."""
    lib = load()
    if lib is None:
        raise RuntimeError("native row copy unavailable")
    return int(lib.ao_copy_rows(src, src_rows, src_idx, dst, dst_rows, dst_idx, n, row_bytes, 1))


def copy_rows(src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor,
              *, nthreads: int = 1, count: int | None = None) -> None:
    """``dst[dst_idx[i]] = src[src_idx[i]]`` for host tensors, with row prefetch.

    Both tensors must be contiguous host tensors with the same row layout;
    indices int32. ``count`` copies only the first ``count`` index pairs (the
    index tensors may be longer: no slicing op per call). Raises
    ``RuntimeError`` if the library is unavailable and ``IndexError`` naming
    the first out-of-range index.
    """
    lib = load()
    if lib is None:
        raise RuntimeError("native row copy unavailable")
    if src.device.type != "cpu" or dst.device.type != "cpu":
        raise ValueError("native copy_rows needs host tensors")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("native copy_rows needs contiguous tensors")
    if dst.dtype != src.dtype or dst.shape[1:] != src.shape[1:]:
        raise ValueError(f"row layout differs: src {tuple(src.shape)} {src.dtype}, "
                         f"dst {tuple(dst.shape)} {dst.dtype}")
    row_bytes = src.element_size() * (src.numel() // src.shape[0] if src.shape[0] else 0)
    sidx, didx = int32_index(src_idx), int32_index(dst_idx)
    n = sidx.numel()
    if count is None and n != didx.numel():
        raise ValueError(f"copy_rows: {n} source rows but {didx.numel()} destination rows")
    if count is not None:
        if not 0 <= count <= min(n, didx.numel()):
            raise ValueError(f"copy_rows: count={count} outside [0, {min(n, didx.numel())}]")
        n = count
    if n == 0:
        return
    rc = lib.ao_copy_rows(src.data_ptr(), src.shape[0], sidx.data_ptr(), dst.data_ptr(),
                          dst.shape[0], didx.data_ptr(), n, row_bytes, nthreads)
    if rc < 0:
        i = -rc - 1
        raise IndexError(f"copy_rows: index {i} out of range (src row {int(sidx[i])} of "
                         f"{src.shape[0]}, dst row {int(didx[i])} of {dst.shape[0]})")
