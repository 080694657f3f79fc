"""The one place that knows NPU / CUDA / CPU.

Everything else asks this module for streams, events, pinned host memory and
batched row copies, so the domain code runs unchanged on an Ascend NPU, a CUDA
GPU and vLLM's CPU backend (where streams and events are ordered no-ops: every
CPU op is synchronous with respect to the issuing thread).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import importlib.util
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch

from ascend_offload import native  # the C++ host library (lazy build; imports torch only)

Platform = Literal["npu", "cuda", "cpu"]


@functools.cache
def platform() -> Platform:
    """Detect the accelerator once: torch_npu wins, then CUDA, else CPU."""
    if importlib.util.find_spec("torch_npu") is not None:
        try:
            import torch_npu  # noqa: F401

            if torch.npu.is_available():  # type: ignore[attr-defined]
                return "npu"
        except Exception:  # broken driver install: fall through to the next platform
            pass
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def _mod() -> Any:
    """The torch submodule that owns streams/events for the current platform."""
    p = platform()
    return getattr(torch, p) if p != "cpu" else None


def device() -> torch.device:
    p = platform()
    return torch.device(p, 0) if p != "cpu" else torch.device("cpu")


class MemoryModel:
    """Which tensors live in host memory, and the scope in which this module touches the
    others. The one seam for "where is this tensor": every residency question in the
    package is :func:`is_host`, answered here.

    Why an object: tests run the device paths on a machine without an accelerator by
    installing a model that declares chosen CPU tensors device-resident and refuses any
    access to their bytes outside this module's copy functions
    (the repository's ``tests/support/fake_device.py``, not shipped). The default answers
    by ``t.device``.
    """

    def is_host(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu"

    def device_access(self) -> contextlib.AbstractContextManager[None]:
        """Entered by this module around every op that reads or writes device memory."""
        return contextlib.nullcontext()


_memory: MemoryModel = MemoryModel()


def install_memory_model(model: MemoryModel) -> MemoryModel:
    """Replace the residency model (a fake device in tests); returns the previous one."""
    global _memory
    old, _memory = _memory, model
    return old


def is_host(t: torch.Tensor) -> bool:
    """``t`` is in host memory (addressable by native code, stores and host-only transports)."""
    return _memory.is_host(t)


def is_accelerator(t: torch.Tensor) -> bool:
    """``t`` is device memory: reach it only through this module's copies."""
    return not _memory.is_host(t)


def host_addressable_pages(kv: torch.Tensor, dim: int) -> bool:
    """Each page ``kv.select(dim, b)`` is contiguous memory the host can address: stores
    and native copies move it in place, with no staging through a host buffer."""
    return is_host(kv) and kv.select(dim, 0).is_contiguous()


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h, same value on x86-64 and aarch64


def _advise_huge_pages(t: torch.Tensor) -> None:
    """Ask Linux for transparent huge pages on a large host buffer (best effort).

    Why: KV pools are read at random rows (sparse onload, store loads); with 4 KiB
    pages nearly every row costs a TLB miss, measured ~1.4x slower on 1 KiB rows
    from a 256 MiB pool here. No-op off Linux, for small buffers, or when THP is off.
    """
    if sys.platform != "linux" or t.nbytes < 16 * _HUGE_PAGE:
        return
    start = (t.data_ptr() + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
    end = (t.data_ptr() + t.nbytes) & ~(_HUGE_PAGE - 1)
    if end <= start:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass


def empty_host(shape: tuple[int, ...] | list[int], dtype: torch.dtype, *, pinned: bool = True) -> torch.Tensor:
    """Host memory for DMA, resident from the start.

    Pinned when an accelerator exists (CPU torch cannot pin). On CPU the buffer is
    backed by huge pages where the kernel allows and zero-filled now, so it is
    resident like pinned memory: otherwise the first write of every page faults
    on the data path (measured: a 1 MiB layer save 0.75-1.2 ms into fresh pages,
    0.24 ms into resident ones). The contents are zeros, not a promise: callers
    still treat the buffer as uninitialised.
    """
    pin = pinned and platform() != "cpu"
    t = torch.empty(tuple(shape), dtype=dtype, pin_memory=pin)
    if not pin and t.numel():
        _advise_huge_pages(t)
        t.zero_()
    return t


# ----------------------------------------------------------------- streams/events


class _NullStream:
    """CPU stand-in: work is already ordered on the calling thread."""

    def synchronize(self) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None


class _NullEvent:
    def record(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def wait(self, stream: Any = None) -> None:
        return None


def new_stream() -> Any:
    m = _mod()
    return m.Stream() if m is not None else _NullStream()


def current_stream() -> Any:
    m = _mod()
    return m.current_stream() if m is not None else _NullStream()


def new_event() -> Any:
    m = _mod()
    return m.Event() if m is not None else _NullEvent()


@contextlib.contextmanager
def stream_context(stream: Any) -> Iterator[None]:
    """Run the body on ``stream`` (a no-op on CPU)."""
    m = _mod()
    if m is None or isinstance(stream, _NullStream):
        yield
        return
    with m.stream(stream):
        yield


def synchronize() -> None:
    m = _mod()
    if m is not None:
        m.synchronize()


def record_after_compute() -> Any:
    """An event recorded on the compute stream: copies that wait on it see finished KV."""
    ev = new_event()
    ev.record(current_stream())
    return ev


def device_name() -> str | None:
    """The accelerator's name (a bench records which device it measured); None on CPU."""
    m = _mod()
    return str(m.get_device_name(0)) if m is not None else None


# ----------------------------------------------------------------- captured graphs


def graph_capture_supported() -> bool:
    """Device work can be captured and replayed as a graph here: CUDA (no NPU graph
    capture is wired in this module)."""
    return platform() == "cuda"


def compiles_tensor_ops(where: torch.device | str) -> bool:
    """``torch.compile`` (inductor) is known to compile the device residency's tensor ops
    well for tensors on ``where``: CUDA with Triton (fewer, fused kernels: 2.5-2.8x less
    time per layer than the eager ops, each inside a CUDA graph, on an H200). Not the CPU:
    there the C++ kernel or the plain ops run, nothing is captured, and a compile costs
    tens of seconds per shape. Not an NPU: torch_npu's inductor path is not established here."""
    return (torch.device(where).type == "cuda"
            and importlib.util.find_spec("triton") is not None)


def run_on_side_stream(fn: Callable[[], Any]) -> Any:
    """``fn()`` on a fresh stream ordered after the current stream's queued work and
    before its later work. Why: a graph's warm-up must run on a side stream (CUDA
    graphs docs), so lazy initialisation happens before, not during, the capture."""
    side = new_stream()
    side.wait_stream(current_stream())
    with stream_context(side):
        out = fn()
    current_stream().wait_stream(side)
    return out


class CapturedGraph:
    """The device work of ``fn()`` recorded once (a CUDA graph) and replayed with one
    launch per :meth:`replay`.

    Capture records and executes nothing: warm ``fn`` up first
    (:func:`run_on_side_stream`), which does execute it. The tensors ``fn`` reads are
    the graph's static inputs (refill them in place before a replay); ``outputs`` (what
    ``fn`` returned) holds the results of the latest replay."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        if not graph_capture_supported():
            raise RuntimeError(f"graph capture is wired for CUDA only; this platform is "
                               f"{platform()}")
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph):
            self.outputs = fn()

    def replay(self) -> None:
        self._graph.replay()


# ----------------------------------------------------------------- device reads, mapped host memory

TOPK_READ = "sparse.topk"  # per layer: an indexer top-k handed to the host resolver
STEP_READ = "sparse.step"  # per step: the device resolver's error flags and totals
NEW_ROWS_READ = "sparse.new_rows"  # per layer: new main-KV rows for the host scatter
MOVE_READ = "sparse.move"  # per layer of a hybrid move: a request's resident rows to the pool
_reads: dict[str, int] = {}
_reads_lock = threading.Lock()


def host_read(t: torch.Tensor, *, reason: str) -> torch.Tensor:
    """``t`` for host code, counted under ``reason`` whether or not bytes move: on an
    NPU/GPU a device -> host copy the host waits for (a stream synchronization), on CPU
    the tensor itself. Why counted: the sparse decode path shows it reads nothing per
    layer with the device resolver, and what the host resolver reads (:func:`host_reads`)."""
    with _reads_lock:
        _reads[reason] = _reads.get(reason, 0) + 1
    if is_host(t):
        return t
    with _memory.device_access():
        return t.to("cpu")


def host_reads() -> dict[str, int]:
    """Totals of :func:`host_read` by reason, since the process started."""
    with _reads_lock:
        return dict(_reads)


def host_read_counts(reasons: Sequence[str]) -> tuple[int, ...]:
    """The totals of :func:`host_read` for ``reasons``, in that order (what a per-step
    report reads: no copy of the whole table)."""
    with _reads_lock:
        return tuple([_reads.get(r, 0) for r in reasons])


def device_view_of_host(t: torch.Tensor) -> torch.Tensor | None:
    """A compute-device tensor over the bytes of contiguous host tensor ``t`` (device
    kernels then gather from and scatter into host memory without a host-side copy),
    or ``None`` where this platform has no such path here.

    CPU: ``t`` itself. CUDA: pinned memory is mapped into the unified address space
    (memory not pinned is registered first, ``cudaHostRegister``); the view is made
    through ``__cuda_array_interface__`` and checked by reading its first bytes back.
    NPU: ``None`` (no torch_npu call for a device view of host memory is wired here):
    the caller keeps the host path."""
    p = platform()
    if p == "cpu":
        return t
    if p != "cuda" or not t.is_contiguous() or t.numel() == 0:
        return None
    nbytes = t.numel() * t.element_size()
    if not t.is_pinned():
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
        if int(getattr(err, "value", err)) != 0:
            return None

    class _Mapped:  # keeps ``t`` alive as long as the view
        host = t
        __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "version": 3,
                                    "data": (t.data_ptr(), False), "strides": None}

    try:
        raw = torch.as_tensor(_Mapped(), device=device())
    except (RuntimeError, TypeError, ValueError):
        return None
    n = min(nbytes, 64)
    if not torch.equal(raw[:n].cpu(), t.view(-1).view(torch.uint8)[:n]):
        return None
    return raw.view(t.dtype).view(t.shape)


# ----------------------------------------------------------------- host <-> device staging


def blocks_from_host(rows: torch.Tensor, kv: torch.Tensor, dim: int, block_ids: Sequence[int],
                     stream: Any) -> None:
    """``kv.select(dim, block_ids[i]) = rows[i]`` for host ``rows`` (staged pages): one
    H2D copy and one scatter on ``stream``, finished when this returns.

    Why: a layer's store objects are read into one host staging buffer, then moved to
    the device KV tensor in one transfer instead of one small copy per block.
    """
    with _memory.device_access(), stream_context(stream):
        idx = torch.tensor(block_ids, dtype=torch.long)
        kv.index_copy_(dim, idx.to(kv.device), rows.to(kv.device, non_blocking=True).movedim(0, dim))
        stream.synchronize()


def blocks_to_host(kv: torch.Tensor, dim: int, block_ids: Sequence[int], stream: Any) -> torch.Tensor:
    """The pages ``kv.select(dim, b)`` of ``block_ids`` as host rows (``[len, *page]``): one
    gather and one D2H copy on ``stream`` into fresh host memory, finished when this returns.

    Why: a layer's save reads all its blocks off the device in one transfer; the store
    then writes each object from the host rows.
    """
    with _memory.device_access(), stream_context(stream):
        idx = torch.tensor(block_ids, dtype=torch.long)
        picked = kv.index_select(dim, idx.to(kv.device)).movedim(dim, 0)
        host = empty_host(tuple(picked.shape), kv.dtype)
        host.copy_(picked, non_blocking=True)
        stream.synchronize()
    return host


# Above this many runs of consecutive blocks a mirror copy gathers (one index kernel, one
# transfer) instead of copying each run: on a device every copy is a launch, the reason
# blocks_to_host gathers too. Not measured on an accelerator here; on the CPU fake device
# the per-run copies are memcpy-bound and no slower.
_MIRROR_RUNS = 8


class HostMirror:
    """Pinned host twins of device KV tensors, for transports that reach host memory only.

    A twin has its tensor's exact layout (shape, strides, offset) over a pinned copy of
    the tensor's whole storage, so a wire layout described on the twin addresses block
    ``b`` exactly where the device tensor has it: the P/D protocol is unchanged and peers
    cannot tell a staged rank from a direct one. Tensors sharing a storage (layers that
    alias one buffer) share one twin, so the host memory equals the device KV's.

    :meth:`to_host` (publisher: before peers may read) and :meth:`from_host` (reader:
    after a read landed) move whole blocks, one copy per run of consecutive block ids on
    the mirror's own stream, finished when they return. A reader's copy does not wait for
    the compute stream (the blocks it fills belong to no running request), so a read never
    queues behind a forward. Thread-safe (decode's reader threads land reads concurrently;
    copies run one at a time). Cost: pinned host memory equal to the mirrored KV.
    """

    def __init__(self) -> None:
        self._storages: dict[int, torch.Tensor] = {}  # device storage address -> host bytes
        self._stream: Any = None
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self._storages.values())

    def twin(self, t: torch.Tensor) -> torch.Tensor:
        """The host tensor with ``t``'s layout over the mirror of ``t``'s storage."""
        storage = t.untyped_storage()
        key = storage.data_ptr()
        with self._lock:
            host = self._storages.get(key)
            if host is None:
                host = self._storages[key] = empty_host((storage.nbytes(),), torch.uint8)
        return host.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())

    def to_host(self, t: torch.Tensor, block_ids: Sequence[int]) -> None:
        """``twin(t)[b] = t[b]`` for ``b`` in ``block_ids`` (dim 0), after the work already
        queued on the current stream (the compute that wrote them)."""
        self._copy(t, block_ids, to_host=True)

    def from_host(self, t: torch.Tensor, block_ids: Sequence[int]) -> None:
        """``t[b] = twin(t)[b]`` for ``b`` in ``block_ids`` (dim 0); on device when this returns."""
        self._copy(t, block_ids, to_host=False)

    def _copy(self, t: torch.Tensor, block_ids: Sequence[int], *, to_host: bool) -> None:
        if not len(block_ids):
            return
        host = self.twin(t)
        with self._lock, _memory.device_access():
            if self._stream is None:
                self._stream = new_stream()
            if to_host:  # the blocks were written by compute queued on the current stream
                self._stream.wait_stream(current_stream())
            spans = runs(sorted(set(block_ids)))
            if len(spans) > _MIRROR_RUNS:  # scattered: one gather and one transfer, not a copy per run
                ids = [b for _, first, k in spans for b in range(first, first + k)]
                index = torch.tensor(ids, dtype=torch.long)
                if to_host:
                    host.index_copy_(0, index, blocks_to_host(t, 0, ids, self._stream))
                else:
                    blocks_from_host(host.index_select(0, index), t, 0, ids, self._stream)
                return
            with stream_context(self._stream):
                for _, first, k in spans:
                    dev, hst = t[first : first + k], host[first : first + k]
                    if to_host:
                        hst.copy_(dev, non_blocking=True)
                    else:
                        dev.copy_(hst, non_blocking=True)
                self._stream.synchronize()


# ----------------------------------------------------------------- batched copies


def _as_index(idx: torch.Tensor | list[int], like: torch.Tensor) -> torch.Tensor:
    if not isinstance(idx, torch.Tensor):
        idx = torch.tensor(idx, dtype=torch.long)
    if idx.dtype != torch.long:
        idx = idx.long()
    if idx.device != like.device:
        idx = idx.to(like.device, non_blocking=True)
    return idx


def gather_rows(src: torch.Tensor, idx: torch.Tensor | list[int], out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[i] = src[idx[i]]`` along dim 0, one batched op."""
    with _memory.device_access():
        index = _as_index(idx, src)
        if out is None:
            return torch.index_select(src, 0, index)
        if out.device == src.device:
            torch.index_select(src, 0, index, out=out)
        else:
            out.copy_(torch.index_select(src, 0, index), non_blocking=True)
        return out


def scatter_rows(src: torch.Tensor, idx: torch.Tensor | list[int], dst: torch.Tensor) -> torch.Tensor:
    """``dst[idx[i]] = src[i]`` along dim 0, one batched op (indices must be unique)."""
    with _memory.device_access():
        index = _as_index(idx, dst)
        if src.device != dst.device:
            src = src.to(dst.device, non_blocking=True)
        dst.index_copy_(0, index, src)
        return dst


def copy_rows(
    src: torch.Tensor,
    src_idx: torch.Tensor | list[int],
    dst: torch.Tensor,
    dst_idx: torch.Tensor | list[int],
) -> None:
    """``dst[dst_idx[i]] = src[src_idx[i]]``: gather on the source side, scatter on the other."""
    n = len(src_idx)
    if n != len(dst_idx):
        raise ValueError(f"copy_rows: {n} source rows but {len(dst_idx)} destination rows")
    if n == 0:
        return
    rows = gather_rows(src, src_idx)
    scatter_rows(rows, dst_idx, dst)


def _host_row_bytes(t: torch.Tensor) -> int:
    """Bytes per dim-0 row of a contiguous host tensor with rows, else 0."""
    if not is_host(t) or t.dim() < 1 or t.shape[0] == 0 or not t.is_contiguous():
        return 0
    return t.numel() // t.shape[0] * t.element_size()


def copy_host_rows(src: torch.Tensor, src_rows: Sequence[int] | torch.Tensor, dst: torch.Tensor,
                   dst_rows: Sequence[int] | torch.Tensor) -> bool:
    """``dst[dst_rows[i]] = src[src_rows[i]]`` between contiguous host tensors whose rows
    have the same byte size, in one native call; False (nothing copied) when the native
    library is unavailable or disabled or the layout does not fit: use :func:`move_rows`.
    Raises ``IndexError`` naming the first out-of-range row (nothing is copied then).

    Why: a store load or save of a layer's blocks on the CPU backend runs next to the
    model thread (whole-prefix mode calls it from the worker; layerwise runs the same
    row copy on its native copy queue). The native copy holds the GIL for none of it
    (one ctypes call) and streams the stores; the plan + index-kernel path spent ~20 us of
    GIL time per call on planning and moved 20 MiB layers in ~2.1 ms against ~1.4 ms
    (bench layerwise, same process, alternating: docs/bench-layerwise.md). Every 50 us
    of I/O-thread Python per layer slowed the model thread by ~4 % there, so this call
    keeps its own Python to a few microseconds (no tensor ops for the indices)."""
    n = len(src_rows)
    if n == 0 or not native.available():
        return n == 0
    row_bytes = _host_row_bytes(src)
    if row_bytes == 0 or row_bytes != _host_row_bytes(dst) or len(dst_rows) != n:
        return False
    sidx, didx = native.int32_rows(src_rows), native.int32_rows(dst_rows)
    rc = native.copy_byte_rows(src.data_ptr(), src.shape[0], native.buffer_address(sidx),
                               dst.data_ptr(), dst.shape[0], native.buffer_address(didx), n,
                               row_bytes)
    if rc < 0:
        i = -rc - 1
        raise IndexError(f"copy_host_rows: index {i} out of range (src row {int(sidx[i])} of "
                         f"{src.shape[0]}, dst row {int(didx[i])} of {dst.shape[0]})")
    return True


def as_words(t: torch.Tensor) -> torch.Tensor:
    """View a tensor with contiguous rows (dim 0) as ``[rows, words]`` of the widest
    integer type dividing the row size. Why: CPU index kernels move one element per
    iteration, so 8-byte words copy ~8x faster than bytes (measured in bench store)."""
    rows = t.shape[0]
    flat = t.reshape(rows, -1)
    if flat.stride(-1) != 1 or (rows > 1 and flat.stride(0) != flat.shape[1]):
        raise ValueError("as_words needs contiguous rows")
    flat = flat.view(torch.uint8)
    nbytes = flat.shape[1]
    for dtype, width in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if nbytes % width == 0 and flat.data_ptr() % width == 0:
            return flat.view(dtype)
    return flat


_SMALL_RUNS = 64  # below this many indices a Python loop beats numpy's per-call overhead


def runs(idx: list[int] | Any) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive values: (position in idx, first value, length)."""
    import numpy as np

    if isinstance(idx, (list, tuple, range)) and len(idx) <= _SMALL_RUNS:
        # Why: per-layer plans of a few blocks run next to the model thread; each numpy call
        # costs ~5-10 us of GIL time the model thread then waits for.
        out: list[tuple[int, int, int]] = []
        start = 0
        for i in range(1, len(idx) + 1):
            if i == len(idx) or idx[i] != idx[i - 1] + 1:
                out.append((start, int(idx[start]), i - start))
                start = i
        return out
    arr = np.asarray(idx, dtype=np.int64)
    if arr.size == 0:
        return []
    starts = np.concatenate(([0], np.flatnonzero(np.diff(arr) != 1) + 1))
    ends = np.concatenate((starts[1:], [arr.size]))
    return [(int(p), int(arr[p]), int(e - p)) for p, e in zip(starts, ends, strict=True)]


def _void_rows(t: torch.Tensor) -> Any:
    """A host 2-D tensor as a 1-D numpy array of opaque row-sized elements: numpy
    moves each element with one memcpy, which beats torch's per-word index kernels
    for scatters (measured: ~1.0x a plain copy for 64 KiB rows, torch ~0.6x)."""
    import numpy as np

    arr = t.numpy()
    return arr.view(np.uint8).view(np.dtype((np.void, arr.shape[1] * arr.itemsize))).reshape(arr.shape[0])


@dataclasses.dataclass(frozen=True)
class RowPlan:
    """How to move rows ``src[src_idx[i]] -> dst[dst_idx[i]]``; computed once and
    reused for every layer of a job (the index work is the same for all)."""

    n: int
    gathers: tuple[tuple[int, int, torch.Tensor], ...]  # (dst first row, count, src index)
    src_idx: Any  # numpy int64
    dst_idx: Any
    src_run: tuple[int, int] | None  # the source rows are one consecutive run
    src32: torch.Tensor  # int32 copies for the native host row copy
    dst32: torch.Tensor


def plan_rows(src_idx: Sequence[int], dst_idx: Sequence[int]) -> RowPlan:
    import numpy as np

    n = len(src_idx)
    if n != len(dst_idx):
        raise ValueError(f"move_rows: {n} source rows but {len(dst_idx)} destination rows")
    s = np.asarray(src_idx, dtype=np.int64)
    d = np.asarray(dst_idx, dtype=np.int64)
    small = n <= _SMALL_RUNS
    d_runs = runs(list(dst_idx) if small else d)
    gathers: tuple[tuple[int, int, torch.Tensor], ...] = ()
    if n and len(d_runs) * 4 <= n + 3:
        gathers = tuple((first, k, torch.from_numpy(s[pos : pos + k].copy())) for pos, first, k in d_runs)
    s_runs = runs(list(src_idx) if small else s)
    src_run = (s_runs[0][1], n) if len(s_runs) == 1 else None
    return RowPlan(n=n, gathers=gathers, src_idx=s, dst_idx=d, src_run=src_run,
                   src32=torch.from_numpy(s.astype(np.int32)), dst32=torch.from_numpy(d.astype(np.int32)))


def move_rows(src: torch.Tensor, dst: torch.Tensor, plan: RowPlan) -> None:
    """Execute a :class:`RowPlan` between 2-D row views, in as few passes as possible:
    host to host with the native row copy (:func:`copy_host_rows`: bench store, same
    run: 1 MiB objects saved at 14.5 vs 10.4 GB/s, the worker path's 1.2 MiB pages at
    14.5-16.4 vs 10.9-11.1 GB/s); otherwise a run of consecutive destination rows is
    filled by one indexed gather straight into a contiguous slice, and host scatters
    move whole rows with memcpy."""
    if plan.n == 0:
        return
    if copy_host_rows(src, plan.src32, dst, plan.dst32):
        return
    with _memory.device_access():
        _move_rows_torch(src, dst, plan)


def _move_rows_torch(src: torch.Tensor, dst: torch.Tensor, plan: RowPlan) -> None:
    if plan.gathers:
        for first, k, index in plan.gathers:
            piece = dst[first : first + k]
            if index.device != src.device:
                index = index.to(src.device, non_blocking=True)
            if piece.device == src.device:
                torch.index_select(src, 0, index, out=piece)
            else:
                piece.copy_(torch.index_select(src, 0, index), non_blocking=True)
        return
    if is_host(src) and is_host(dst):
        dv, sv = _void_rows(dst), _void_rows(src)
        if plan.src_run is not None:
            first, n = plan.src_run
            dv[plan.dst_idx] = sv[first : first + n]
        else:
            dv[plan.dst_idx] = sv[plan.src_idx]
        return
    copy_rows(src, plan.src_idx.tolist(), dst, plan.dst_idx.tolist())


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous host tensor (for stores and transports)."""
    if not is_host(t):
        raise ValueError(f"tensor_bytes needs a host tensor, got {t.device}")
    if not t.is_contiguous():
        raise ValueError("tensor_bytes needs a contiguous tensor")
    if not t.numel():
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]  # numpy declares ndarray.__buffer__ for Python >= 3.12 only
