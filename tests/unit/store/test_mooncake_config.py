"""The ``backend: mooncake`` keys of the store connector config, and the backend's
startup checks that need no master."""

from __future__ import annotations

import pytest

from ascend_offload.bench.stores.mooncake import MooncakeStore
from ascend_offload.config import ConfigError, MooncakeStoreConfig, StoreConnectorConfig, parse
from ascend_offload.store.base import StoreError


def test_mooncake_section_parses() -> None:
    cfg = parse(StoreConnectorConfig, {"backend": "mooncake", "mooncake": {
        "master_address": "10.0.0.5:50051", "protocol": "rdma", "device_name": "mlx5_0",
        "global_segment_bytes": 4 << 30}}, where="store config")
    assert cfg.backend == "mooncake"
    assert cfg.mooncake.master_address == "10.0.0.5:50051"
    assert cfg.mooncake.protocol == "rdma" and cfg.mooncake.global_segment_bytes == 4 << 30
    assert cfg.mooncake.metadata_server == "P2PHANDSHAKE"
    assert parse(StoreConnectorConfig, {}, where="x").backend == "local"  # off by default


@pytest.mark.parametrize("raw, key", [
    ({"protocol": "udp"}, "mooncake.protocol"),
    ({"global_segment_bytes": 1 << 20}, "mooncake.global_segment_bytes"),
    ({"retry_interval_s": 0}, "mooncake.retry_interval_s"),
    ({"master": "x:1"}, "mooncake.master"),
])
def test_bad_mooncake_keys_are_named(raw: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=f"key '{key}'"):
        parse(StoreConnectorConfig, {"backend": "mooncake", "mooncake": raw}, where="store config")


def test_backend_needs_a_master_address() -> None:
    with pytest.raises(StoreError, match="master_address"):
        MooncakeStore(master_address="", page_bytes=4096, staging_bytes=1 << 20)
    assert MooncakeStoreConfig().master_address == ""


def test_store_connector_needs_the_master_address() -> None:
    """Backend 'mooncake' without a master fails at start naming the key, never falls
    back to the local pool alone."""
    from types import SimpleNamespace

    from ascend_offload.connectors.store.settings import StoreSettings

    vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(
        kv_connector_extra_config={"backend": "mooncake", "mooncake": {"protocol": "tcp"}}))
    with pytest.raises(ConfigError, match=r"key 'mooncake\.master_address'"):
        StoreSettings.from_vllm(vllm_config, None)  # type: ignore[arg-type]


def test_segment_zero_means_none() -> None:
    """0 contributes no memory (objects live in other clients' segments); Mooncake's
    16 MiB floor holds for any other size."""
    cfg = parse(StoreConnectorConfig, {"backend": "mooncake", "mooncake": {
        "master_address": "h:1", "global_segment_bytes": 0}}, where="store config")
    assert cfg.mooncake.global_segment_bytes == 0
