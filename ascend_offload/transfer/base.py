"""Contract for one-sided batched reads of registered memory.

Why a contract: decode pulls prefill's KV with whatever engine the platform has
(Mooncake over TCP/RDMA here, MemFabric on Ascend). The P/D code only ever
needs three things — register a buffer, name this engine's endpoint, and read a
batch of (remote -> local) byte runs from a peer — so that is all an engine
must provide. Per-descriptor cost dominates small reads (~50 us per row over
loopback TCP), so contiguous runs are merged before they reach the engine.
"""

from __future__ import annotations

import abc
import ctypes
import itertools
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ascend_offload.errors import AscendOffloadError

if TYPE_CHECKING:
    from ascend_offload.config import RemoteD2HConfig


class TransferError(AscendOffloadError, RuntimeError):
    """A read failed (peer gone, address not registered, engine error)."""


@dataclass(frozen=True, slots=True)
class ReadOp:
    """Copy ``length`` bytes from the peer's ``remote_addr`` into our ``local_addr``."""

    local_addr: int
    remote_addr: int
    length: int


def coalesce(ops: Iterable[ReadOp]) -> list[ReadOp]:
    """Merge runs that are contiguous on both sides into one descriptor.

    Ops are sorted by local address first (the order of independent reads does
    not matter). Overlapping destinations are a caller bug that would make the
    result depend on engine scheduling, so they are rejected.
    """
    out: list[ReadOp] = []
    for op in sorted(ops, key=lambda o: (o.local_addr, o.remote_addr)):
        if op.length < 0:
            raise ValueError(f"ReadOp length={op.length}: must be >= 0")
        if op.length == 0:
            continue
        if out:
            last = out[-1]
            if op.local_addr < last.local_addr + last.length:
                raise ValueError(
                    f"overlapping destinations: [{last.local_addr:#x}, +{last.length}) and "
                    f"[{op.local_addr:#x}, +{op.length})"
                )
            if (
                op.local_addr == last.local_addr + last.length
                and op.remote_addr == last.remote_addr + last.length
            ):
                out[-1] = ReadOp(last.local_addr, last.remote_addr, last.length + op.length)
                continue
        out.append(op)
    return out


