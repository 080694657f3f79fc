"""``check-config`` on the Ascend launch files: Memcache confs and proxy arguments, and
what the shipped Ascend kv-transfer configs select."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ascend_offload import cli
from ascend_offload.check_config import check_file, check_memcache_conf, check_proxy_args
from ascend_offload.config import ConfigError

ASCEND = Path(__file__).resolve().parents[3] / "configs" / "ascend"
META = "ock.mmc.meta_service_url = tcp://10.0.0.1:5000\n"


@pytest.mark.parametrize("text, why", [
    (META + "ock.mmc.local_service.protocol = udp\n", "local_service.protocol"),
    (META + "ock.mmc.local_service.dram.size = lots\n", "dram.size"),
    (META + "ock.mmc.evict_threshold_high = 100\n", "evict_threshold_high"),
    (META + "ock.mmc.evict_threshold_high = 60\nock.mmc.evict_threshold_low = 70\n", "must be below"),
    (META + "mmc.meta_service_url = tcp://h:1\n", "not a Memcache key"),
    (META + "just words\n", "expected 'key = value'"),
    ("ock.mmc.meta_service_url = 10.0.0.1:5000\n", "tcp://host:port"),
    ("ock.mmc.log_level = info\n", "meta_service_url' is required"),
])
def test_bad_memcache_conf_is_named(text: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        check_memcache_conf(text, where="x.conf")


def test_memcache_conf_passes_other_keys_through() -> None:
    got = check_memcache_conf(META + "# c\n\nock.mmc.meta.ha.enable = false\n", where="x.conf")
    assert got == {"ock.mmc.meta_service_url": "tcp://10.0.0.1:5000", "ock.mmc.meta.ha.enable": "false"}


def test_proxy_args_use_the_proxys_own_validation() -> None:
    ok = check_proxy_args("# c\n--prefiller-ports 8100\n--decoder-ports 8200 8201\n", where="p.args")
    assert ok["decoders"] == [("127.0.0.1", 8200), ("127.0.0.1", 8201)]
    with pytest.raises(ConfigError, match="--decoder-ports"):
        check_proxy_args("--prefiller-ports 8100\n", where="p.args")
    with pytest.raises(ConfigError, match="decoder"):
        check_proxy_args("--prefiller-ports 8100\n--decoder-hosts a b c\n--decoder-ports 1 2\n", where="p.args")


def test_cli_reports_a_bad_conf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "mmc-local.conf"
    bad.write_text(META + "ock.mmc.local_service.world_size = 0\n")
    assert cli.main(["check-config", str(bad)]) == 2
    assert "world_size" in capsys.readouterr().err
    assert cli.main(["check-config", str(tmp_path / "missing.conf")]) == 2


def test_shipped_ascend_deployment_is_consistent() -> None:
    """Prefill and decode use the same MemFabric protocol (decode advertises it, prefill
    refuses another), and the prefill store's Memcache block matches mmc-local.conf."""
    prefill = check_file(ASCEND / "prefill.json")
    decode = check_file(ASCEND / "decode-sparse.json")
    store, rd2h = (c["kv_connector_extra_config"] for c in prefill["kv_connector_extra_config"]["connectors"])
    dx = decode["kv_connector_extra_config"]
    assert rd2h["transfer_backend"] == dx["transfer_backend"] == "memfabric"
    assert rd2h["memfabric_transfer_protocol"] == dx["memfabric_transfer_protocol"]
    assert dx["sparse_offload"]["enabled"] and not rd2h["sparse_offload"]["enabled"]
    assert store["backend"] == "memcache" and store["use_layerwise"]
    local = check_file(ASCEND / "mmc-local.conf")
    meta = check_file(ASCEND / "mmc-meta.conf")
    mc = store["memcache"]
    assert local["ock.mmc.meta_service_url"] == meta["ock.mmc.meta_service_url"] == mc["meta_service_url"]
    assert local["ock.mmc.local_service.config_store_url"] == mc["config_store_url"]
    assert meta["ock.mmc.meta_service.config_store_url"] == mc["config_store_url"]
    assert local["ock.mmc.local_service.protocol"] == mc["protocol"]
    assert local["ock.mmc.local_service.dram.size"] == mc["dram_size"]
    proxy = check_file(ASCEND / "proxy.args")
    raw = json.loads((ASCEND / "prefill.json").read_text())
    assert raw["kv_port"] == raw["kv_connector_extra_config"]["connectors"][1]["kv_port"]
    assert proxy["prefillers"] and proxy["decoders"]
