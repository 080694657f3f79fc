"""Build the shared tier a ``StoreConnectorConfig`` names.

One place that maps ``backend`` to the connector's shared tier clients, so the connector
does not grow one branch per backend. ``local`` is not built here: its index lives in vLLM's
scheduler and its bytes in the worker ranks (store/pages/scheduled_store.py, store/pages/worker_pool.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from ascend_offload.store.base import StoreError

if TYPE_CHECKING:
    import torch

    from ascend_offload.config import StoreConnectorConfig
    from ascend_offload.store.shared.tier import RemoteIndex, RemotePages

SHARED_BACKENDS = ("mooncake", "memcache")


def shared_tier_index(cfg: StoreConnectorConfig, world_size: int) -> RemoteIndex:
    """The scheduler's client of the shared tier behind the connector's local pages
    (``cfg.backend`` ``mooncake`` or ``memcache``; store/shared/tier.py)."""
    if cfg.backend == "mooncake":
        from ascend_offload.store.shared import mooncake

        return mooncake.RemoteIndex(cfg.mooncake, world_size)
    if cfg.backend == "memcache":
        from ascend_offload.store.shared import memcache

        return memcache.RemoteIndex(cfg.memcache, world_size)
    raise StoreError(f"backend={cfg.backend!r} has no shared tier (accepted: {', '.join(SHARED_BACKENDS)})")


def shared_tier_pages(cfg: StoreConnectorConfig, planes: Mapping[str, torch.Tensor], rank: int, *, device_id: int = 0) -> RemotePages:
    """A worker rank's client of the shared tier, its page ``planes`` registered.
    Transfers are bounded by the connector's load/save deadlines (Mooncake: its
    transport timeouts; Memcache: ``memcache.call_timeout_s``)."""
    if cfg.backend == "mooncake":
        from ascend_offload.store.shared import mooncake

        return mooncake.RemotePages(cfg.mooncake, planes, rank,
                                    deadline_s=min(cfg.load_timeout_s, cfg.save_timeout_s))
    if cfg.backend == "memcache":
        from ascend_offload.store.shared import memcache

        return memcache.RemotePages(cfg.memcache, planes, rank, device_id=device_id)
    raise StoreError(f"backend={cfg.backend!r} has no shared tier (accepted: {', '.join(SHARED_BACKENDS)})")