class TransferEngine(abc.ABC):
    """One endpoint of a one-sided transfer engine."""

    name: str = "abstract"
    #: :meth:`register` may be given accelerator memory (RDMA with GPUDirect, MemFabric).
    #: False: the engine moves host memory only, and device-resident KV is staged
    #: through pinned host twins (``transfer/staged.py``).
    device_memory: bool = False

    @property
    @abc.abstractmethod
    def endpoint(self) -> str:
        """What a peer passes to :meth:`read` to reach this engine (e.g. ``host:port``)."""

    def register(self, addr: int, length: int) -> None:
        """Make ``[addr, addr + length)`` readable by peers and usable as a read target."""
        if length <= 0:
            raise ValueError(f"register length={length}: must be > 0")
        self._register(addr, length)

    @abc.abstractmethod
    def _register(self, addr: int, length: int) -> None:
        """Register a region whose length was checked."""

    @abc.abstractmethod
    def unregister(self, addr: int) -> None:
        """Undo :meth:`register` for the region starting at ``addr``."""

    @abc.abstractmethod
    def _read(self, peer: str, ops: Sequence[ReadOp]) -> None:
        """Run already-coalesced ops; raise :class:`TransferError` on failure."""

    def read(self, peer: str, ops: Iterable[ReadOp]) -> int:
        """Pull every op from ``peer`` in one batch; returns the descriptor count used."""
        batch = coalesce(ops)
        if batch:
            self._read(peer, batch)
        return len(batch)

    def start_read(self, peer: str, ops: Iterable[ReadOp]) -> PendingRead:
        """Begin :meth:`read` of ``ops`` and return at once; the bytes are in place when
        :meth:`PendingRead.wait` returns.

        Why: a reader that starts the next batch before waiting for the current one keeps
        the link busy across the bookkeeping between reads. The default defers the whole
        read to ``wait`` (same bytes, same order, no overlap), so an engine without
        asynchronous reads needs nothing. A started read must be waited for, even when
        its result no longer matters: until then bytes may still land.
        """
        return DeferredRead(self, peer, list(ops))

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release engine resources; the default has none."""


class PendingRead(abc.ABC):
    """A read begun by :meth:`TransferEngine.start_read`: in flight until :meth:`wait` ends it."""

    @abc.abstractmethod
    def wait(self) -> int:
        """Block until the read ended (within the engine's read deadline); the descriptor
        count, or :class:`TransferError`. Call it once."""


class DeferredRead(PendingRead):
    """An engine without asynchronous reads: the read runs, synchronously, in :meth:`wait`."""

    def __init__(self, engine: TransferEngine, peer: str, ops: Sequence[ReadOp]) -> None:
        self._engine = engine
        self._peer = peer
        self._ops = ops

    def wait(self) -> int:
        return self._engine.read(self._peer, self._ops)


class LibraryEngine(TransferEngine):
    """A transfer engine backed by a vendor library object with Mooncake's shape
    (``register_memory`` / ``unregister_memory`` / ``batch_transfer_sync_read``,
    0 = success): the registration bookkeeping and close both vendors share.

    The library objects are thread-safe for transfers, but registration and close
    must not race a read that is being set up, hence the lock.
    """

    def __init__(self, eng: Any, endpoint: str) -> None:
        self._eng = eng
        self._endpoint = endpoint
        self._regions: set[int] = set()
        self._lock = threading.Lock()
        self._closed = False

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def _register(self, addr: int, length: int) -> None:
        with self._lock:
            rc = self._eng.register_memory(addr, length)
            if rc != 0:
                raise TransferError(f"{self.name} register_memory({addr:#x}, {length}) failed rc={rc}")
            self._regions.add(addr)

    def unregister(self, addr: int) -> None:
        with self._lock:
            if addr in self._regions:
                self._eng.unregister_memory(addr)
                self._regions.discard(addr)

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"{self.name} engine is closed")

    def _batch_read(self, peer: str, ops: Sequence[ReadOp], what: str = "") -> None:
        """One ``batch_transfer_sync_read`` of every op; a TransferError naming the runs."""
        rc = self._eng.batch_transfer_sync_read(peer, [o.local_addr for o in ops],
                                                [o.remote_addr for o in ops], [o.length for o in ops])
        if rc != 0:
            total = sum(o.length for o in ops)
            raise TransferError(f"{self.name} read of {len(ops)} runs ({total} B) from {peer}"
                                f"{what} failed rc={rc}")

    def _shutdown(self) -> None:
        """After every region is unregistered: release the library object (default: nothing)."""

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            for addr in list(self._regions):
                self._eng.unregister_memory(addr)
            self._regions.clear()
            self._closed = True
        self._shutdown()


# ----------------------------------------------------------------- loopback


class _Registry:
    """Process-global table of loopback endpoints and their registered regions."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.regions: dict[str, dict[int, int]] = {}
        self.ids = itertools.count()


_REGISTRY = _Registry()


class LoopbackEngine(TransferEngine):
    """In-process engine for unit tests: memmove between registered regions.

    It enforces the same rule as a real engine (both sides registered), so a
    bad address is caught in unit tests exactly like a rejected remote read.
    """

    name = "loopback"

    def __init__(self) -> None:
        with _REGISTRY.lock:
            self._endpoint = f"loopback:{next(_REGISTRY.ids)}"
            _REGISTRY.regions[self._endpoint] = {}

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def _register(self, addr: int, length: int) -> None:
        with _REGISTRY.lock:
            _REGISTRY.regions[self._endpoint][addr] = length

    def unregister(self, addr: int) -> None:
        with _REGISTRY.lock:
            _REGISTRY.regions[self._endpoint].pop(addr, None)

    @staticmethod
    def _covered(regions: dict[int, int], addr: int, length: int) -> bool:
        return any(base <= addr and addr + length <= base + n for base, n in regions.items())

    def _read(self, peer: str, ops: Sequence[ReadOp]) -> None:
        with _REGISTRY.lock:
            remote = dict(_REGISTRY.regions.get(peer, {})) if peer in _REGISTRY.regions else None
            local = dict(_REGISTRY.regions.get(self._endpoint, {}))
        if remote is None:
            raise TransferError(f"loopback peer {peer!r} does not exist")
        for op in ops:
            if not self._covered(remote, op.remote_addr, op.length):
                raise TransferError(
                    f"remote range [{op.remote_addr:#x}, +{op.length}) not registered at {peer}"
                )
            if not self._covered(local, op.local_addr, op.length):
                raise TransferError(f"local range [{op.local_addr:#x}, +{op.length}) not registered")
        for op in ops:
            ctypes.memmove(op.local_addr, op.remote_addr, op.length)

    def close(self) -> None:
        with _REGISTRY.lock:
            _REGISTRY.regions.pop(self._endpoint, None)


def create_engine(backend: str, *, host: str = "127.0.0.1", protocol: str | None = None,
                  device_name: str = "", timeout_s: float | None = None, role: str = "Decode",
                  device_id: int = 0) -> TransferEngine:
    """Build the engine named by ``transfer_backend`` (config key) for this process.

    ``timeout_s`` bounds one read from a peer that stopped answering (Mooncake).
    ``protocol``: ``mooncake_protocol`` (default "tcp") or ``memfabric_transfer_protocol``
    (default "sdma");
    ``device_name``: Mooncake's RDMA devices, or the NIC MemFabric binds;
    ``role`` ("Prefill" / "Decode") and ``device_id`` (the rank's NPU): MemFabric.
    """
    if backend == "mooncake":
        from ascend_offload.transfer.mooncake import MooncakeEngine

        return MooncakeEngine(host=host, protocol=protocol or "tcp", device_name=device_name, timeout_s=timeout_s)
    if backend == "loopback":
        return LoopbackEngine()
    if backend == "memfabric":
        from ascend_offload.transfer.memfabric import MemFabricEngine

        return MemFabricEngine(host=host, protocol=protocol or "sdma", role=role, device_id=device_id, nic=device_name)
    raise ValueError(f"transfer_backend={backend!r} (accepted: 'mooncake', 'memfabric', 'loopback')")


def transfer_protocol(cfg: RemoteD2HConfig) -> str:
    """``backend/protocol`` of a ``RemoteD2HConfig``: what both ends of a P/D transfer must
    share (decode advertises it, prefill compares it with its own)."""
    if cfg.transfer_backend == "memfabric":
        return f"memfabric/{cfg.memfabric_transfer_protocol}"
    return f"{cfg.transfer_backend}/{cfg.mooncake_protocol}"


def create_engine_for(cfg: RemoteD2HConfig, *, host: str, role: str, device_id: int = 0) -> TransferEngine:
    """The engine a ``RemoteD2HConfig`` names, with its backend's own keys."""
    if cfg.transfer_backend == "memfabric":
        return create_engine("memfabric", host=host, protocol=cfg.memfabric_transfer_protocol,
                             device_name=cfg.memfabric_nic, role=role, device_id=device_id)
    return create_engine(cfg.transfer_backend, host=host, protocol=cfg.mooncake_protocol,
                         device_name=cfg.mooncake_device_name, timeout_s=cfg.read_timeout_s)
