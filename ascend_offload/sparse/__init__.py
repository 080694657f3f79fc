"""Sparse decode offload: host KV pool, per-layer device hot buffers, LRU
residency (native C++ with a pure-torch twin, or on the device) and the per-layer
manager an attention backend calls (``offload_new_kv`` / ``onload_topk``). See
docs/sparse.md.

Exports resolve on first use: the device residency
(``ascend_offload.sparse.device_residency``) imports with torch alone, and
importing it must not pull in the manager's config schema (pydantic)."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "HostKVPool": "pools",
    "HotBuffers": "pools",
    "PoolCapacityError": "pools",
    "PoolFenceTimeout": "pools",
    "ResidencyError": "residency",
    "Resolved": "residency",
    "make_residency": "residency",
    "SparseOffloadManager": "manager",
    "SparseStats": "manager",
    "StepEntry": "manager",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
