"""Build the shared-store backend a ``StoreConnectorConfig`` names.

One place that maps ``backend`` to a ``KVStore`` class and to the connector's shared
tier clients, so the connector does not grow one branch per backend. ``local`` is not built here: its index lives in vLLM's
scheduler and its bytes in the worker ranks (store/scheduled.py, store/worker_pool.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ascend_offload.store.base import KVStore, StoreError

if TYPE_CHECKING:
    import torch

    from ascend_offload.store.shared_tier import RemoteIndex, RemotePages

SHARED_BACKENDS = ("mooncake", "memcache")


def shared_store_from_config(cfg: Any, object_bytes: int, *, device_id: int = 0) -> KVStore:
    """The ``mooncake`` or ``memcache`` backend of ``cfg`` (a ``StoreConnectorConfig``);
    ``object_bytes``: the size of one stored object (one page each when ``page_bytes``
    is unset); ``device_id``: the rank's accelerator (Memcache contributes its HBM)."""
    if cfg.backend == "mooncake":
        from ascend_offload.store.mooncake import mooncake_store_from_config

        return mooncake_store_from_config(cfg.mooncake, object_bytes)
    if cfg.backend == "memcache":
        from ascend_offload.store.memcache import memcache_store_from_config

        return memcache_store_from_config(cfg.memcache, object_bytes, device_id=device_id)
    raise StoreError(f"backend={cfg.backend!r} is not a shared store (accepted: {', '.join(SHARED_BACKENDS)})")


def shared_tier_index(cfg: Any, world_size: int) -> RemoteIndex:
    """The scheduler's client of the shared tier behind the connector's local pages
    (``cfg.backend`` ``mooncake`` or ``memcache``; store/shared_tier.py)."""
    if cfg.backend == "mooncake":
        from ascend_offload.store import mooncake_tier

        return mooncake_tier.RemoteIndex(cfg.mooncake, world_size)
    if cfg.backend == "memcache":
        from ascend_offload.store import memcache_tier

        return memcache_tier.RemoteIndex(cfg.memcache, world_size)
    raise StoreError(f"backend={cfg.backend!r} has no shared tier (accepted: {', '.join(SHARED_BACKENDS)})")


def shared_tier_pages(cfg: Any, planes: Mapping[str, torch.Tensor], rank: int, *, device_id: int = 0) -> RemotePages:
    """A worker rank's client of the shared tier, its page ``planes`` registered.
    Transfers are bounded by the connector's load/save deadlines (Mooncake: its
    transport timeouts; Memcache: ``memcache.call_timeout_s``)."""
    if cfg.backend == "mooncake":
        from ascend_offload.store import mooncake_tier

        return mooncake_tier.RemotePages(cfg.mooncake, planes, rank,
                                         deadline_s=min(cfg.load_timeout_s, cfg.save_timeout_s))
    if cfg.backend == "memcache":
        from ascend_offload.store import memcache_tier

        return memcache_tier.RemotePages(cfg.memcache, planes, rank, device_id=device_id)
    raise StoreError(f"backend={cfg.backend!r} has no shared tier (accepted: {', '.join(SHARED_BACKENDS)})")
