"""KV layout hook: make the layers of one physical slot alias one device allocation.

Why here and how: vLLM's engine core turns the per-layer KV specs and the memory
left after profiling into a ``KVCacheConfig`` (``get_kv_cache_configs`` in
``vllm/v1/core/kv_cache_utils.py``, called from ``EngineCore._initialize_kv_caches``)
*before* any worker allocates. Each ``KVCacheTensor`` of that config places its
layers in the one backing allocation (layer ``l``, block ``b`` at
``offset + l*layer_stride + b*block_stride``) and the workers'
``allocate_kv_cache`` only follows it. So sharing needs no allocator patch: we
re-plan the config with one representative layer per physical slot (vLLM's own
``get_kv_cache_config_from_groups``, so strides, padding and the resolved layout
stay vLLM's), which turns the freed bytes into more ``num_blocks``, and then give
every aliased layer its own single-layer ``KVCacheTensor`` at its
representative's offset. Block tables and cache groups are untouched.

It lives with the connectors because it imports vLLM (lazily) and knows the
connector names; the planning it applies is ``layerwise.plan``'s, vLLM-free.
``install_layout_hook()`` wraps the name in ``vllm.v1.engine.core``; the wrapper
is a no-op (vLLM's result returned unchanged, invariant I6) unless the
kv_transfer_config selects ``AscendStoreConnector`` - directly or as a child of
a multi connector - with ``use_layerwise: true``, or sparse decode offload
(the same wrapper applies that cut: ``sparse_decode/kv_cut.py``). Then it also enforces what
aliasing needs (device prefix caching off, no full CUDA graphs) with a startup
error instead of wrong answers.

Note: vLLM's memory check and ``max_model_len`` auto-fit run before the rewrite,
on the unshared size, so they stay conservative.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ascend_offload.config import ConfigError, StoreConnectorConfig, parse_extra_config
from ascend_offload.connectors.ours import our_connectors
from ascend_offload.kv_layout import layer_index
from ascend_offload.layerwise.plan import LayerSpec, LayerwisePlan, plan_layers
from ascend_offload.patches import apply_patch, restore_patch

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)

STORE_CONNECTOR = "AscendStoreConnector"
_MARK = "_ascend_offload_layerwise_hook"


class LayerwiseStartupError(ConfigError):
    """The engine configuration cannot run with layer sharing; names the setting to change."""


# ------------------------------------------------------------------ settings


def layerwise_settings(vllm_config: VllmConfig) -> StoreConnectorConfig | None:
    """The layerwise store settings if this engine runs layer sharing, else ``None``
    (our ``AscendStoreConnector`` only, directly or in a multi connector; a same-named
    connector of another package, e.g. vllm-ascend's, is not parsed)."""
    for name, _role, extra in our_connectors(vllm_config):
        if name == STORE_CONNECTOR:
            cfg = parse_extra_config(STORE_CONNECTOR, extra)
            if cfg.use_layerwise:
                return cfg
    return None


def check_engine_constraints(vllm_config: VllmConfig) -> None:
    """Aliased layers keep no KV across steps on the device: refuse configs that assume so."""
    cache = vllm_config.cache_config
    if getattr(cache, "enable_prefix_caching", False):
        raise LayerwiseStartupError(
            "layerwise sharing (AscendStoreConnector use_layerwise=true) needs device prefix "
            "caching off on this instance: set enable_prefix_caching=False "
            "(--no-enable-prefix-caching); prefix hits are served by the store instead"
        )
    comp = getattr(vllm_config, "compilation_config", None)
    mode = getattr(comp, "cudagraph_mode", None)
    if mode is not None and getattr(mode, "has_full_cudagraphs", lambda: False)():
        raise LayerwiseStartupError(
            f"layerwise sharing needs per-layer connector hooks between layers: "
            f"compilation_config.cudagraph_mode={mode.name} captures whole forwards; "
            "use PIECEWISE or NONE (or enforce_eager=True)"
        )


# ------------------------------------------------------------------ planning


def layer_specs_from_groups(
    groups: Sequence[Any], num_hidden_layers: int | None = None
) -> list[LayerSpec]:
    """Planner inputs from vLLM cache groups: compatibility = (group, spec), MTP = layer index
    past ``num_hidden_layers``, indexer caches follow the attention layer of their index."""
    per_layer: list[tuple[int, str, Any, int]] = []
    for gi, group in enumerate(groups):
        spec = group.kv_cache_spec
        sub = getattr(spec, "kv_cache_specs", None)
        for name in group.layer_names:
            s = sub[name] if isinstance(sub, Mapping) else spec
            per_layer.append((gi, name, s, layer_index(name)))
    mains: dict[int, str] = {}
    for _, name, _, idx in per_layer:
        if "indexer" not in name and idx not in mains:
            mains[idx] = name
    out = []
    for gi, name, s, idx in sorted(per_layer, key=lambda t: (t[3], "indexer" in t[1], t[1])):
        follows = mains.get(idx) if "indexer" in name else None
        mtp = num_hidden_layers is not None and idx >= num_hidden_layers
        out.append(LayerSpec(name, compat=(gi, s), nbytes=int(s.page_size_bytes),
                             follows=follows, mtp=mtp))
    return out


def plan_from_groups(
    groups: Sequence[Any], cfg: StoreConnectorConfig, num_hidden_layers: int | None = None
) -> LayerwisePlan:
    """The plan the layout hook applies; the connector calls this too, so both agree."""
    return plan_layers(
        layer_specs_from_groups(groups, num_hidden_layers),
        num_shared_buffers=cfg.layerwise_num_shared_buffers,
        independent=cfg.layerwise_independent_layers,
    )


def plan_for_engine(vllm_config: VllmConfig, kv_cache_config: Any) -> LayerwisePlan | None:
    """The plan the layout hook applied to this engine (``None`` when layerwise is off).

    The connector's worker side calls this with the ``kv_cache_config`` vLLM hands it,
    so pipeline and allocation agree by construction."""
    cfg = layerwise_settings(vllm_config)
    if cfg is None:
        return None
    return plan_from_groups(kv_cache_config.kv_cache_groups, cfg, _num_hidden_layers(vllm_config))


def _num_hidden_layers(vllm_config: VllmConfig) -> int | None:
    mc = getattr(vllm_config, "model_config", None)
    hf = getattr(mc, "hf_text_config", None) or getattr(mc, "hf_config", None)
    n = getattr(hf, "num_hidden_layers", None)
    return int(n) if isinstance(n, int) else None


# ------------------------------------------------------------------ rewrite


def _physical_groups(groups: Sequence[Any], plan: LayerwisePlan) -> list[Any]:
    """The cache groups restricted to one representative (first) layer per slot."""
    reps = {buf.layers[0] for buf in plan.buffers}
    out = []
    for group in groups:
        names = [n for n in group.layer_names if n in reps]
        spec = group.kv_cache_spec
        sub = getattr(spec, "kv_cache_specs", None)
        if isinstance(sub, Mapping):
            spec = dataclasses.replace(spec, kv_cache_specs={n: sub[n] for n in names})
        out.append(dataclasses.replace(group, layer_names=names, kv_cache_spec=spec))
    return out


def rewrite_kv_cache_config(
    vllm_config: VllmConfig, config: Any, available_memory: int, plan: LayerwisePlan,
    num_blocks: int | None = None,
) -> Any:
    """``config`` with the plan's slots aliased and ``num_blocks`` grown by the saved bytes
    (or exactly ``num_blocks`` if given, to equalize workers)."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import KVCacheTensor

    if any(getattr(t, "host_resident", False) for t in config.kv_cache_tensors):
        raise LayerwiseStartupError(
            "layerwise sharing does not support host-resident (HiSparse) KV cache groups"
        )
    phys_groups = _physical_groups(config.kv_cache_groups, plan)
    phys = get_kv_cache_config_from_groups(vllm_config, phys_groups, available_memory)
    if num_blocks is not None and phys.num_blocks != num_blocks:
        per_block = phys.kv_cache_tensors[0].size // phys.num_blocks
        phys = get_kv_cache_config_from_groups(vllm_config, phys_groups, num_blocks * per_block)
    placed: dict[str, tuple[Any, int]] = {}
    for t in phys.kv_cache_tensors:
        for i, rep in enumerate(t.layers):
            placed[rep] = (t, t.offset + i * t.layer_stride)
    tensors = []
    for buf in plan.buffers:
        t, offset = placed[buf.layers[0]]
        for name in buf.layers:
            tensors.append(KVCacheTensor(
                size=t.size, layers=[name], layer_stride=t.layer_stride,
                block_stride=t.block_stride, offset=offset,
            ))
    return dataclasses.replace(config, num_blocks=phys.num_blocks, kv_cache_tensors=tensors)


def rewrite_kv_cache_configs(
    vllm_config: VllmConfig, configs: list[Any], available_memory: Sequence[int],
    cfg: StoreConnectorConfig,
) -> list[Any]:
    """Rewrite every worker's config; all end with the smallest worker's ``num_blocks``."""
    n_hidden = _num_hidden_layers(vllm_config)
    out = []
    plans: list[LayerwisePlan | None] = []
    for config, mem in zip(configs, available_memory, strict=True):
        if not config.kv_cache_tensors:
            out.append(config)
            plans.append(None)
            continue
        plan = plan_from_groups(config.kv_cache_groups, cfg, n_hidden)
        plans.append(plan)
        out.append(rewrite_kv_cache_config(vllm_config, config, mem, plan))
    sized = [c.num_blocks for c, p in zip(out, plans, strict=True) if p is not None]
    if sized and len(set(sized)) > 1:
        low = min(sized)
        out = [
            c if p is None else rewrite_kv_cache_config(vllm_config, orig, mem, p, num_blocks=low)
            for c, orig, mem, p in zip(out, configs, available_memory, plans, strict=True)
        ]
    for before, after, used in zip(configs, out, plans, strict=True):
        if used is not None:
            log.info(
                "ascend-offload layerwise: %d cache layers share %d physical buffers "
                "(independent=%s, B=%d); KV blocks %d -> %d",
                used.num_logical, used.num_physical, cfg.layerwise_independent_layers,
                cfg.layerwise_num_shared_buffers, before.num_blocks, after.num_blocks,
            )
    return out


# ------------------------------------------------------------------ install


def _wrap(original: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
    def get_kv_cache_configs(vllm_config: VllmConfig, kv_cache_specs: Any, available_memory: Any) -> list[Any]:
        from ascend_offload.connectors.sparse_decode.kv_cut import (
            cut_kv_cache_configs,
            sparse_decode_settings,
        )

        configs = original(vllm_config, kv_cache_specs, available_memory)
        cfg = layerwise_settings(vllm_config)
        if cfg is not None:
            from ascend_offload.connectors.logging_setup import wire_logging

            wire_logging()  # the engine core builds no connector before this runs
        sparse = sparse_decode_settings(vllm_config)
        if cfg is not None and sparse is not None:
            raise LayerwiseStartupError(
                "layerwise sharing (use_layerwise=true) and sparse decode offload "
                "('sparse_offload.enabled') in one engine: one instance prefills layerwise, "
                "another decodes from the host pool")
        if sparse is not None:
            return cut_kv_cache_configs(vllm_config, configs, available_memory, sparse)
        if cfg is None:
            return configs
        check_engine_constraints(vllm_config)
        return rewrite_kv_cache_configs(vllm_config, configs, available_memory, cfg)

    setattr(get_kv_cache_configs, _MARK, original)
    get_kv_cache_configs.__doc__ = original.__doc__
    return get_kv_cache_configs


def install_layout_hook() -> None:
    """Wrap vLLM's engine-core ``get_kv_cache_configs`` (idempotent; no effect while the
    layerwise store is not configured). Called from ``plugin.register()``."""
    try:
        import vllm.v1.engine.core as core
    except ImportError:  # no vLLM (domain tests, CLI): nothing to hook
        return
    current = core.get_kv_cache_configs
    if getattr(current, _MARK, None) is not None:
        return
    apply_patch("engine_core.kv_layout", core, _wrap(current))


def uninstall_layout_hook() -> None:
    """Undo :func:`install_layout_hook` (tests)."""
    try:
        import vllm.v1.engine.core as core
    except ImportError:
        return
    original = getattr(core.get_kv_cache_configs, _MARK, None)
    if original is not None:
        restore_patch("engine_core.kv_layout", core, original)
