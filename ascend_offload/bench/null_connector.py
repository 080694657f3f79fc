"""A KV connector that moves nothing: what vLLM itself runs per step once any
connector is configured, as a reference engine for ``bench sparse-e2e``.

Why: ``hybrid_step_ratio`` compares an engine with our connector against one with
none. With any connector vLLM adds per-step work of its own that no connector can
skip: the scheduler builds and ships connector metadata, the model runner binds it
and collects a connector output around every forward, and every attention layer
runs through vLLM's transfer wrapper. Measured in the same rounds, this engine
separates vLLM's share of a ratio from ours.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)


class NullConnector(KVConnectorBase_V1):
    """Every hook returns at once; no request ever has external tokens."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()
