"""MemFabric transfer engine backend (``memfabric_hybrid``, Ascend NPUs).

Decode pulls prefill's KV with ``batch_transfer_sync_read`` from the peer's registered
memory (device HBM or pinned host pages alike: MemFabric moves both). Set-up follows
vllm-ascend's MemFabric glue (``distributed/kv_transfer/.../transfer_engine`` on its
main branch, memfabric_hybrid 1.x): the session a peer reads from is
``host:rpc_port`` with the port the engine picked at construction
(``get_rpc_port``); ``initialize`` gets ``tcp://<session>`` (only its ``tcp://`` part
is used), the session as its unique id, the role, and ``store_server_role="Prefill"``
(the prefill side serves MemFabric's config store).

``memfabric_transfer_protocol`` picks the data-op type; both ends of a transfer must
use the same one, which is why decode advertises its protocol in its registration
and prefill refuses a request whose decode uses another (pd/registration.py).

The engine's reads have no deadline of their own (unlike Mooncake's transport
timeouts): decode's ``request_timeout_s`` bounds how long a request waits for its KV,
and a read that finished after its budget (``read_timeout_s``) is reported late and
not used (pd/consumer.py); the request recomputes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ascend_offload.transfer.base import LibraryEngine, ReadOp, TransferError

#: ``memfabric_transfer_protocol`` -> ``memfabric_hybrid.TransDataOpType`` member name.
PROTOCOLS = {"sdma": "SDMA", "device_rdma": "DEVICE_RDMA", "device_urma": "DEVICE_URMA"}
ROLES = ("Prefill", "Decode")


def data_op_type(protocol: str, op_types: Any) -> Any:
    """The ``TransDataOpType`` member (of ``op_types``) for a config protocol name."""
    try:
        return getattr(op_types, PROTOCOLS[protocol])
    except KeyError:
        raise ValueError(f"memfabric_transfer_protocol={protocol!r} "
                         f"(accepted: {', '.join(repr(p) for p in PROTOCOLS)})") from None


def _module() -> Any:
    try:
        import memfabric_hybrid
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("transfer_backend='memfabric' needs memfabric_hybrid "
                          "(pip install 'ascend-offload[ascend]') and the Ascend driver") from exc
    return memfabric_hybrid


class MemFabricEngine(LibraryEngine):
    """One MemFabric endpoint; reads are one ``batch_transfer_sync_read`` per call.

    ``engine`` / ``op_types`` replace the library's objects
    (tests pass fakes with the library's API: the repository's ``tests/support/fake_ascend.py``,
    not shipped)."""

    name = "memfabric"
    # sdma / device_rdma / device_urma move HBM: device KV is registered in place; a
    # refused registration falls back to staging (connectors/remote_d2h/kv_region.py).
    device_memory = True

    def __init__(self, *, host: str = "127.0.0.1", protocol: str = "sdma", role: str = "Decode",
                 device_id: int = 0, nic: str = "", engine: Any = None, op_types: Any = None) -> None:
        if role not in ROLES:
            raise ValueError(f"MemFabric role={role!r} (accepted: {', '.join(ROLES)})")
        if engine is None:
            mod = _module()
            engine = mod.TransferEngine()
            op_types = mod.TransDataOpType
        op = data_op_type(protocol, op_types)
        self.protocol = protocol
        self.role = role
        session = f"{host}:{engine.get_rpc_port()}"
        rc = engine.initialize(f"tcp://{session}", session, role, device_id, op, "Prefill", nic)
        if rc != 0:
            raise TransferError(f"MemFabric initialize(session={session!r}, role={role!r}, device_id={device_id}, "
                                f"protocol={protocol!r}) failed with rc={rc}")
        super().__init__(engine, session)

    def _read(self, peer: str, ops: Sequence[ReadOp]) -> None:
        self._check_open()
        self._batch_read(peer, ops, f" ({self.protocol})")

    def _shutdown(self) -> None:
        self._eng.unInitialize()
