"""Build the shared-store backend a ``StoreConnectorConfig`` names.

One place that maps ``backend`` to a ``KVStore`` class, so the connector does not grow
one branch per backend. ``local`` is not built here: its index lives in vLLM's
scheduler and its bytes in the worker ranks (store/scheduled.py, store/worker_pool.py).
"""

from __future__ import annotations

from typing import Any

from ascend_offload.store.base import KVStore, StoreError

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
