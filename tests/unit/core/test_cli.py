from __future__ import annotations

import json

import pytest

from ascend_offload import cli


def test_check_config_ok(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["check-config", json.dumps({"kv_connector": "AscendStoreConnector"})])
    assert rc == 0
    assert json.loads(capsys.readouterr().out)["kv_connector_extra_config"]["backend"] == "local"


def test_check_config_bad_key(capsys: pytest.CaptureFixture[str]) -> None:
    raw = {"kv_connector": "AscendStoreConnector", "kv_connector_extra_config": {"backend": "x"}}
    assert cli.main(["check-config", json.dumps(raw)]) == 2
    assert "'backend'" in capsys.readouterr().err


def test_unknown_command_and_bench(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["nope"]) == 2
    assert cli.main(["bench", "nope"]) == 2
    assert "bench needs one of" in capsys.readouterr().err


def test_bench_help_runs_nothing(capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench --help`` and ``bench all --help`` print usage and start no bench."""
    ran: list[str] = []
    monkeypatch.setattr(cli, "_run", lambda module, argv: ran.append(module) or 0)
    assert cli.main(["bench", "--help"]) == 0
    assert "bench {" in capsys.readouterr().out
    assert cli.main(["bench", "all", "--help"]) == 0
    assert "bench all" in capsys.readouterr().out
    assert ran == []
