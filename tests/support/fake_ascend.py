"""In-process fakes of the Ascend data paths: Memcache's client and MemFabric's engine.

Why fakes: ``memcache_hybrid`` and ``memfabric_hybrid`` install and import on any
x86 host, but every data path (``DistributedObjectStore.init(init_bm=True)``,
``TransferEngine.initialize``) needs the Ascend driver. The backends in
``store/shared/memcache.py`` and ``transfer/memfabric.py`` are written against the real
classes; these fakes have the same method names, parameter names, defaults and
return kinds, which ``tests/unit/store/test_memcache_fake_api.py`` asserts against
the installed wheels (a changed API fails there, not on an Ascend host).

What the fakes model, because the backends depend on it:

* **Memcache.** A shared :class:`FakeMemcacheCluster` (the meta service plus the
  pooled memory) holds whole objects; a put is visible only when it completed
  (it is one step here); a capacity bound evicts least recently used objects, so a
  later get of an evicted key misses (``MMC_OBJECT_NOT_EXISTS``); data calls move
  real bytes with ``memmove`` and refuse addresses outside a registered buffer, as
  the real client needs ``register_buffer`` for direct access. ``down`` answers
  every call with the link error a dead meta service gives (measured on the real
  client: ``-3014`` once its link broke); ``hang`` blocks calls until released
  (the real client's first call after the meta service died blocked 60 s).
* **MemFabric.** Engines register memory under their session id
  in a process-global table; ``batch_transfer_sync_read`` copies from a peer's
  registered memory, and fails (non-zero) for an unknown peer, an unregistered
  range, or a peer initialized with another data-op type (the two sides of a
  transfer must agree on the transport).
"""

from __future__ import annotations

import ctypes
import enum
import itertools
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

# Memcache result codes (memcache mmc_types.h, MmcErrorCode) the backends tell apart.
MMC_OK = 0
MMC_ERROR = -1
MMC_TIMEOUT = -3004
MMC_DUPLICATED_OBJECT = -3006
MMC_OBJECT_NOT_EXISTS = -3007
MMC_LINK_NOT_FOUND = -3014
MMC_NOT_ENOUGH_MEMORY = -3016
MMC_UNMATCHED_KEY = -3102

# BmCopyType values (memfabric_hybrid.bm.BmCopyType): the ``direct`` argument.
L2G, G2L, G2H, H2G = 0, 1, 2, 3


class FakeMemcacheCluster:
    """The meta service and the pooled memory every fake client of one test shares."""

    def __init__(self, capacity_bytes: int = 1 << 30) -> None:
        self.capacity_bytes = capacity_bytes
        self.objects: OrderedDict[str, bytes] = OrderedDict()  # LRU order, oldest first
        self.used = 0
        self.evicted = 0
        self.down = False
        self.lock = threading.Lock()
        self.release = threading.Event()  # set: hung calls return (with the link error)
        self.release.set()
        self.calls: list[str] = []

    def hang(self) -> None:
        """Calls from now on block until :meth:`unhang` (a meta service that stopped answering)."""
        self.release.clear()

    def unhang(self) -> None:
        self.release.set()

    def evict(self, keys: Sequence[str]) -> None:
        """What the meta service does under memory pressure."""
        with self.lock:
            for k in keys:
                data = self.objects.pop(k, None)
                if data is not None:
                    self.used -= len(data)
                    self.evicted += 1

    def _enter(self, op: str) -> bool:
        """Record the call; False when the service is unreachable."""
        self.calls.append(op)
        if not self.release.is_set():
            self.release.wait()
            return False
        return not self.down

    def _insert(self, key: str, data: bytes) -> int:
        if key in self.objects:
            return MMC_DUPLICATED_OBJECT
        if len(data) > self.capacity_bytes:
            return MMC_NOT_ENOUGH_MEMORY
        while self.used + len(data) > self.capacity_bytes:
            _, old = self.objects.popitem(last=False)
            self.used -= len(old)
            self.evicted += 1
        self.objects[key] = data
        self.used += len(data)
        return MMC_OK


