"""Mooncake transfer engine backend (TCP here, RDMA where the NICs exist).

Uses ``mooncake.engine.TransferEngine`` from ``mooncake-transfer-engine-non-cuda``
in P2P-handshake mode: no metadata server, a peer is named ``host:rpc_port``.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable, MutableMapping, Sequence
from typing import Any

from ascend_offload.transfer.base import LibraryEngine, PendingRead, ReadOp, TransferError, coalesce

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
    """One Mooncake endpoint. A read submits each coalesced run as its own asynchronous
    batch (``batch_transfer_async_read``) and waits by polling them
    (``transfer_check_status``) with short sleeps.

    Why not ``batch_transfer_sync_read``: its wait spins a core until the batch ends
    (measured on 2 vCPUs: 8 sequential 2.9 MB reads took 17 ms with it, 12.6 ms polled;
    TCP moves the bytes with the CPU, on both hosts, so a spinning waiter takes a core
    from the transfer). One run per batch because ``transfer_check_status`` looks at a
    batch's first task only. :meth:`start_read` returns after the submission, so a
    reader can keep the next read in flight while it waits for this one.

    ``timeout_s`` bounds a read from a peer that stops answering (measured: a
    read from a SIGSTOPped peer otherwise blocks until it resumes; with the
    bound it fails with rc=-1 and the connection is dropped, so no byte lands
    later). It is our deadline: an ``MC_*`` environment setting only wins
    when it is tighter (:func:`apply_read_deadline`). The wait itself also
    gives up where Mooncake's synchronous read would (``MC_TRANSFER_TIMEOUT``,
    at least 5 s, default 30 s, plus 1 ns per byte, from the submission).
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
        self._wait_limit_s = _wait_limit_s()

    def _read(self, peer: str, ops: Sequence[ReadOp]) -> None:
        self._start(peer, ops).wait()

    def start_read(self, peer: str, ops: Iterable[ReadOp]) -> PendingRead:
        """Submit every run and return; :meth:`PendingRead.wait` ends them."""
        return self._start(peer, coalesce(ops))

    def _start(self, peer: str, batch: Sequence[ReadOp]) -> _MooncakeRead:
        self._check_open()
        read = _MooncakeRead(self._eng, peer, batch, self._wait_limit_s)
        for op in batch:
            bid = self._eng.batch_transfer_async_read(peer, [op.local_addr], [op.remote_addr], [op.length])
            if bid in _NO_BATCH:  # this run was not submitted; those before it are waited for
                read.refused = f"run {len(read.ids) + 1} of {len(batch)} could not be submitted"
                break
            read.ids.append(bid)
        return read


def _wait_limit_s(env: MutableMapping[str, str] | None = None) -> float:
    """Mooncake's own bound on a synchronous read (``TransferEnginePy``'s constructor):
    ``MC_TRANSFER_TIMEOUT`` seconds, at least 5, default 30."""
    env = os.environ if env is None else env
    try:
        return float(max(5, int(env["MC_TRANSFER_TIMEOUT"])))
    except (KeyError, ValueError):
        return 30.0


# What batch_transfer_async_read returns when it submitted nothing: 0, or -1 as an unsigned id.
_NO_BATCH = (0, (1 << 64) - 1)
# transfer_check_status: 1 completed, -1 failed (both free the batch), 0 running, -2 timed out.
_DONE, _FAILED = 1, -1
# Sleeps between polls of one batch: doubling from the first, capped (a few-ms read is seen
# ended within ~0.2 ms); a batch still running after _POLL_SLOW_AFTER_S is stalled or on a
# saturated link and is polled at the slow cap. Fixed bounds, nothing learned across reads:
# a wait never sleeps longer because an earlier read was slow.
_POLL_FIRST_S, _POLL_CAP_S = 20e-6, 200e-6
_POLL_SLOW_AFTER_S, _POLL_SLOW_CAP_S = 0.05, 2e-3


def poll_sleep(prev_s: float, waited_s: float) -> float:
    """The next sleep between two polls of a batch, after ``prev_s`` and ``waited_s`` in all."""
    cap = _POLL_CAP_S if waited_s < _POLL_SLOW_AFTER_S else _POLL_SLOW_CAP_S
    return min(2 * prev_s, cap)


class _MooncakeRead(PendingRead):
    """Submitted runs (one batch each); :meth:`wait` polls every one to its end, once (Mooncake
    frees a batch when it ends: polling it again would read freed memory)."""

    def __init__(self, eng: Any, peer: str, ops: Sequence[ReadOp], limit_s: float) -> None:
        self._eng = eng
        self._peer = peer
        self._ops = ops
        self._nbytes = sum(o.length for o in ops)
        self._end = time.monotonic() + limit_s + self._nbytes * 1e-9
        self.ids: list[int] = []
        self.refused = ""
        self._error: TransferError | None = None
        self._waited = False

    def wait(self) -> int:
        if not self._waited:
            self._waited = True
            failed = sum(not self._poll(bid) for bid in self.ids)
            why = self.refused or (f"{failed} of {len(self._ops)} runs failed" if failed else "")
            if why:
                self._error = TransferError(
                    f"mooncake read of {len(self._ops)} runs ({self._nbytes} B) "
                    f"from {self._peer} failed: {why}")
        if self._error is not None:
            raise self._error
        return len(self._ops)

    def _poll(self, bid: int) -> bool:
        """Until the batch ends (True: completed) or Mooncake's read bound passed (False; the
        batch is then left to Mooncake, never freed under a transfer that may still run)."""
        t0 = time.monotonic()
        sleep = _POLL_FIRST_S
        while True:
            rc = self._eng.transfer_check_status(bid)
            if rc == _DONE:
                return True
            now = time.monotonic()
            if rc == _FAILED or now > self._end:
                return False
            time.sleep(min(sleep, max(0.0, self._end - now)))
            sleep = poll_sleep(sleep, now - t0)
