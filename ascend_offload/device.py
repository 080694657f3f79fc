"""The one place that knows NPU / CUDA / CPU.

Everything else asks this module for streams, events, pinned host memory and
batched row copies, so the domain code runs unchanged on an Ascend NPU, a CUDA
GPU and vLLM's CPU backend (where streams and events are ordered no-ops: every
CPU op is synchronous with respect to the issuing thread).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Iterator
from typing import Any, Literal

import torch

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


def is_accelerator(t: torch.Tensor) -> bool:
    return t.device.type in ("npu", "cuda")


def empty_host(shape: tuple[int, ...] | list[int], dtype: torch.dtype, *, pinned: bool = True) -> torch.Tensor:
    """Host memory for DMA. Pinned only when an accelerator exists (CPU torch cannot pin)."""
    pin = pinned and platform() != "cpu"
    return torch.empty(tuple(shape), dtype=dtype, pin_memory=pin)


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


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous host tensor (for stores and transports)."""
    if t.device.type != "cpu":
        raise ValueError(f"tensor_bytes needs a host tensor, got {t.device}")
    if not t.is_contiguous():
        raise ValueError("tensor_bytes needs a contiguous tensor")
    return memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")