class FakeKeyInfo:
    """``memcache_hybrid.KeyInfo``: ``size()`` is 0 for a key the service does not hold."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size

    def loc_list(self) -> list[int]:
        return [0] if self._size else []

    def type_list(self) -> list[int]:
        return [1] if self._size else []

    def gva_list(self) -> list[int]:
        return []


class FakeDistributedObjectStore:
    """``memcache_hybrid.DistributedObjectStore`` over a :class:`FakeMemcacheCluster`."""

    def __init__(self, cluster: FakeMemcacheCluster | None = None) -> None:
        self.cluster = cluster or FakeMemcacheCluster()
        self.config: Any = None
        self.ready = False
        self.data_path = False
        self.buffers: dict[int, int] = {}  # registered base -> length

    # ------------------------------------------------------------------ lifecycle

    def setup(self, config: Any) -> int:
        self.config = config
        return MMC_OK

    def init(self, device_id: int, init_bm: bool = True) -> int:
        self.ready = True
        self.data_path = init_bm
        return MMC_OK

    def close(self) -> int:
        self.ready = False
        return MMC_OK

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        self.buffers[buffer_ptr] = size
        return MMC_OK

    def unregister_buffer(self, buffer_ptr: int, size: int) -> int:
        return MMC_OK if self.buffers.pop(buffer_ptr, None) is not None else MMC_ERROR

    # ------------------------------------------------------------------ metadata

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        c = self.cluster
        if not c._enter("batch_is_exist"):
            return [MMC_LINK_NOT_FOUND] * len(keys)
        with c.lock:
            return [1 if k in c.objects else 0 for k in keys]

    def batch_get_key_info(self, keys: Sequence[str], flag: int = 1) -> list[FakeKeyInfo]:
        c = self.cluster
        if not c._enter("batch_get_key_info"):
            return [FakeKeyInfo(0) for _ in keys]
        with c.lock:
            return [FakeKeyInfo(len(c.objects.get(k, b""))) for k in keys]

    def remove_batch(self, arg0: Sequence[str]) -> list[int]:
        c = self.cluster
        if not c._enter("remove_batch"):
            return [MMC_LINK_NOT_FOUND] * len(arg0)
        out = []
        with c.lock:
            for k in arg0:
                data = c.objects.pop(k, None)
                if data is not None:
                    c.used -= len(data)
                out.append(MMC_OK if data is not None else MMC_UNMATCHED_KEY)
        return out

    # ------------------------------------------------------------------ data

    def _check_buffers(self, ptrs: Sequence[int], sizes: Sequence[int]) -> bool:
        return all(any(b <= p and p + n <= b + ln for b, ln in self.buffers.items())
                   for p, n in zip(ptrs, sizes, strict=True))

    def _put(self, op: str, keys: Sequence[str], spans: Sequence[tuple[Sequence[int], Sequence[int]]],
             direct: int) -> list[int]:
        c = self.cluster
        if not c._enter(op):
            return [MMC_LINK_NOT_FOUND] * len(keys)
        if not self.data_path:  # metadata-only client (init_bm=False)
            return [MMC_ERROR] * len(keys)
        out = []
        for key, (ptrs, sizes) in zip(keys, spans, strict=True):
            if direct not in (H2G, L2G) or not self._check_buffers(ptrs, sizes):
                out.append(MMC_ERROR)
                continue
            data = b"".join(ctypes.string_at(p, n) for p, n in zip(ptrs, sizes, strict=True))
            with c.lock:
                out.append(c._insert(key, data))
        return out

    def _get(self, op: str, keys: Sequence[str], spans: Sequence[tuple[Sequence[int], Sequence[int]]],
             direct: int) -> list[int]:
        c = self.cluster
        if not c._enter(op):
            return [MMC_LINK_NOT_FOUND] * len(keys)
        if not self.data_path:
            return [MMC_ERROR] * len(keys)
        out = []
        for key, (ptrs, sizes) in zip(keys, spans, strict=True):
            with c.lock:
                data = c.objects.get(key)
                if data is not None:
                    c.objects.move_to_end(key)
            if data is None:
                out.append(MMC_OBJECT_NOT_EXISTS)
            elif direct not in (G2H, G2L) or not self._check_buffers(ptrs, sizes) or sum(sizes) != len(data):
                out.append(MMC_ERROR)
            else:
                at = 0
                for p, n in zip(ptrs, sizes, strict=True):
                    ctypes.memmove(p, data[at:at + n], n)
                    at += n
                out.append(MMC_OK)
        return out

    def batch_put_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int],
                       direct: int = 3, replicateConfig: Any = None) -> list[int]:
        return self._put("batch_put_from", keys,
                         [([p], [n]) for p, n in zip(buffer_ptrs, sizes, strict=True)], direct)

    def batch_get_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int],
                       direct: int = 2) -> list[int]:
        return self._get("batch_get_into", keys,
                         [([p], [n]) for p, n in zip(buffer_ptrs, sizes, strict=True)], direct)

    def batch_put_from_layers(self, keys: Sequence[str], buffer_ptrs: Sequence[Sequence[int]],
                              sizes: Sequence[Sequence[int]], direct: int = 3,
                              replicateConfig: Any = None) -> list[int]:
        return self._put("batch_put_from_layers", keys, list(zip(buffer_ptrs, sizes, strict=True)), direct)

    def batch_get_into_layers(self, keys: Sequence[str], buffer_ptrs: Sequence[Sequence[int]],
                              sizes: Sequence[Sequence[int]], direct: int = 2) -> list[int]:
        return self._get("batch_get_into_layers", keys, list(zip(buffer_ptrs, sizes, strict=True)), direct)


# --------------------------------------------------------------------------- MemFabric


class FakeTransDataOpType(enum.IntEnum):
    """``memfabric_hybrid.TransDataOpType`` (names and values asserted against the wheel)."""

    SDMA = 1
    HOST_RDMA = 2
    DEVICE_RDMA = 8
    DEVICE_URMA = 64
    DEVICE_UBOE = 128


class _Fabric:
    """Process-global table of fake engines: session -> (data-op type, regions)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sessions: dict[str, tuple[int, dict[int, int]]] = {}
        self.ports = itertools.count(40000)


