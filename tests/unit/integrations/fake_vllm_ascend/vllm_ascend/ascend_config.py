"""Fake of ``vllm_ascend/ascend_config.py`` (vllm-ascend main 182b75ea): the one accessor the
SFA backend reads, ``get_ascend_config().sparse_kv_offload_config.enabled``."""

from __future__ import annotations

from types import SimpleNamespace

_CONFIG = SimpleNamespace(sparse_kv_offload_config=SimpleNamespace(enabled=False))


def get_ascend_config() -> SimpleNamespace:
    return _CONFIG


def set_sparse_kv_offload(enabled: bool) -> None:
    """Test helper: what ``additional_config.sparse_kv_offload_config.enabled`` sets."""
    _CONFIG.sparse_kv_offload_config.enabled = enabled
