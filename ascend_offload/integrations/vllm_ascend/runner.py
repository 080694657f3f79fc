"""Our layerwise KV layout in vllm-ascend's NPU model runner allocation.

Written against vllm-ascend ``main`` at 182b75ea84ff, ``vllm_ascend/worker/model_runner_v1.py``:
``NPUModelRunner.initialize_kv_cache(kv_cache_config)`` deep-copies the config and
calls the module-level ``apply_layerwise_kv_cache_plan(kv_cache_config, vllm_config)``
before ``initialize_kv_cache_tensors`` -> ``_allocate_kv_cache_tensors``, which
allocates one buffer per ``KVCacheTensor`` and hands it to every layer in its
``shared_by``. vllm-ascend's own plan function only acts for its own
``AscendStoreConnector`` on memcache; :func:`patch_runner` wraps that module
name so that, when *our* store connector runs layerwise, the runner allocates by
*our* plan (``connectors/kv_layout_hook.plan_from_groups``, the plan our
connector's pipeline uses), and otherwise vllm-ascend's function runs unchanged.

Two descriptor vocabularies:

* ``shared_by`` (the vLLM that vllm-ascend ``main`` targets): one descriptor per
  physical slot, ``shared_by`` = the slot's layers (what vllm-ascend's own plan
  writes too). ``num_blocks`` stays the engine core's: the freed bytes are not
  turned into blocks (our engine-core hook, which does that, speaks the other
  vocabulary and stands down, see ``__init__.install``).
* ``layers`` + offsets (vLLM 0.32): our engine-core hook already placed every
  aliased layer at its representative's offset; the runner side only checks it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from ascend_offload.connectors.kv_layout_hook import (
    LayerwiseStartupError,
    check_engine_constraints,
    plan_from_groups,
)
from ascend_offload.integrations.vllm_ascend import settings
from ascend_offload.layerwise.plan import LayerwisePlan
from ascend_offload.patches import apply_patch, restore_patch

log = logging.getLogger(__name__)

RUNNER_MODULE = "vllm_ascend.worker.model_runner_v1"
PLAN_FN = "apply_layerwise_kv_cache_plan"
_MARK = "_ascend_offload_original"


def uses_shared_by(tensors: Sequence[Any]) -> bool:
    """The descriptors name their layers in ``shared_by`` (not vLLM 0.32's ``layers``)."""
    return any(hasattr(t, "shared_by") and not hasattr(t, "layers") for t in tensors)


def _num_hidden_layers(vllm_config: Any) -> int | None:
    mc = getattr(vllm_config, "model_config", None)
    hf = getattr(mc, "hf_text_config", None) or getattr(mc, "hf_config", None)
    n = getattr(hf, "num_hidden_layers", None)
    return int(n) if isinstance(n, int) else None


def alias_shared_by(tensors: Sequence[Any], plan: LayerwisePlan) -> list[Any]:
    """One descriptor per physical slot of ``plan`` (``shared_by`` = its layers); descriptors
    of layers outside the plan are kept."""
    by_name: dict[str, Any] = {}
    for t in tensors:
        if len(t.shared_by) != 1:
            raise LayerwiseStartupError(
                f"layerwise sharing on vllm-ascend needs one KV cache descriptor per layer; "
                f"{list(t.shared_by)} already share one")
        by_name[t.shared_by[0]] = t
    planned = {n for buf in plan.buffers for n in buf.layers}
    missing = planned - by_name.keys()
    if missing:
        raise LayerwiseStartupError(f"layerwise plan names layers the runner does not allocate: "
                                    f"{sorted(missing)[:4]}")
    out = [t for t in tensors if t.shared_by[0] not in planned]
    for buf in plan.buffers:
        members = [by_name[n] for n in buf.layers]
        sizes = {m.size for m in members}
        if len(sizes) != 1:
            raise LayerwiseStartupError(f"layers {list(buf.layers)} share a buffer but their KV "
                                        f"cache sizes differ: {sorted(sizes)}")
        out.append(dataclasses.replace(members[0], shared_by=list(buf.layers)))
    return out


def check_aliased(tensors: Sequence[Any], plan: LayerwisePlan) -> None:
    """vLLM 0.32 descriptors: every layer of a slot starts where its representative does."""
    start = {name: t.offset + i * t.layer_stride
             for t in tensors for i, name in enumerate(t.layers)}
    for buf in plan.buffers:
        if len({start.get(n) for n in buf.layers}) != 1:
            raise LayerwiseStartupError(
                f"layers {list(buf.layers)} should share one KV buffer but the engine core's "
                "KVCacheConfig places them apart: the layout hook did not run in the engine "
                "core (ascend_offload.plugin.register must be loaded there)")


def apply_our_plan(kv_cache_config: Any, vllm_config: Any) -> LayerwisePlan:
    """Rewrite (``shared_by``) or check (``layers``) ``kv_cache_config`` in place by our plan."""
    cfg = settings.layerwise_store_settings(vllm_config)
    if cfg is None:
        raise ValueError("our layerwise store is not configured for this engine")
    check_engine_constraints(vllm_config)
    plan = plan_from_groups(kv_cache_config.kv_cache_groups, cfg, _num_hidden_layers(vllm_config))
    tensors = kv_cache_config.kv_cache_tensors
    if uses_shared_by(tensors):
        kv_cache_config.kv_cache_tensors = alias_shared_by(tensors, plan)
        log.info("ascend-offload layerwise (vllm-ascend runner): %d cache layers share %d "
                 "buffers", plan.num_logical, plan.num_physical)
    else:
        check_aliased(tensors, plan)
    return plan


def patch_runner(module: Any) -> None:
    """Wrap ``module.apply_layerwise_kv_cache_plan`` (idempotent)."""
    current = getattr(module, PLAN_FN)
    if getattr(current, _MARK, None) is not None:
        return

    def apply_layerwise_kv_cache_plan(kv_cache_config: Any, vllm_config: Any) -> None:
        if settings.layerwise_store_settings(vllm_config) is None:
            return current(kv_cache_config, vllm_config)
        apply_our_plan(kv_cache_config, vllm_config)
        return None

    setattr(apply_layerwise_kv_cache_plan, _MARK, current)
    apply_patch("vllm_ascend.runner.layerwise_plan", module, apply_layerwise_kv_cache_plan)


def unpatch_runner(module: Any) -> None:
    """Undo :func:`patch_runner`."""
    original = getattr(getattr(module, PLAN_FN), _MARK, None)
    if original is not None:
        restore_patch("vllm_ascend.runner.layerwise_plan", module, original)
