"""The shared tier of the store connector (store/shared/tier.py) on Mooncake Store:
block objects published by every instance that points at the same
``mooncake_master``.

What is Mooncake-specific, behind :class:`~ascend_offload.store.shared.tier.TierClient`
(:class:`MooncakeTierClient`): existence lookups are ``batch_is_exist`` (the scheduler's
client contributes no segment), publishes ``batch_put_from_multi_buffers`` (one buffer
per layer row), fetches ``batch_get_into_multi_buffers``; an RPC error code (or a call
that raises: a closed or broken client) is an unreachable master, and a call to a gone
master blocks ~4 s in Mooncake's reconnect, which is why the shared tier stops calling
it while it is down.

Mooncake's error codes live here; bench/stores/mooncake.py imports them, and this
module's client for its service health.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ascend_offload.store.base import StoreError
from ascend_offload.store.shared import tier as shared_tier
from ascend_offload.store.shared.tier import TierCounts, shard_key

if TYPE_CHECKING:
    from ascend_offload.config import MooncakeStoreConfig

__all__ = ["MooncakeTierClient", "RemoteIndex", "RemotePages", "TierCounts", "connect", "shard_key"]

log = logging.getLogger(__name__)

#: Mooncake ``ErrorCode`` values told apart here and by bench/stores/mooncake.py
#: (mooncake-store types.h).
NO_AVAILABLE_HANDLE = -200  # no space: the master evicts asynchronously, a later put fits
INVALID_PARAMS = -600  # among others: the object is larger than the buffer offered
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
TRANSFER_FAIL = -800
RPC_FIRST, RPC_LAST = -999, -900  # RPC_FAIL, RPC_TIMEOUT, heartbeat errors: master unreachable
SHORT_READ = -(1 << 29)  # a get answered a byte count other than the object's (nothing in flight)
# Get failures returned before any byte moved (or after all did): the pages are safe
# to reuse. After any other failure a transfer may still write them (Mooncake documents
# no cancellation), so they are quarantined, never reused.
SAFE_GET_FAILURES = frozenset({NO_AVAILABLE_HANDLE, INVALID_PARAMS, OBJECT_NOT_FOUND, -703, -707, SHORT_READ,
                               *range(RPC_FIRST, RPC_LAST + 1)})


def _rpc_failure(code: int) -> bool:
    return RPC_FIRST <= code <= RPC_LAST


def _call(fn: Any, *args: Any, n: int) -> list[int]:
    """A batch call's per-object codes; a call that raises (a closed or broken client)
    answers like an unreachable master for all ``n`` objects, never into the engine."""
    try:
        return list(fn(*args))
    except Exception:
        log.exception("Mooncake %s raised; treated as an unreachable master", getattr(fn, "__name__", fn))
        return [RPC_LAST] * n


def connect(cfg: MooncakeStoreConfig, *, global_segment_bytes: int, deadline_s: float | None = None) -> Any:
    """A ``MooncakeDistributedStore`` client set up from a ``MooncakeStoreConfig``.
    ``global_segment_bytes`` 0 contributes no memory to the pool. No local transfer
    buffer: every byte moves from or to registered pages. ``deadline_s`` bounds every
    transfer of this process (Mooncake's transport timeouts, read at setup): a peer
    that stops answering fails a put or get then, instead of blocking the model
    thread (measured: 30 s without, 2.0 s with a 2 s deadline, peer SIGSTOPped)."""
    if deadline_s is not None:
        from ascend_offload.transfer.mooncake import apply_read_deadline

        apply_read_deadline(deadline_s)
    if not cfg.master_address:
        raise StoreError("the Mooncake backend needs 'mooncake.master_address' (host:port of mooncake_master)")
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise StoreError(
            f"the Mooncake backend needs the mooncake package ({exc}); "
            "pip install mooncake-transfer-engine-non-cuda (and libibverbs1 librdmacm1 libnuma1)"
        ) from exc
    client = MooncakeDistributedStore()
    rc = client.setup(cfg.local_hostname, cfg.metadata_server, global_segment_bytes, 0,
                      cfg.protocol, cfg.device_name, cfg.master_address)
    if rc != 0:
        raise StoreError(f"Mooncake store setup against master {cfg.master_address} failed ({rc}); "
                         "is mooncake_master running there?")
    return client


class MooncakeTierClient:
    """A ``MooncakeDistributedStore`` client as the shared tier's ``TierClient``."""

    duplicate = OBJECT_ALREADY_EXISTS

    def __init__(self, client: Any, master_address: str, *, replica_num: int = 1) -> None:
        self.client = client
        self.service = f"Mooncake master {master_address}"
        self.replica_num = replica_num

    def exists(self, keys: Sequence[str]) -> list[int]:
        return _call(self.client.batch_is_exist, list(keys), n=len(keys))

    @staticmethod
    def unreachable(code: int) -> bool:
        return _rpc_failure(code)

    def put(self, keys: Sequence[str], ptrs: list[list[int]], lens: list[list[int]],
            on_late: Callable[[], None] | None = None) -> list[int]:
        """Synchronous (Mooncake's transport deadline bounds it): never ``IN_FLIGHT``."""
        from mooncake.store import ReplicateConfig

        rep = ReplicateConfig()
        rep.replica_num = self.replica_num
        return _call(self.client.batch_put_from_multi_buffers, list(keys), ptrs, lens, rep, n=len(keys))

    def get(self, keys: Sequence[str], ptrs: list[list[int]], lens: list[list[int]],
            on_late: Callable[[], None] | None = None) -> list[int]:
        """Raises what the client raises (the shared tier then keeps the pages out of use);
        synchronous, never ``IN_FLIGHT``."""
        got = self.client.batch_get_into_multi_buffers(list(keys), ptrs, lens)
        return [0 if g == sum(n) else (g if g < 0 else SHORT_READ) for g, n in zip(got, lens, strict=False)]

    @staticmethod
    def safe_failure(code: int) -> bool:
        return code in SAFE_GET_FAILURES

    def remove(self, keys: Sequence[str]) -> None:
        """Objects that failed verification are left to the master's eviction (a miss
        meanwhile: every fetch verifies)."""

    def register(self, ptr: int, nbytes: int) -> int:
        return int(self.client.register_buffer(ptr, nbytes))

    def unregister(self, ptr: int, nbytes: int) -> None:
        self.client.unregister_buffer(ptr)

    def close(self) -> None:
        self.client.close()


class RemoteIndex(shared_tier.RemoteIndex):
    """The shared tier's scheduler view on a Mooncake master (``cfg``: a
    ``MooncakeStoreConfig``; ``client`` replaces the real one, tests)."""

    def __init__(self, cfg: MooncakeStoreConfig, world_size: int, *, client: Any = None) -> None:
        raw = client if client is not None else connect(cfg, global_segment_bytes=0)
        super().__init__(MooncakeTierClient(raw, cfg.master_address), world_size, cfg.retry_interval_s)


class RemotePages(shared_tier.RemotePages):
    """A worker rank's shared-tier client on a Mooncake master; ``deadline_s`` bounds
    every transfer of this process (see :func:`connect`)."""

    def __init__(self, cfg: MooncakeStoreConfig, planes: Mapping[str, torch.Tensor], rank: int, *,
                 client: Any = None, deadline_s: float | None = None) -> None:
        if not planes:
            raise StoreError("RemotePages needs at least one page plane")
        raw = client if client is not None else connect(
            cfg, global_segment_bytes=cfg.global_segment_bytes, deadline_s=deadline_s)
        tier = MooncakeTierClient(raw, cfg.master_address, replica_num=int(getattr(cfg, "replica_num", 1)))
        super().__init__(tier, planes, rank, cfg.retry_interval_s)
