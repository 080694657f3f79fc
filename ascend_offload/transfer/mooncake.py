"""Mooncake transfer engine backend (TCP here, RDMA where the NICs exist).

Uses ``mooncake.engine.TransferEngine`` from ``mooncake-transfer-engine-non-cuda``
in P2P-handshake mode: no metadata server, a peer is named ``host:rpc_port``.
"""

from __future__ import annotations

import math
import os
from collections.abc import MutableMapping, Sequence

from ascend_offload.transfer.base import LibraryEngine, ReadOp, TransferError

# Mooncake's TCP transport waits for a stalled (alive but silent) peer without
# bound unless these are set; they are read when the engine starts (per process).
TIMEOUT_ENV = ("MC_TRANSFER_TIMEOUT", "MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC")


def apply_read_deadline(timeout_s: float, env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set Mooncake's transport deadlines (whole seconds) to ``timeout_s``; returns what was set.

    Ours wins over a looser (or unparsable) setting already in the environment;
    a tighter one is kept. So a read never outlives our deadline by more than
    the rounding up to whole seconds, whatever the environment says.
    """
    if not 0 < timeout_s < math.inf:
        raise ValueError(f"timeout_s={timeout_s}: must be > 0 and finite")
    if env is None:
        env = os.environ
    ours = max(1, math.ceil(timeout_s))
    out = {}
    for key in TIMEOUT_ENV:
        try:
            have = int(env.get(key, ""))
        except ValueError:
            have = 0
        env[key] = out[key] = str(have if 0 < have <= ours else ours)
    return out


class MooncakeEngine(LibraryEngine):
    """One Mooncake endpoint; reads are one ``batch_transfer_sync_read`` per call.

    ``timeout_s`` bounds a read from a peer that stops answering (measured: a
    read from a SIGSTOPped peer otherwise blocks until it resumes; with the
    bound it fails with rc=-1 and the connection is dropped, so no byte lands
    later). It is our deadline: an ``MC_*`` environment setting only wins
    when it is tighter (:func:`apply_read_deadline`).
    """

    name = "mooncake"

    def __init__(self, *, host: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "",
                 timeout_s: float | None = None) -> None:
        if timeout_s is not None:
            apply_read_deadline(timeout_s)
        try:
            from mooncake.engine import TransferEngine as _MC
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "transfer_backend='mooncake' needs the 'mooncake-transfer-engine-non-cuda' package "
                "(pip install 'ascend-offload[mooncake]') and Debian libibverbs1 librdmacm1 libnuma1"
            ) from exc
        if protocol not in ("tcp", "rdma"):
            raise ValueError(f"mooncake_protocol={protocol!r} (accepted: 'tcp', 'rdma')")
        # TCP moves bytes with the host CPU: host memory only. RDMA registers device
        # memory where the NIC can reach it (GPUDirect RDMA: nvidia-peermem / the NPU's
        # peer-memory driver); where it cannot, registration fails and the caller stages.
        self.device_memory = protocol == "rdma"
        eng = _MC()
        rc = eng.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise TransferError(
                f"Mooncake initialize(host={host!r}, protocol={protocol!r}, "
                f"device_name={device_name!r}) failed with rc={rc}"
            )
        super().__init__(eng, f"{host}:{eng.get_rpc_port()}")

    def _read(self, peer: str, ops: Sequence[ReadOp]) -> None:
        self._check_open()
        if len(ops) != 1:
            self._batch_read(peer, ops)
            return
        op = ops[0]
        rc = self._eng.transfer_sync_read(peer, op.local_addr, op.remote_addr, op.length)
        if rc != 0:
            raise TransferError(f"mooncake read of 1 run ({op.length} B) from {peer} failed rc={rc}")
