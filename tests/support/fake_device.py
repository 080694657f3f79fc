"""A fake accelerator for tests on a host without one.

:class:`FakeDevice` is a :class:`~ascend_offload.device.MemoryModel`: tensors it
places (:meth:`FakeDevice.place`) are ordinary CPU tensors that ``device.is_host``
reports as device memory, and whose bytes may be touched only inside
``ascend_offload.device``'s copy functions (its ``device_access`` scope). Outside
it, any op that reads or writes their data raises :class:`FakeDeviceAccess`;
metadata (shape, strides, ``data_ptr``) and views stay allowed, as on a real
device. So a test that runs a connector path over placed KV proves both that the
path accepts device-resident KV and that every copy of it goes through
``device.py`` (the staging a real NPU/GPU would need).

A transport that cannot reach device memory must never be handed a device
address: :class:`GuardedEngine` is a loopback engine that refuses (and records)
any registration or read touching placed memory unless it is declared able to
reach device memory (``device_memory=True``, like Mooncake RDMA with GPUDirect
or MemFabric).

Why not a PrivateUse1 device: torch's Python backend registration needs every
op (empty, copy, index ops, views) reimplemented over a Python storage, and its
tensors have no host address a transport could read; a residency model over
real CPU memory tests the same decisions with real bytes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ascend_offload import device
from ascend_offload.transfer.base import LoopbackEngine, ReadOp, TransferError

# Tensor methods that read metadata only (properties arrive as ``__get__``).
_METADATA = frozenset({
    "size", "stride", "dim", "ndimension", "data_ptr", "element_size", "numel", "nelement",
    "is_contiguous", "storage_offset", "untyped_storage", "__len__", "__repr__", "__format__",
    "is_pinned", "get_device",
})


class FakeDeviceAccess(RuntimeError):
    """Device-resident bytes were touched outside ``ascend_offload.device``."""


class _Access(threading.local):
    depth = 0


_ACCESS = _Access()


def _storage_ptr(t: torch.Tensor) -> int:
    with torch._C.DisableTorchFunctionSubclass():
        return t.untyped_storage().data_ptr()


class FakeDeviceTensor(torch.Tensor):
    """A CPU tensor that behaves as device memory (see the module docstring)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _ACCESS.depth:
            return super().__torch_function__(func, types, args, kwargs)
        name = getattr(func, "__name__", "")
        if name == "__get__" or name in _METADATA:
            return super().__torch_function__(func, types, args, kwargs)
        if name == "__setitem__" or (name.endswith("_") and not name.startswith("_")) \
                or isinstance(kwargs.get("out"), FakeDeviceTensor):
            raise FakeDeviceAccess(f"{name}: writes device memory outside ascend_offload.device")
        fakes = {_storage_ptr(a) for a in (*args, *kwargs.values()) if isinstance(a, FakeDeviceTensor)}
        out = super().__torch_function__(func, types, args, kwargs)
        results = out if isinstance(out, (tuple, list)) else (out,)
        for r in results:
            if not isinstance(r, torch.Tensor) or _storage_ptr(r) not in fakes:
                raise FakeDeviceAccess(f"{name}: reads device memory outside ascend_offload.device")
        return out


class FakeDevice(device.MemoryModel):
    """Residency model: placed tensors are device memory; counts the copies that reach them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranges: list[tuple[int, int]] = []  # placed storages: (start, end)
        self.accesses = 0  # device_access scopes entered (outermost only)

    def is_host(self, t: torch.Tensor) -> bool:
        return not isinstance(t, FakeDeviceTensor)

    @contextlib.contextmanager
    def device_access(self) -> Iterator[None]:
        if not _ACCESS.depth:
            with self._lock:
                self.accesses += 1
        _ACCESS.depth += 1
        try:
            yield
        finally:
            _ACCESS.depth -= 1

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s memory as a device tensor (same storage: ``t`` itself stays a host view
        for the test's own assertions)."""
        storage = t.untyped_storage()
        with self._lock:
            self._ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
        return t.as_subclass(FakeDeviceTensor)

    def touches(self, addr: int, length: int) -> bool:
        """``[addr, addr + length)`` overlaps placed (device) memory."""
        with self._lock:
            return any(addr < hi and lo < addr + length for lo, hi in self._ranges)


@contextlib.contextmanager
def installed(fake: FakeDevice | None = None) -> Iterator[FakeDevice]:
    """Run the body with ``fake`` (a new one by default) as ``device``'s residency model."""
    fake = fake or FakeDevice()
    old = device.install_memory_model(fake)
    try:
        yield fake
    finally:
        device.install_memory_model(old)


class GuardedEngine(LoopbackEngine):
    """Loopback engine that refuses device addresses unless it can reach device memory.

    ``violations`` lists every refused registration or read range; a test asserts it
    stays empty (the refusal also fails the call, as a real host-only transport would).
    """

    def __init__(self, fake: FakeDevice, *, device_memory: bool = False) -> None:
        super().__init__()
        self.fake = fake
        self.device_memory = device_memory
        self.violations: list[tuple[str, int, int]] = []
        self.registered: list[tuple[int, int]] = []
        self.read_ranges: list[tuple[int, int]] = []  # local ranges of every read

    def _check(self, what: str, addr: int, length: int) -> None:
        if not self.device_memory and self.fake.touches(addr, length):
            self.violations.append((what, addr, length))
            raise TransferError(f"{what} [{addr:#x}, +{length}) is device memory; this engine reads host only")

    def register(self, addr: int, length: int) -> None:
        self._check("register", addr, length)
        self.registered.append((addr, length))
        super().register(addr, length)

    def _read(self, peer: str, ops: Sequence[ReadOp]) -> None:
        for op in ops:
            self._check("read into", op.local_addr, op.length)
            self._check("read from", op.remote_addr, op.length)
            self.read_ranges.append((op.local_addr, op.length))
        super()._read(peer, ops)