FABRIC = _Fabric()


class FakeTransferEngine:
    """``memfabric_hybrid.TransferEngine``: one session, reads from peers' registered memory."""

    TransDataOpType = FakeTransDataOpType

    def __init__(self) -> None:
        self._port = next(FABRIC.ports)
        self.session = ""
        self.op_type = 0
        self.role = ""
        self.init_args: tuple[Any, ...] = ()
        self.regions: dict[int, int] = {}
        self.reads = 0

    def initialize(self, store_url: str, session_id: str, role: str, device_id: int,
                   data_op_type: Any = FakeTransDataOpType.SDMA, store_server_role: str = "Decode",
                   nic: str = "") -> int:
        if role not in ("Prefill", "Decode") or not store_url.startswith("tcp://"):
            return -1
        self.init_args = (store_url, session_id, role, device_id, data_op_type, store_server_role, nic)
        self.session = session_id
        self.op_type = int(data_op_type)
        self.role = role
        with FABRIC.lock:
            FABRIC.sessions[self.session] = (self.op_type, self.regions)
        return 0

    def get_rpc_port(self) -> int:
        return self._port

    def register_memory(self, buffer_addr: int, capacity: int) -> int:
        if capacity <= 0:
            return -1
        with FABRIC.lock:
            self.regions[buffer_addr] = capacity
        return 0

    def batch_register_memory(self, buffer_addrs: Sequence[int], capacities: Sequence[int]) -> int:
        for a, n in zip(buffer_addrs, capacities, strict=True):
            if self.register_memory(a, n) != 0:
                return -1
        return 0

    def unregister_memory(self, buffer_addr: int) -> int:
        with FABRIC.lock:
            return 0 if self.regions.pop(buffer_addr, None) is not None else -1

    @staticmethod
    def _covered(regions: dict[int, int], addr: int, n: int) -> bool:
        return any(b <= addr and addr + n <= b + ln for b, ln in regions.items())

    def batch_transfer_sync_read(self, dest_session: str, buffers: Sequence[int],
                                 peer_buffers: Sequence[int], lengths: Sequence[int],
                                 flags: int = 0) -> int:
        with FABRIC.lock:
            peer = FABRIC.sessions.get(dest_session)
            if peer is None or peer[0] != self.op_type:
                return -1
            remote, local = dict(peer[1]), dict(self.regions)
        for lo, rem, n in zip(buffers, peer_buffers, lengths, strict=True):
            if not (self._covered(remote, rem, n) and self._covered(local, lo, n)):
                return -1
        for lo, rem, n in zip(buffers, peer_buffers, lengths, strict=True):
            ctypes.memmove(lo, rem, n)
        self.reads += 1
        return 0

    def transfer_sync_read(self, dest_session: str, buffer: int, peer_buffer: int, length: int,
                           flags: int = 0) -> int:
        return self.batch_transfer_sync_read(dest_session, [buffer], [peer_buffer], [length], flags)

    def unInitialize(self) -> None:
        with FABRIC.lock:
            FABRIC.sessions.pop(self.session, None)
        self.regions.clear()

    def destroy(self) -> None:
        self.unInitialize()


