from __future__ import annotations

import pytest

from ascend_offload.config import (
    MAX_TOPK_BUFFER_SIZE,
    ConfigError,
    SparseOffloadConfig,
    StoreConnectorConfig,
    parse_extra_config,
)
from ascend_offload.sparse.residency import MAX_HOT_SIZE


def test_defaults() -> None:
    cfg = parse_extra_config("AscendStoreConnector", {})
    assert isinstance(cfg, StoreConnectorConfig)
    assert cfg.backend == "local" and cfg.layerwise_independent_layers == [0]


@pytest.mark.parametrize(
    ("raw", "needles"),
    [
        ({"backend": "redis"}, ["'backend'", "'local'"]),
        ({"local": {"capacity_bytes": -5}}, ["local.capacity_bytes", "greater than 0"]),
        ({"bogus_key": 1}, ["'bogus_key'", "Extra inputs", "use_layerwise"]),
        ({"layerwise_independent_layers": [0, 0]}, ["layerwise_independent_layers", "duplicate"]),
        ({"layerwise_independent_layers": "some"}, ["layerwise_independent_layers", "'all'"]),
        ({"layerwise_num_shared_buffers": 0}, ["layerwise_num_shared_buffers"]),
    ],
)
def test_store_errors_name_key_and_accepted(raw: dict, needles: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        parse_extra_config("AscendStoreConnector", raw)
    for n in needles:
        assert n in str(e.value), (n, str(e.value))


def test_rd2h_errors() -> None:
    with pytest.raises(ConfigError, match=r"memfabric_transfer_protocol.*.sdma."):
        parse_extra_config("SfaRemoteD2HConnector", {"memfabric_transfer_protocol": "x"})
    with pytest.raises(ConfigError, match="unknown connector 'Nope'"):
        parse_extra_config("Nope", {})


def test_sparse_cross_checks() -> None:
    cfg = SparseOffloadConfig(enabled=True, topk_buffer_size=4096, index_topk=2048)
    cfg.check_against(block_size=128)
    with pytest.raises(ConfigError, match=r"topk_buffer_size.*index_topk=8192"):
        cfg.check_against(block_size=128, index_topk=8192)
    with pytest.raises(ConfigError, match="multiple of block_size=96"):
        cfg.check_against(block_size=96)


@pytest.mark.parametrize("value", [float("inf"), 1e300, float("nan"), 86400.5])
@pytest.mark.parametrize(("connector", "key"), [
    ("AscendStoreConnector", "load_timeout_s"),
    ("AscendStoreConnector", "save_timeout_s"),
    ("SfaRemoteD2HConnector", "read_timeout_s"),
    ("SfaRemoteD2HConnector", "ack_timeout_s"),
    ("SfaRemoteD2HConnector", "request_timeout_s"),
    ("SfaRemoteD2HConnector", "registration_timeout_s"),
])
def test_timeouts_are_capped(connector: str, key: str, value: float) -> None:
    """A deadline that would overflow a wait is refused at parse time, naming the cap."""
    with pytest.raises(ConfigError, match=rf"'{key}'.*less than or equal to 86400"):
        parse_extra_config(connector, {key: value})
    assert getattr(parse_extra_config(connector, {key: 86400}), key) == 86400


@pytest.mark.parametrize(("block", "key"), [
    ("mooncake", "staging_bytes"), ("mooncake", "page_bytes"), ("mooncake", "local_buffer_bytes"),
    ("memcache", "staging_bytes"), ("memcache", "page_bytes"),
])
def test_shared_tier_blocks_have_no_staging_keys(block: str, key: str) -> None:
    """The connector's shared tier moves bytes from its local pages: it has no staging buffer,
    so a key sizing one would do nothing and is refused like any unknown key."""
    with pytest.raises(ConfigError, match=rf"key '{block}\.{key}'=4096: Extra inputs are not permitted"):
        parse_extra_config("AscendStoreConnector", {"backend": block, block: {key: 4096}})


@pytest.mark.parametrize("backend", ["host", "device"])
def test_topk_buffer_size_over_the_table_limit_is_refused_at_parse_time(backend: str) -> None:
    """The residency tables hold at most 65534 hot rows (16-bit slots); the schema refuses
    more before an engine starts instead of at its first decode step."""
    raw = {"sparse_offload": {"enabled": True, "topk_buffer_size": 65536, "index_topk": 2048,
                              "residency_backend": backend}}
    with pytest.raises(ConfigError, match=r"key 'sparse_offload\.topk_buffer_size'=65536: .*<= 65534"):
        parse_extra_config("AscendSparseDecodeConnector", raw)
    raw["sparse_offload"]["topk_buffer_size"] = 65534
    assert parse_extra_config("AscendSparseDecodeConnector", raw).sparse_offload.topk_buffer_size == 65534
    assert MAX_TOPK_BUFFER_SIZE == MAX_HOT_SIZE  # the schema's limit is the tables' limit


def test_device_compile_is_checked_at_parse_time() -> None:
    """The device table's compile switch: auto by default, three values, anything else
    refused naming the key before an engine starts."""
    raw = {"sparse_offload": {"enabled": True, "residency_backend": "device"}}
    assert parse_extra_config("AscendSparseDecodeConnector", raw).sparse_offload.device_compile == "auto"
    for value in ("on", "off"):
        raw["sparse_offload"]["device_compile"] = value
        assert parse_extra_config("AscendSparseDecodeConnector", raw).sparse_offload.device_compile == value
    raw["sparse_offload"]["device_compile"] = "yes"
    with pytest.raises(ConfigError, match=r"sparse_offload\.device_compile"):
        parse_extra_config("AscendSparseDecodeConnector", raw)


@pytest.mark.parametrize("url", ["http://10.0.0.1:5000", "10.0.0.1:5000", "tcp://10.0.0.1",
                                 "tcp://10.0.0.1:0", "tcp://10.0.0.1:70000", "tcp://:5000",
                                 "tcp://host name:5000"])
@pytest.mark.parametrize("key", ["meta_service_url", "config_store_url"])
def test_memcache_urls_must_be_tcp_host_port(key: str, url: str) -> None:
    """Memcache parses its URLs only when the client starts (a bare return code then); the
    schema refuses a malformed one naming the key."""
    raw = {"backend": "memcache", "memcache": {"meta_service_url": "tcp://10.0.0.1:5000", key: url}}
    with pytest.raises(ConfigError, match=rf"key 'memcache\.{key}'=.*must be tcp://host:port"):
        parse_extra_config("AscendStoreConnector", raw)


@pytest.mark.parametrize("url", ["tcp://10.0.0.1:5000", "tcp://meta-0.pool.local:5000",
                                 "tcp://[fe80::1]:6000"])
def test_memcache_urls_accepted(url: str) -> None:
    raw = {"backend": "memcache", "memcache": {"meta_service_url": url, "config_store_url": url}}
    assert parse_extra_config("AscendStoreConnector", raw).memcache.meta_service_url == url
    # unset meta service: accepted here, refused when the backend starts (it is required)
    assert parse_extra_config("AscendStoreConnector", {}).memcache.meta_service_url == ""
