"""Every shipped launch config passes ``check-config`` (a stale key fails here, not at a user's start)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ascend_offload import cli

ROOT = Path(__file__).resolve().parents[3] / "configs"
# configs/ascend: the Ascend deployment (docs/ascend.md), with Memcache confs and proxy args
ASCEND = sorted(p for p in (ROOT / "ascend").iterdir() if p.suffix in (".json", ".conf", ".args"))
CONFIGS = sorted(ROOT.glob("*.json")) + ASCEND


def test_configs_exist() -> None:
    assert len(CONFIGS) >= 4
    assert {p.name for p in ASCEND} == {"prefill.json", "decode-sparse.json", "proxy.args",
                                        "mmc-meta.conf", "mmc-local.conf"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_is_valid(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check-config", str(path)]) == 0, capsys.readouterr().err
