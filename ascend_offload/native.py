"""Loader of the C++ host library (``csrc_npu/`` at the repository root): the sparse
residency table, the batched host row copy (sparse onload, the store's row moves) and
the ordered copy queue; plus the CPython fast-call trampoline.

Where the library comes from: building the package (``pip install``, ``pip install -e``;
``setup.py``) compiles it into ``ascend_offload/_native/`` (``libao_sparse.so`` and the
extension module ``_ao_fastcall``), so a serving host needs no compiler and the first
request pays no build. :func:`load` takes that build unless

* the package sits in a checkout (``csrc_npu/`` beside it, or ``$ASCEND_OFFLOAD_CSRC``)
  whose sources differ from the ones the build embeds (:mod:`ascend_offload.native_build`):
  a stale library is never loaded after a source edit;
* it was tuned for a CPU (``ASCEND_OFFLOAD_NATIVE_MARCH=native`` at install) and this CPU's
  feature list differs, or ``ASCEND_OFFLOAD_NATIVE_MARCH=0`` asks for a generic build.

Then, in a checkout only (development), the sources are compiled on first use into a
per-user cache keyed by a hash of the sources, flags, compiler and CPU (logged; atomic
rename, so concurrent processes never load a half-written file). An installed package
without a usable build returns ``None`` (logged once) and the callers use the pure-torch
twins. ctypes and a C ABI with no torch headers: one build serves every torch / torch_npu
version, x86-64 and aarch64.
"""

from __future__ import annotations

import array
import ctypes
import functools
import hashlib
import logging
import os
import platform
import sysconfig
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from ascend_offload import native_build

logger = logging.getLogger(__name__)

ABI_VERSION = 10
LIB_SOURCES = native_build.LIB_SOURCES
BASE_FLAGS = native_build.BASE_FLAGS


def installed_dir() -> Path:
    """Where the package build puts the library: ``ascend_offload/_native/``."""
    return Path(__file__).resolve().parent / "_native"


def source_dir() -> Path:
    """The C++ sources: ``$ASCEND_OFFLOAD_CSRC``, else ``csrc_npu/`` of the checkout the
    package sits in (absent from an installed package: no sources are shipped)."""
    env = os.environ.get("ASCEND_OFFLOAD_CSRC")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[1] / "csrc_npu"


def _checkout_sources(names: Iterable[str]) -> Path | None:
    src = source_dir()
    return src if all((src / n).is_file() for n in names) else None


