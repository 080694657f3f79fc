"""``AscendStoreConnector``, split by role like vLLM's offloading connector.

``connector`` (the facade vLLM instantiates), ``settings`` (checked start-up
settings), ``metadata`` (scheduler <-> worker messages), ``scheduler`` and
``worker`` (one object per role and mode). This package path is what
``kv_connector_module_path`` names.
"""

from ascend_offload.connectors.store.connector import AscendStoreConnector
from ascend_offload.connectors.store.settings import NAME

__all__ = ["NAME", "AscendStoreConnector"]
