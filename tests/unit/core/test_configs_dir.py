"""Every shipped launch config passes ``check-config`` (a stale key fails here, not at a user's start)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ascend_offload import cli

CONFIGS = sorted((Path(__file__).resolve().parents[3] / "configs").glob("*.json"))


def test_configs_exist() -> None:
    assert len(CONFIGS) >= 4


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_is_valid(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check-config", str(path)]) == 0, capsys.readouterr().err
