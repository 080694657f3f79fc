"""The store connector's settings, derived once from vLLM's config and checked at start-up.

Why one place: the scheduler and every worker rank must agree on page size, page
count and key fingerprint, so both roles take them from this object; a bad
combination fails here naming the key (I7).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ascend_offload.config import (
    ConfigError,
    StoreConnectorConfig,
    check_store_backend,
    parse_extra_config,
)
from ascend_offload.store.keys import layout_fingerprint
from ascend_offload.store.shared.backends import SHARED_BACKENDS
from ascend_offload.store.weights_id import weights_identity

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

NAME = "AscendStoreConnector"


def object_bytes(kv_cache_config: KVCacheConfig) -> int:
    """Bytes of one block across all cache-bearing layers on one rank.

    A group whose layers differ in page size (the sparse model: main KV and indexer
    cache of every layer in one group) carries a per-layer spec mapping
    (``UniformTypeKVCacheSpecs.kv_cache_specs``); its ``page_size_bytes`` is already
    the sum over its layers, so each layer counts with its own page size."""
    group = kv_cache_config.kv_cache_groups[0]
    spec = group.kv_cache_spec
    per_layer = getattr(spec, "kv_cache_specs", None)
    if isinstance(per_layer, Mapping):
        return sum(int(per_layer[name].page_size_bytes) for name in group.layer_names)
    return int(spec.page_size_bytes) * len(group.layer_names)


@dataclasses.dataclass(frozen=True)
class StoreSettings:
    cfg: StoreConnectorConfig
    block_size: int  # tokens per vLLM block = per store object
    hash_ratio: int  # vLLM block hashes per block (the last one names the block)
    object_bytes: int  # one block across all layers on one rank
    page_bytes: int  # one store page per rank (== object_bytes)
    num_pages: int  # store pages per rank
    world_size: int  # worker ranks that each hold a shard of every object
    fingerprint: str  # model + KV layout + parallelism: part of every key
    engine_id: str
    # the weights the KV is computed with (store/weights_id.py): what a persisted SSD index
    # must match besides the fingerprint; "" when nothing is persisted
    weights_id: str = ""

    @property
    def layerwise(self) -> bool:
        return self.cfg.use_layerwise

    @property
    def shared_tier(self) -> bool:
        """Backend ``mooncake`` or ``memcache``: local pages plus that shared store behind them."""
        return self.cfg.backend in SHARED_BACKENDS

    @property
    def ssd_tier(self) -> bool:
        """``local.ssd`` is set: an SSD tier under the host pages (connectors/store/ssd.py)."""
        return self.cfg.local.ssd is not None

    @property
    def partial_prefix(self) -> str:
        """Key prefix of partial blocks (layerwise): private to this engine, never published."""
        return f"partial:{self.engine_id}"

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> StoreSettings:
        tc = vllm_config.kv_transfer_config
        assert tc is not None
        cfg: StoreConnectorConfig = parse_extra_config(NAME, tc.kv_connector_extra_config)
        check_store_backend(cfg)
        if kv_cache_config is None:
            raise ConfigError(f"{NAME} needs the KV cache config (vLLM >= 0.11)")
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise ConfigError(
                f"{NAME} supports models with one KV cache group, got "
                f"{len(kv_cache_config.kv_cache_groups)}"
            )
        if cfg.use_layerwise and vllm_config.cache_config.enable_prefix_caching:
            raise ConfigError(
                "key 'use_layerwise'=True needs vLLM's device prefix caching off: layers that "
                "share a physical buffer cannot keep cached blocks (set "
                "enable_prefix_caching=False / --no-enable-prefix-caching)"
            )
        block_size = vllm_config.cache_config.block_size
        hash_bs = kv_cache_config.hash_block_size or block_size
        if block_size % hash_bs:
            raise ConfigError(f"block_size {block_size} is not a multiple of hash block size {hash_bs}")
        obj = object_bytes(kv_cache_config)
        page_bytes = cfg.local.page_bytes or obj
        if page_bytes != obj:
            raise ConfigError(
                f"key 'local.page_bytes'={page_bytes}: must equal one block across all "
                f"layers on one rank ({obj} bytes) or be unset"
            )
        num_pages = cfg.local.capacity_bytes // page_bytes
        if num_pages < 1:
            raise ConfigError(
                f"key 'local.capacity_bytes'={cfg.local.capacity_bytes}: holds no block "
                f"of {page_bytes} bytes (accepted: >= {page_bytes})"
            )
        pc = vllm_config.parallel_config
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        mc = vllm_config.model_config
        return cls(
            cfg=cfg,
            block_size=block_size,
            hash_ratio=block_size // hash_bs,
            object_bytes=obj,
            page_bytes=page_bytes,
            num_pages=num_pages,
            world_size=pc.tensor_parallel_size * pc.pipeline_parallel_size,
            fingerprint=layout_fingerprint(
                vllm_config.model_config.model, spec, block_size,
                pc.tensor_parallel_size, pc.pipeline_parallel_size,
            ),
            engine_id=str(tc.engine_id),
            weights_id=persisted_weights_id(cfg, mc.model, getattr(mc, "revision", None)),
        )


def persisted_weights_id(cfg: StoreConnectorConfig, model: str, revision: str | None) -> str:
    """The weights identity a persisted SSD index is kept under ("" without ``persist``).
    Why: the key fingerprint does not cover the weights, so after an in-place checkpoint
    update a restart would serve the old weights' KV. The identity comes from the model's
    files (config + weight files' sizes and modification times); when they are not on
    disk here, ``model_tag`` must name the weights (change it with them)."""
    ssd = cfg.local.ssd
    if ssd is None or not ssd.persist:
        return ""
    found = weights_identity(model, revision)
    if found is not None:
        return f"files:{found}"
    if cfg.model_tag:
        return f"model_tag:{cfg.model_tag}"
    raise ConfigError(
        f"key 'local.ssd.persist'=True: the weights of model {model!r} are not in a local "
        "directory, so a restart after a weight update could not tell its KV apart; set "
        "'model_tag' to name the weights (and change it when they change), or persist: false")
