"""vLLM general-plugin entry point (runs in every vLLM process).

It only registers names (our connectors; our sparse-attention model's config type
and architecture, imported only when an engine loads that architecture) and
installs the KV-layout hook; with none of our connectors or models selected
nothing of ours runs (invariant I6).
"""

from __future__ import annotations

import importlib.util
import logging

log = logging.getLogger(__name__)

# connector name -> (module, class); a module that is absent is skipped.
CONNECTORS: dict[str, tuple[str, str]] = {
    "AscendStoreConnector": ("ascend_offload.connectors.store", "AscendStoreConnector"),
    "SfaRemoteD2HConnector": ("ascend_offload.connectors.remote_d2h", "SfaRemoteD2HConnector"),
    "AscendMultiConnector": ("ascend_offload.connectors.multi", "AscendMultiConnector"),
    "AscendSparseDecodeConnector": ("ascend_offload.connectors.sparse_decode",
                                    "AscendSparseDecodeConnector"),
}

_registered = False


def register_connectors() -> list[str]:
    """Register our connector names with vLLM's factory; returns the names registered.

    A name already taken (e.g. by vllm-ascend) is skipped with a warning: users can
    still select ours with ``kv_connector_module_path``.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    done = []
    for name, (module, cls) in CONNECTORS.items():
        if importlib.util.find_spec(module) is None:
            continue
        if name in KVConnectorFactory._registry:
            log.warning(
                "ascend-offload: connector name %r is already registered (vllm-ascend?); "
                "select ours with kv_connector_module_path=%r",
                name,
                module,
            )
            continue
        KVConnectorFactory.register_connector(name, module, cls)
        done.append(name)
    return done


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group; idempotent."""
    global _registered
    if _registered:
        return
    _registered = True
    register_connectors()
    from ascend_offload.models import register_models

    register_models()
    if importlib.util.find_spec("ascend_offload.connectors.kv_layout_hook") is not None:
        from ascend_offload.connectors import kv_layout_hook

        hook = getattr(kv_layout_hook, "install_layout_hook", None)
        if hook is not None:
            hook()
    if importlib.util.find_spec("vllm_ascend") is not None:
        from ascend_offload.integrations import vllm_ascend

        vllm_ascend.install()