def cache_dir() -> Path:
    env = os.environ.get("ASCEND_OFFLOAD_NATIVE_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ascend_offload" / "native"


def build(sources: tuple[str, ...], name: str, *, quiet: bool = False,
          flags: tuple[str, ...] = (), openmp: bool = True,
          march: str | None = None) -> Path | None:
    """Compile ``sources`` from :func:`source_dir` into the per-user cache (the
    development fallback, and the bench's baseline): ``lib<name>.so`` under a key
    hashing the sources and the headers they include, flags, compiler, machine and CPU
    tuning, so an edit or an upgrade rebuilds and a cache shared by different CPUs never
    hands one of them instructions it lacks. ``march``: ``native`` or ``generic`` (default:
    ``$ASCEND_OFFLOAD_NATIVE_MARCH``, see :func:`native_build.wanted_march`);
    ``flags`` are extra compiler flags. Returns the library path or ``None``."""
    cxx = native_build.compiler()
    src_dir = source_dir()
    paths = [src_dir / s for s in sources]
    if cxx is None:
        _log_once(quiet, "no C++ compiler (g++) found")
        return None
    if not all(p.is_file() for p in paths):
        _log_once(quiet, f"native sources missing under {src_dir}")
        return None
    tune, features = native_build.tune_flags(march)
    digest = hashlib.sha256()
    for file in native_build.source_files(src_dir, sources):  # the headers too
        digest.update(file.encode())
        digest.update((src_dir / file).read_bytes())
    for part in (" ".join((*BASE_FLAGS, *flags)), native_build.compiler_id(cxx),
                 platform.machine(), " ".join(tune), features, str(openmp)):
        digest.update(part.encode() + b"\0")
    lib = cache_dir() / digest.hexdigest()[:20] / f"lib{name}.so"
    if lib.is_file():
        return lib
    try:
        errors = native_build.compile_library(paths, lib, flags=flags, march=march,
                                              openmp=openmp)
    except OSError as exc:
        errors = [f"cannot write {lib}: {exc}"]
    if errors:
        _log_once(quiet, "native build failed: " + " | ".join(errors))
        return None
    return lib


_logged: set[str] = set()


def _log_once(quiet: bool, msg: str) -> None:
    if quiet or msg in _logged:
        return
    _logged.add(msg)
    logger.warning("ascend_offload.native: %s; using the pure-torch fallbacks", msg)


def _unusable(path: Path, sources: tuple[str, ...]) -> str | None:
    """Why the package's build at ``path`` must not be loaded here, or ``None``."""
    if not path.is_file():
        return f"no native build at {path}"
    info = native_build.read_build_info(path)
    if info is None:
        return f"{path} carries no build info (built by an older version)"
    if info.get("march") == native_build.TUNED:
        if os.environ.get(native_build.MARCH_ENV) == "0":
            return (f"{path} is tuned for its build host's CPU and "
                    f"{native_build.MARCH_ENV}=0 asks for a generic build")
        if native_build.digest(native_build.cpu_features()) != info.get("cpu"):
            return f"{path} was tuned for a CPU with other features than this one"
    src = _checkout_sources(sources)
    if src is not None and native_build.source_digest(src, sources) != info.get("src"):
        return f"{path} is stale: the sources in {src} changed since it was built"
    return None


def _package_build_or_fallback(file: str, sources: tuple[str, ...], name: str, *,
                               quiet: bool = False, can_build: bool = True,
                               flags: tuple[str, ...] = (), openmp: bool = True,
                               march: str | None = None) -> Path | None:
    """The package's build of ``sources`` when usable, else (checkout only, and when
    ``can_build``) the development build into the cache (:func:`build` with ``flags``,
    ``openmp``, ``march``), else ``None`` with the reason logged."""
    path = installed_dir() / file
    why = _unusable(path, sources)
    if why is None:
        return path
    if _checkout_sources(sources) is None:
        hint = ("the package was built without a working C++ compiler; reinstall it with "
                "g++ on PATH" if not path.is_file() else "reinstall the package")
        _log_once(quiet, f"{why} ({hint})")
        return None
    if not can_build:
        return None
    if not quiet:
        # A missing in-place build is the normal state of a fresh checkout; a stale one
        # means an edit since `pip install -e .`: both cost one build on first use.
        level = logging.INFO if not path.is_file() else logging.WARNING
        logger.log(level, "ascend_offload.native: %s; building %s from %s on first use "
                   "(`pip install -e .` or `python setup.py build_ext --inplace` builds "
                   "it in place)", why, name, source_dir())
    return build(sources, name, quiet=quiet, flags=flags, openmp=openmp, march=march)


_loaded: dict[str, str] = {}


@functools.cache
def load() -> ctypes.CDLL | None:
    """The residency/row-copy library, or ``None`` when none can be loaded."""
    if os.environ.get("ASCEND_OFFLOAD_DISABLE_NATIVE") == "1":
        _log_once(False, "native residency disabled by ASCEND_OFFLOAD_DISABLE_NATIVE=1")
        return None
    path = _package_build_or_fallback(native_build.LIB_FILE, LIB_SOURCES,
                                      native_build.LIB_NAME)
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        _log_once(False, f"cannot load {path}: {exc}")
        return None
    abi = lib.ao_res_abi_version()
    if abi != ABI_VERSION:
        _log_once(False, f"{path} has ABI {abi}, expected {ABI_VERSION}")
        return None
    _declare(lib)
    _loaded.update(native_build.read_build_info(path) or {}, path=str(path))
    return lib


def loaded_build() -> dict[str, str]:
    """Where the loaded library came from: ``path``, ``src`` (sources' digest) and
    ``march`` (``generic`` / ``native``); empty when none is loaded."""
    return dict(_loaded) if load() is not None else {}


Call3 = Callable[[int, int, int, int, bool], int]


@functools.cache
def fastcall() -> Call3 | None:
    """``call3(fn, a, b, c, release_gil)``: the CPython fast-call trampoline
    (``csrc_npu/fastcall.cpp``, the extension ``ascend_offload/_native/_ao_fastcall``)
    for C functions taking three pointers, or ``None`` (not built,
    ``ASCEND_OFFLOAD_NATIVE_FASTCALL=0``): the callers then use ctypes. The development
    fallback builds it per interpreter ABI (headers' path and extension suffix in the
    cache key)."""
    if os.environ.get("ASCEND_OFFLOAD_NATIVE_FASTCALL") == "0":
        return None
    abi = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    include = sysconfig.get_paths().get("include") or ""
    # The define is unused by the source: it puts the interpreter ABI into the cache key.
    path = _package_build_or_fallback(
        f"{native_build.FASTCALL_MODULE}{abi}", native_build.FASTCALL_SOURCES, "ao_fastcall",
        quiet=True, can_build=(Path(include) / "Python.h").is_file(), openmp=False,
        march=native_build.GENERIC, flags=(f"-I{include}", f"-DAO_PY_ABI=\"{abi}\""))
    if path is None:
        return None
    import importlib.machinery
    import importlib.util

    name = native_build.FASTCALL_MODULE
    try:
        loader = importlib.machinery.ExtensionFileLoader(name, str(path))
        spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
        assert spec is not None
        mod = importlib.util.module_from_spec(spec)
        loader.exec_module(mod)
    except (ImportError, OSError, AssertionError) as exc:
        logger.debug("ascend_offload.native: fast-call module unusable (%s); ctypes it is", exc)
        return None
    return mod.call3


def address_of(lib: ctypes.CDLL, name: str) -> int:
    """The address of C function ``name`` in ``lib`` (for :func:`fastcall`)."""
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0


def caller3(name: str) -> Callable[[int, int, int], int]:
    """``f(a, b, c) -> int`` calling the loaded library's three-pointer C function ``name``
    through :func:`fastcall` when it builds, else through ctypes. Keeps the GIL (for
    short calls). Raises ``RuntimeError`` when the library is not loaded."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"native {name} unavailable")
    fn = getattr(lib, name)
    fast = fastcall()
    if fast is None:
        return lambda a, b, c: int(fn(a, b, c))
    addr = address_of(lib, name)
    return lambda a, b, c: fast(addr, a, b, c, False)


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
    for name in ("ao_copy_rows_layers", "ao_copy_rows_strided"):
        if hasattr(lib, name):  # an installed build of older sources lacks it
            getattr(lib, name).restype = i64
            getattr(lib, name).argtypes = [vp, i64, vp, vp, i64]
    for name in ("ao_dres_resolve", "ao_dres_gather"):  # fast-call shape too
        getattr(lib, name).restype = i64
        getattr(lib, name).argtypes = [vp, vp, vp]
    lib.ao_dres_num_args.restype = i64
    lib.ao_dres_num_args.argtypes = []
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


def int32_rows(rows: Sequence[int] | torch.Tensor) -> torch.Tensor | array.array:
    """Row indices as a contiguous int32 buffer for the C ABI: a tensor stays one
    (converted if need be, :func:`int32_index`); a list becomes an :func:`int32_array`."""
    if isinstance(rows, torch.Tensor):
        return int32_index(rows)
    return int32_array(rows)


def buffer_address(buf: torch.Tensor | array.array) -> int:
    """The address of an :func:`int32_rows` buffer."""
    return buf.data_ptr() if isinstance(buf, torch.Tensor) else buf.buffer_info()[0]


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


def has_layer_copy() -> bool:
    """Whether the loaded library has :func:`copy_layer_rows`."""
    lib = load()
    return lib is not None and hasattr(lib, "ao_copy_rows_layers")


def layer_table(layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> ctypes.Array:
    """The argument table of :func:`copy_layer_rows` for ``(src, dst)`` pairs of
    contiguous host tensors whose rows (dim 0) have the same byte size within a pair.
    The table holds raw addresses: keep the tensors alive while it is used."""
    out = (ctypes.c_int64 * (5 * len(layers)))()
    for i, (src, dst) in enumerate(layers):
        row_bytes = src.nbytes // src.shape[0] if src.shape[0] else 0
        if not (src.is_contiguous() and dst.is_contiguous()) or (
                dst.shape[0] and dst.nbytes // dst.shape[0] != row_bytes):
            raise ValueError(f"layer {i}: rows differ or tensors are not contiguous")
        out[5 * i: 5 * i + 5] = [src.data_ptr(), src.shape[0], dst.data_ptr(), dst.shape[0], row_bytes]
    return out


def copy_layer_rows(table: ctypes.Array, layers: int, src_idx: int, dst_idx: int, n: int) -> int:
    """``dst_l[dst_idx[i]] = src_l[src_idx[i]]`` for every layer ``l`` of a
    :func:`layer_table`, in one native call (GIL released), one thread; int32 index
    arrays at the addresses ``src_idx``/``dst_idx``. Returns 0, or -(i + 1) for the
    first index pair out of range (nothing is copied then). Why: a worker page pool
    moves the same rows of every layer; a call per layer cost ~6 us of Python each."""
    lib = load()
    if lib is None or not hasattr(lib, "ao_copy_rows_layers"):
        raise RuntimeError("native layer row copy unavailable")
    return int(lib.ao_copy_rows_layers(ctypes.addressof(table), layers, src_idx, dst_idx, n))


def has_strided_copy() -> bool:
    """Whether the loaded library has :func:`copy_strided_rows`."""
    lib = load()
    return lib is not None and hasattr(lib, "ao_copy_rows_strided")


def strided_table(layers: Sequence[tuple[torch.Tensor, int, int, torch.Tensor]]) -> ctypes.Array:
    """The argument table of :func:`copy_strided_rows`: per layer ``(buffer, offset,
    pitch, dst)``: source row ``i`` is the ``dst`` row size of bytes at ``offset + i *
    pitch`` in the contiguous host ``buffer``, ``dst`` a contiguous 2-D host tensor.
    Raw addresses: keep the tensors alive while the table is used."""
    out = (ctypes.c_int64 * (6 * len(layers)))()
    for i, (buf, offset, pitch, dst) in enumerate(layers):
        row = dst.nbytes // dst.shape[0] if dst.shape[0] else 0
        if not (buf.is_contiguous() and dst.is_contiguous()) or pitch < row or offset < 0:
            raise ValueError(f"layer {i}: tensors not contiguous, or rows of {row} bytes at pitch {pitch}")
        rows = (buf.nbytes - offset - row) // pitch + 1 if buf.nbytes >= offset + row else 0
        out[6 * i: 6 * i + 6] = [buf.data_ptr() + offset, rows, pitch, dst.data_ptr(), dst.shape[0], row]
    return out


def copy_strided_rows(table: ctypes.Array, layers: int, src_idx: int, dst_idx: int, n: int) -> int:
    """``dst_l[dst_idx[i]] = row src_idx[i] of layer l's source`` for every layer of a
    :func:`strided_table`, in one native call (GIL released), one thread; int32 index
    arrays at the addresses ``src_idx``/``dst_idx``. Returns 0, or -(i + 1) for the
    first index pair out of range (nothing is copied then)."""
    lib = load()
    if lib is None or not hasattr(lib, "ao_copy_rows_strided"):
        raise RuntimeError("native strided row copy unavailable")
    return int(lib.ao_copy_rows_strided(ctypes.addressof(table), layers, src_idx, dst_idx, n))


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
    from ascend_offload import device  # imports this module: resolved at call time

    if not (device.is_host(src) and device.is_host(dst)):
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
