"""Which connector entries of an engine's ``kv_transfer_config`` are this package's.

Why ownership matters: vllm-ascend registers connectors under the same names as
ours (``AscendStoreConnector``, ``SfaRemoteD2HConnector``); ``plugin.py`` then
skips our registration and users select ours with ``kv_connector_module_path``.
An entry is ours only if its name resolves to a class of this package, so other
connectors of the same name (and their extra-config keys, which our strict
schemas would refuse) are left alone. Used wherever the engine core must know
what our connectors will do before they exist (the KV layout hooks).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig

MULTI_CONNECTORS = ("AscendMultiConnector", "MultiConnector")
_OUR_PREFIX = "ascend_offload."


def connector_is_ours(name: str | None, module_path: str | None) -> bool:
    """``name`` (with ``module_path``, as vLLM's factory resolves them) is one of our classes."""
    if not name:
        return False
    if module_path:
        return module_path == "ascend_offload" or module_path.startswith(_OUR_PREFIX)
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:  # no vLLM: only our own names can be meant
        return True
    if name not in KVConnectorFactory._registry:
        return False
    cls = KVConnectorFactory.get_connector_class_by_name(name)
    return getattr(cls, "__module__", "").startswith(_OUR_PREFIX)


def our_connectors(vllm_config: VllmConfig) -> Iterator[tuple[str, str | None, Mapping[str, Any]]]:
    """(name, kv_role, extra config) of every connector of ours the engine runs, the
    children of a multi connector included (a child without its own role has the parent's)."""
    kvt = getattr(vllm_config, "kv_transfer_config", None)
    if kvt is None:
        return
    name = getattr(kvt, "kv_connector", None)
    role = getattr(kvt, "kv_role", None)
    extra = getattr(kvt, "kv_connector_extra_config", None) or {}
    if name in MULTI_CONNECTORS:
        for child in extra.get("connectors", []) or []:
            if isinstance(child, Mapping) and connector_is_ours(
                    child.get("kv_connector"), child.get("kv_connector_module_path")):
                yield (child["kv_connector"], child.get("kv_role", role),
                       child.get("kv_connector_extra_config") or {})
    elif name is not None and connector_is_ours(name, getattr(kvt, "kv_connector_module_path", None)):
        yield name, role, extra
