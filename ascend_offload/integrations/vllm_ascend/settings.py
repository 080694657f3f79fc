"""Which of our features an engine runs, read from its vLLM config (no vllm_ascend import).

Why ownership matters here: vllm-ascend registers connectors under the same names
as ours (``AscendStoreConnector``, ``SfaRemoteD2HConnector``); ``plugin.py`` then
skips our registration and users select ours with ``kv_connector_module_path``.
A config entry is ours only if the name resolves to a class of this package, so
vllm-ascend's own connectors (and their extra-config keys, which our strict
schemas would refuse) are left alone.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator, Mapping
from typing import Any

from ascend_offload.config import (
    ConfigError,
    SparseOffloadConfig,
    StoreConnectorConfig,
    parse_extra_config,
)
from ascend_offload.connectors.ours import our_connectors

STORE = "AscendStoreConnector"
SPARSE_CONNECTORS = ("AscendSparseDecodeConnector", "SfaRemoteD2HConnector")


def _entries(vllm_config: Any) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(connector name, extra config) of every connector of ours the engine runs."""
    for name, _role, extra in our_connectors(vllm_config):
        yield name, extra


def sparse_offload_settings(vllm_config: Any) -> SparseOffloadConfig | None:
    """Our decode ``sparse_offload`` block when an engine connector of ours turns it on."""
    for name, extra in _entries(vllm_config):
        if name in SPARSE_CONNECTORS:
            cfg = parse_extra_config(name, extra).sparse_offload
            if cfg.enabled:
                return cfg
    return None


def layerwise_store_settings(vllm_config: Any) -> StoreConnectorConfig | None:
    """Our store connector's settings when it runs layerwise (layer-sharing) mode."""
    for name, extra in _entries(vllm_config):
        if name == STORE:
            cfg = parse_extra_config(name, extra)
            if cfg.use_layerwise:
                return cfg
    return None


def ascend_sparse_kv_offload_enabled(vllm_config: Any) -> bool:
    """vllm-ascend's own ``additional_config.sparse_kv_offload_config.enabled``
    (read the way ``SparseKVOffloadConfig.__init__`` reads it)."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    own = extra.get("sparse_kv_offload_config", {}) if isinstance(extra, Mapping) else {}
    return bool(own.get("enabled", False)) if isinstance(own, Mapping) else False


def check_single_offload_manager(vllm_config: Any) -> None:
    """Refuse two sparse offload managers on one SFA layer (startup error naming both keys)."""
    if sparse_offload_settings(vllm_config) is not None and ascend_sparse_kv_offload_enabled(
            vllm_config):
        raise ConfigError(
            "key 'sparse_offload.enabled'=True and vllm-ascend's "
            "additional_config 'sparse_kv_offload_config.enabled'=True: both would offload the "
            "SFA main KV; ours replaces vllm-ascend's manager in the SFA decode path, so set "
            "'sparse_kv_offload_config.enabled' to False (or ours to False)")


def vllm_ascend_available() -> bool:
    """vllm-ascend is installed (its modules are not imported)."""
    return importlib.util.find_spec("vllm_ascend") is not None
