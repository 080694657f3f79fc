"""The demo topology's launch configs (configs/cpu-demo/) pass ``check-config`` and fit together."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ascend_offload import cli
from ascend_offload.demo.run import CONFIG_DIR

CONFIGS = sorted([*CONFIG_DIR.glob("*.json"), *CONFIG_DIR.glob("*.args")])


def test_demo_configs_exist() -> None:
    assert {p.name for p in CONFIGS} >= {"prefill.json", "prefill-joint.json", "decode.json",
                                         "proxy.args"}
    assert (CONFIG_DIR / "README.md").is_file()


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_demo_config_is_valid(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check-config", str(path)]) == 0, capsys.readouterr().err


def test_roles_fit() -> None:
    decode = json.loads((CONFIG_DIR / "decode.json").read_text())
    assert decode["kv_role"] == "kv_consumer"
    assert decode["kv_connector_extra_config"]["sparse_offload"]["enabled"] is True
    for name in ("prefill.json", "prefill-joint.json"):
        assert json.loads((CONFIG_DIR / name).read_text())["kv_role"] == "kv_producer"
