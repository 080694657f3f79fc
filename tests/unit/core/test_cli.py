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


def test_check_config_refuses_non_objects_and_missing_files(
        capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    assert cli.main(["check-config", "[1,2,3]"]) == 2
    err = capsys.readouterr().err
    assert "expected a JSON object" in err and "Traceback" not in err
    missing = tmp_path / "nope.json"
    assert cli.main(["check-config", str(missing)]) == 2
    assert f"no such file: {missing}" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert cli.main(["check-config", str(bad)]) == 2
    assert f"{bad}: not JSON" in capsys.readouterr().err


@pytest.mark.parametrize("multi", ["AscendMultiConnector", "MultiConnector"])
def test_check_config_validates_multi_children(capsys: pytest.CaptureFixture[str],
                                               multi: str) -> None:
    """A bad key inside a child of a multi connector is named, as at engine start."""
    child_ok = {"kv_connector": "SfaRemoteD2HConnector", "kv_role": "kv_producer"}
    child_bad = {"kv_connector": "AscendStoreConnector",
                 "kv_connector_extra_config": {"use_layerwise": True, "bogus": 1}}
    raw = {"kv_connector": multi,
           "kv_connector_extra_config": {"connectors": [child_ok, child_bad]}}
    assert cli.main(["check-config", json.dumps(raw)]) == 2
    err = capsys.readouterr().err
    assert "connectors[1]" in err and "'bogus'" in err
    child_bad["kv_connector_extra_config"].pop("bogus")
    assert cli.main(["check-config", json.dumps(raw)]) == 0
    out = json.loads(capsys.readouterr().out)
    store = out["kv_connector_extra_config"]["connectors"][1]["kv_connector_extra_config"]
    assert store["use_layerwise"] is True and store["backend"] == "local"
