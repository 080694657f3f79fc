"""Sparse decode offload: host KV pool, per-layer device hot buffers, LRU
residency (native C++ with a pure-torch twin) and the per-layer manager an
attention backend calls (``offload_new_kv`` / ``onload_topk``). See docs/sparse.md."""

from ascend_offload.sparse.manager import SparseOffloadManager, SparseStats, StepEntry
from ascend_offload.sparse.pools import HostKVPool, HotBuffers, PoolCapacityError, PoolFenceTimeout
from ascend_offload.sparse.residency import ResidencyError, Resolved, make_residency

__all__ = [
    "HostKVPool",
    "HotBuffers",
    "PoolCapacityError",
    "PoolFenceTimeout",
    "ResidencyError",
    "Resolved",
    "SparseOffloadManager",
    "SparseStats",
    "StepEntry",
    "make_residency",
]
