"""Every monkeypatch of vLLM and vllm-ascend, listed in one place and applied through it.

Why one registry: a patch replaces code we do not own, so a reader (or a vLLM upgrade)
must find all of them without grepping: what is replaced, why, when it is put in place
and how it is taken out. :func:`apply_patch` and :func:`restore_patch` are the only
writers of a patched attribute (``tests/unit/core/test_patches.py`` checks the call
sites in the package against :data:`PATCHES`, and that nothing else assigns a patched
attribute). Each patch keeps its idempotence marker and its wrapper in its own module;
this module imports neither vLLM nor vllm-ascend.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Patch:
    """One replaced attribute: ``owner.attr`` (``target`` names it in full)."""

    target: str  # dotted path of the replaced attribute
    attr: str  # the attribute set on its owner (module or class)
    why: str
    when: str  # who applies it, and at which moment
    undo: str  # how it is taken out
    where: str  # our module holding the wrapper


PATCHES: dict[str, Patch] = {
    "engine_core.kv_layout": Patch(
        target="vllm.v1.engine.core.get_kv_cache_configs",
        attr="get_kv_cache_configs",
        why="the engine core sizes and lays out the KV cache before any connector exists: "
            "layerwise sharing (use_layerwise) aliases the cache layers onto B buffers, and "
            "sparse decode cuts the main KV off the device; a no-op when neither is configured",
        when="plugin.register() in every vLLM process (install_layout_hook; idempotent); "
             "stood down by the vllm-ascend integration on a vLLM whose KVCacheTensor has "
             "shared_by (the runner patch aliases there)",
        undo="uninstall_layout_hook() puts back the original the wrapper keeps",
        where="ascend_offload.connectors.kv_layout_hook",
    ),
    "engine_core.paged_main_kv_marker": Patch(
        target="vllm.v1.engine.core.get_kv_cache_configs",
        attr="get_kv_cache_configs",
        why="on vllm-ascend the main KV stays paged on the device: sparse decode marks each "
            "worker's KV cache config with the main layers and row bytes instead of cutting",
        when="vllm_ascend.install() (from plugin.register()), only where it stood down "
             "engine_core.kv_layout",
        undo="uninstall_engine_marker() (vllm_ascend.uninstall(), which reinstalls "
             "engine_core.kv_layout)",
        where="ascend_offload.integrations.vllm_ascend.registration",
    ),
    "vllm_ascend.runner.layerwise_plan": Patch(
        target="vllm_ascend.worker.model_runner_v1.apply_layerwise_kv_cache_plan",
        attr="apply_layerwise_kv_cache_plan",
        why="vllm-ascend's NPU runner applies its own layerwise plan when it allocates the KV "
            "cache; with our AscendStoreConnector on use_layerwise ours must be the plan",
        when="right after vllm-ascend imports its model runner (vllm_ascend.install() "
             "registers the import hook); a no-op while our layerwise store is off",
        undo="unpatch_runner() (vllm_ascend.uninstall())",
        where="ascend_offload.integrations.vllm_ascend.runner",
    ),
    "vllm_ascend.sfa.impl_cls": Patch(
        target="vllm_ascend.attention.sfa_v1.AscendSFABackend.get_impl_cls",
        attr="get_impl_cls",
        why="vllm-ascend's SFA decode must read its top-k rows from our host pool through "
            "the hot buffer (AscendOffloadSFAImpl) when sparse_offload.enabled",
        when="right after vllm-ascend imports its SFA backend (vllm_ascend.install() "
             "registers the import hook); a no-op while sparse offload is off",
        undo="unpatch_backend() (vllm_ascend.uninstall())",
        where="ascend_offload.integrations.vllm_ascend.sfa",
    ),
}


def apply_patch(name: str, owner: Any, value: Any) -> None:
    """Put ``value`` in place of the registered patch ``name``'s attribute on ``owner``."""
    setattr(owner, PATCHES[name].attr, value)


def restore_patch(name: str, owner: Any, original: Any) -> None:
    """Put the ``original`` attribute of patch ``name`` back on ``owner``."""
    setattr(owner, PATCHES[name].attr, original)
