"""vllm-ascend integration: our sparse decode in its SFA decode path, our layerwise layout
in its NPU model runner (docs/vllm-ascend.md).

Written against vllm-ascend ``main`` at 182b75ea84ff (2026-08-22; the vLLM it targets:
v0.27.1 release, main cdc4824a). vllm_ascend is never imported here at module load:
:func:`install` (called by ``plugin.register`` only when vllm_ascend is importable)
registers two patches applied when vllm-ascend imports the patched modules, each a
no-op while our matching config is off:

* ``vllm_ascend.attention.sfa_v1.AscendSFABackend.get_impl_cls`` -> our SFA impl
  when ``sparse_offload.enabled`` (``sfa.py``);
* ``vllm_ascend.worker.model_runner_v1.apply_layerwise_kv_cache_plan`` -> our plan
  when our ``AscendStoreConnector`` runs ``use_layerwise`` (``runner.py``).

With sparse decode on, the caches vllm-ascend registers (main KV paged as
``(k_cache, v_cache)`` pairs) are accepted by our connectors while installed
(``registration.py``; ``connectors/sparse_decode/settings.accept_paged_main_kv``).

:func:`uninstall` restores both (and our engine-core layout hook if install
stood it down).
"""

from __future__ import annotations

import logging
from types import ModuleType

from ascend_offload.integrations.vllm_ascend import _imports, runner, sfa
from ascend_offload.integrations.vllm_ascend.settings import vllm_ascend_available

log = logging.getLogger(__name__)

VERSION = "vllm-ascend main 182b75ea84ff13ece27b57391331ef8935410aea (2026-08-22)"

_state = {"installed": False, "engine_hook_removed": False}


def _stand_down_engine_hook() -> None:
    """Our engine-core hook writes vLLM 0.32 descriptors (``layers`` + offsets); a vLLM whose
    ``KVCacheTensor`` has ``shared_by`` instead gets its aliasing from the runner patch, and
    sparse decode keeps the main KV paged there (``registration``: the engine core marks
    the configs with the main layers and row bytes instead of cutting them)."""
    try:
        from vllm.v1.kv_cache_interface import KVCacheTensor
    except ImportError:
        return
    fields = getattr(KVCacheTensor, "__dataclass_fields__", {})
    if "shared_by" in fields and "layers" not in fields:
        from ascend_offload.connectors import kv_layout_hook
        from ascend_offload.integrations.vllm_ascend import registration

        kv_layout_hook.uninstall_layout_hook()
        registration.install_engine_marker()
        _state["engine_hook_removed"] = True


def _on_sfa(module: ModuleType) -> None:
    sfa.patch_backend(module)


def _on_runner(module: ModuleType) -> None:
    runner.patch_runner(module)


def install() -> bool:
    """Register the patches (idempotent); False when vllm_ascend is not installed."""
    if _state["installed"]:
        return True
    if not vllm_ascend_available():
        return False
    from ascend_offload.connectors.sparse_decode.settings import accept_paged_main_kv

    _stand_down_engine_hook()
    accept_paged_main_kv(True)
    _imports.when_imported(sfa.SFA_MODULE, _on_sfa)
    _imports.when_imported(runner.RUNNER_MODULE, _on_runner)
    _state["installed"] = True
    log.debug("ascend-offload: vllm-ascend integration registered (%s)", VERSION)
    return True


def uninstall() -> None:
    """Undo :func:`install` (tests)."""
    import sys

    from ascend_offload.connectors.sparse_decode.settings import accept_paged_main_kv

    for name, undo in ((sfa.SFA_MODULE, sfa.unpatch_backend),
                       (runner.RUNNER_MODULE, runner.unpatch_runner)):
        _imports.forget(name)
        module = sys.modules.get(name)
        if module is not None:
            undo(module)
    accept_paged_main_kv(False)
    if _state["engine_hook_removed"]:
        from ascend_offload.connectors import kv_layout_hook
        from ascend_offload.integrations.vllm_ascend import registration

        registration.uninstall_engine_marker()
        kv_layout_hook.install_layout_hook()
        _state["engine_hook_removed"] = False
    _state["installed"] = False


__all__ = ["VERSION", "install", "uninstall", "vllm_ascend_available"]
