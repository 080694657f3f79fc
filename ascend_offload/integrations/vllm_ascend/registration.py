"""Sparse decode registration over vllm-ascend's KV allocation (main KV paged on the device).

Why: on the vLLM vllm-ascend ``main`` targets, our engine-core cut (which drops the
main KV from the device allocation and marks the config with its facts) stands down
(``__init__._stand_down_engine_hook``): the NPU runner allocates every layer, main
MLA caches as ``(k_cache, v_cache)`` pairs (nope | rope rows) and SFA indexer caches
as ``(k_cache[, scale])``, and vllm-ascend's SFA prefill reads the paged main KV.
Our connectors still need, on both roles, the same main-KV layers and row bytes to
size the host pool. vLLM hands the scheduler a copy of worker 0's config with its
per-layer specs collapsed to one per group (``generate_scheduler_kv_cache_config``),
so the facts are read in the engine core, where the per-layer specs are still
there, and carried on every config (instance attributes survive deepcopy and
pickle):

* main layers: the layers whose spec is not vllm-ascend's ``AscendSFAIndexerCacheSpec``
  (``vllm_ascend/core/kv_cache_interface.py``; the indexer shares the main layers'
  group and block ids);
* row: ``kv_lora_rank + qk_rope_head_dim`` of the model config, in the main specs'
  dtype (the dtype the runner gives the caches).

:func:`install_engine_marker` wraps the engine core's ``get_kv_cache_configs``
to apply :func:`mark_configs`; ``connectors/sparse_decode/settings.py`` reads the
mark only while the integration accepts it (``accept_paged_main_kv``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ascend_offload.config import ConfigError
from ascend_offload.connectors.sparse_decode.settings import PagedMainKV, mark_paged_main_kv
from ascend_offload.integrations.vllm_ascend import settings
from ascend_offload.patches import apply_patch, restore_patch

log = logging.getLogger(__name__)

SPEC_MODULE = "vllm_ascend.core.kv_cache_interface"
INDEXER_SPEC = "AscendSFAIndexerCacheSpec"
_MARK = "_ascend_offload_original_get_kv_cache_configs"


def _layer_specs(group: Any) -> Mapping[str, Any]:
    spec = group.kv_cache_spec
    sub = getattr(spec, "kv_cache_specs", None)
    return sub if isinstance(sub, Mapping) else {n: spec for n in group.layer_names}


def main_row(vllm_config: Any) -> int:
    """``kv_lora_rank + qk_rope_head_dim``: one token's main-KV row (nope | rope)."""
    hf = vllm_config.model_config.hf_config
    rank, rope = getattr(hf, "kv_lora_rank", None), getattr(hf, "qk_rope_head_dim", None)
    if not isinstance(rank, int) or not isinstance(rope, int):
        raise ConfigError(f"key 'sparse_offload.enabled'=True: model "
                          f"{vllm_config.model_config.model!r} has no MLA latent "
                          f"(kv_lora_rank={rank}, qk_rope_head_dim={rope})")
    return rank + rope


def paged_main_kv_facts(vllm_config: Any, kv_cache_config: Any) -> PagedMainKV:
    """Main layers and row bytes of one worker's (uncollapsed) vllm-ascend config."""
    import importlib

    indexer_cls = getattr(importlib.import_module(SPEC_MODULE), INDEXER_SPEC)
    mains = {n: s for g in kv_cache_config.kv_cache_groups for n, s in _layer_specs(g).items()
             if not isinstance(s, indexer_cls)}
    if not mains:
        raise ConfigError("key 'sparse_offload.enabled'=True: the model has no main-KV cache "
                          f"layer beside its {INDEXER_SPEC} layers; nothing to decode from a "
                          "host pool (accepted: False)")
    if len(mains) == sum(len(_layer_specs(g)) for g in kv_cache_config.kv_cache_groups):
        raise ConfigError("key 'sparse_offload.enabled'=True: the model has no SFA indexer "
                          f"cache ({INDEXER_SPEC}); nothing would select the rows to load")
    row = main_row(vllm_config)
    dtypes = {s.dtype for s in mains.values()}
    for name, s in mains.items():
        packed = (getattr(s, "scale_dim", 0) or getattr(s, "cache_sparse_sfa_c8", False)
                  or getattr(s, "compress_ratio", 1) != 1)
        if s.head_size != row or packed:
            raise ConfigError(
                f"key 'sparse_offload.enabled'=True: main-KV layer {name} has rows of "
                f"{s.head_size} values (scale_dim={getattr(s, 'scale_dim', 0)}, "
                f"c8={getattr(s, 'cache_sparse_sfa_c8', False)}, compress_ratio="
                f"{getattr(s, 'compress_ratio', 1)}); the host pool holds plain "
                f"kv_lora_rank + qk_rope_head_dim = {row} rows")
    if len(dtypes) != 1:
        raise ConfigError(f"key 'sparse_offload.enabled'=True: main-KV layers of dtypes "
                          f"{sorted(map(str, dtypes))}; one host pool needs one")
    dtype: torch.dtype = dtypes.pop()
    return PagedMainKV(tuple(mains), row * dtype.itemsize)


def mark_configs(vllm_config: Any, configs: Sequence[Any]) -> None:
    """Mark every worker's config (those that allocate) with its paged main-KV facts."""
    facts = None
    for c in configs:
        if c.kv_cache_tensors:
            facts = paged_main_kv_facts(vllm_config, c)
            mark_paged_main_kv(c, facts)
    if facts is not None:
        log.info("ascend-offload sparse decode on vllm-ascend: main KV of %d layers stays paged "
                 "on the device (no device-KV cut on this vLLM); decode rows are served from "
                 "the host pool (%d B rows)", len(facts.layers), facts.row_bytes)


def _wrap(original: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
    def get_kv_cache_configs(vllm_config: Any, kv_cache_specs: Any, available_memory: Any
                             ) -> list[Any]:
        configs = original(vllm_config, kv_cache_specs, available_memory)
        if settings.sparse_offload_settings(vllm_config) is not None:
            mark_configs(vllm_config, configs)
        return configs

    setattr(get_kv_cache_configs, _MARK, original)
    get_kv_cache_configs.__doc__ = original.__doc__
    return get_kv_cache_configs


def install_engine_marker() -> None:
    """Wrap ``vllm.v1.engine.core.get_kv_cache_configs`` (idempotent)."""
    import vllm.v1.engine.core as core

    if getattr(core.get_kv_cache_configs, _MARK, None) is None:
        apply_patch("engine_core.paged_main_kv_marker", core, _wrap(core.get_kv_cache_configs))


def uninstall_engine_marker() -> None:
    """Undo :func:`install_engine_marker`."""
    try:
        import vllm.v1.engine.core as core
    except ImportError:
        return
    original = getattr(core.get_kv_cache_configs, _MARK, None)
    if original is not None:
        restore_patch("engine_core.paged_main_kv_marker", core, original)
