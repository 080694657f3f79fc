"""``ascend-offload plan``: output shape and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ascend_offload.cli import main as cli_main
from ascend_offload.layerwise.plan_cli import main


def test_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--num-layers", "8", "--shared-buffers", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["physical_buffers"] == 3
    assert data["assignment"] == [0, 1, 2, 1, 2, 1, 2, 1]
    assert data["footprint_ratio"] == pytest.approx(0.375)


def test_independent_negative_and_mtp(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--num-layers", "8", "--shared-buffers", "3", "--independent", "0,-1",
               "--mtp-layers", "1", "--json"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert data["physical_buffers"] == 2 + 3
    assert data["assignment"][0] != data["assignment"][-1]
    assert len(data["assignment"]) == 9


def test_all(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--num-layers", "4", "--shared-buffers", "1", "--independent", "all", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["assignment"] == [0, 1, 2, 3] and data["footprint_ratio"] == 1.0


def test_text_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["plan", "--num-layers", "4", "--shared-buffers", "1"]) == 0
    out = capsys.readouterr().out
    assert "physical buffers: 2" in out and "layers.3" in out


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["--num-layers", "8", "--shared-buffers", "0"], "--shared-buffers"),
        (["--num-layers", "8", "--shared-buffers", "2", "--independent", "0,8"], "--independent"),
        (["--num-layers", "8", "--shared-buffers", "2", "--independent", "1,-7"], "--independent"),
        (["--num-layers", "8", "--shared-buffers", "2", "--independent", "a"], "--independent"),
        (["--num-layers", "0", "--shared-buffers", "2"], "--num-layers"),
        (["--num-layers", "4", "--shared-buffers", "2", "--mtp-layers", "-1"], "--mtp-layers"),
        (["--num-layers", "x", "--shared-buffers", "2"], "--num-layers"),
        (["--num-layers", "4"], "--shared-buffers"),
    ],
)
def test_bad_input_exit_2_names_option(
    argv: list[str], option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert option in capsys.readouterr().err


def test_console_entry_exit_code() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ascend_offload.cli", "plan", "--num-layers", "8",
         "--shared-buffers", "0"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode == 2
    assert "--shared-buffers" in proc.stderr