# --------------------------------------------------------------------------- API checks


def _split_params(text: str) -> list[str]:
    """Top-level comma split of a pybind parameter list (brackets and ``<...>`` nest)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "[(<":
            depth += 1
        elif ch in "])>":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def pybind_signature(method: Any) -> tuple[list[tuple[str, str | None]], str]:
    """``([(name, default or None), ...], return annotation)`` from a pybind11 method's
    docstring first line (``name(self: T, a: int, b: int = 3) -> list[int]``), ``self`` dropped."""
    doc = (getattr(method, "__doc__", None) or "").strip().splitlines()
    if not doc:
        raise ValueError(f"{method!r} has no pybind signature line")
    head = doc[0]
    name = getattr(method, "__name__", "")
    if not head.startswith(name + "("):
        raise ValueError(f"unexpected signature line {head!r}")
    inner, _, ret = head[len(name) + 1:].rpartition(") -> ")
    params = []
    for p in _split_params(inner):
        pname, _, rest = p.partition(":")
        default = rest.split("=", 1)[1].strip() if "=" in rest else None
        if pname.strip() != "self":
            params.append((pname.strip(), default))
    return params, ret.strip()


def _kind(annotation: str) -> str:
    a = annotation.replace("typing.", "").strip()
    if a.startswith("list[") or a.startswith("List["):
        return "list"
    return {"None": "None", "int": "int", "bytes": "bytes"}.get(a, "object")


def api_mismatches(fake: type, real: type, methods: Sequence[str]) -> list[str]:
    """How ``fake``'s methods differ from the real pybind class's: parameter names and
    order, which ones have defaults, literal default values, and the return kind."""
    import inspect

    problems = []
    for m in methods:
        real_m = getattr(real, m, None)
        fake_m = getattr(fake, m, None)
        if real_m is None or fake_m is None:
            problems.append(f"{m}: missing on the {'real class' if real_m is None else 'fake'}")
            continue
        real_params, real_ret = pybind_signature(real_m)
        sig = inspect.signature(fake_m)
        fake_params = [(p.name, p.default) for p in sig.parameters.values() if p.name != "self"]
        if [n for n, _ in real_params] != [n for n, _ in fake_params]:
            problems.append(f"{m}: parameters {[n for n, _ in fake_params]} != real {[n for n, _ in real_params]}")
            continue
        for (name, rdef), (_, fdef) in zip(real_params, fake_params, strict=True):
            has_fake = fdef is not inspect.Parameter.empty
            if (rdef is not None) != has_fake:
                problems.append(f"{m}.{name}: default {'missing' if rdef is not None else 'extra'} on the fake")
            elif rdef is not None:
                got = fdef.value if isinstance(fdef, enum.Enum) else fdef
                if rdef.startswith("<") and ": " in rdef:  # an enum member: <Type.NAME: value>
                    want: str | None = rdef.rstrip(">").rsplit(": ", 1)[1]
                elif rdef.startswith("<"):  # an object (e.g. ReplicateConfig()): any default
                    want = None
                else:
                    want = rdef.strip("'")
                if want is not None and str(got) != want:
                    problems.append(f"{m}.{name}: default {got!r} != real {rdef}")
        fake_ret = sig.return_annotation
        fake_ret = fake_ret if isinstance(fake_ret, str) else getattr(fake_ret, "__name__", str(fake_ret))
        if _kind(real_ret) != _kind(fake_ret):
            problems.append(f"{m}: returns {fake_ret} != real {real_ret}")
    return problems
