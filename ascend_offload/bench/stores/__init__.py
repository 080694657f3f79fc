"""Standalone ``KVStore`` backends over the shared stores, for ``bench store`` and tests.

``MooncakeStore`` and ``MemcacheStore`` serve the whole store contract (store/base.py)
through a registered staging pool of their own (``StagedStore``). The store connector
does not use them: its shared tier (store/shared/) moves bytes straight from and to its
ranks' local pages. They are kept to measure a shared store behind the contract against
the library's raw calls, and they reuse the connector's vendor clients
(store/shared/mooncake.py, store/shared/memcache.py): error codes, client set-up,
service health.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ascend_offload.store.base import KVStore, StoreError
from ascend_offload.store.shared.backends import SHARED_BACKENDS

if TYPE_CHECKING:
    from ascend_offload.config import StoreConnectorConfig


def shared_store_from_config(cfg: StoreConnectorConfig, object_bytes: int, *, device_id: int = 0) -> KVStore:
    """The ``mooncake`` or ``memcache`` backend of ``cfg`` (a ``StoreConnectorConfig``);
    ``object_bytes``: the size of one stored object (one staging page each, default
    staging sizes); ``device_id``: the rank's accelerator (Memcache contributes its HBM)."""
    if cfg.backend == "mooncake":
        from ascend_offload.bench.stores.mooncake import mooncake_store_from_config

        return mooncake_store_from_config(cfg.mooncake, object_bytes)
    if cfg.backend == "memcache":
        from ascend_offload.bench.stores.memcache import memcache_store_from_config

        return memcache_store_from_config(cfg.memcache, object_bytes, device_id=device_id)
    raise StoreError(f"backend={cfg.backend!r} is not a shared store (accepted: {', '.join(SHARED_BACKENDS)})")
