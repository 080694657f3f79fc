"""``ascend-offload bench layerwise`` runs end to end on a tiny config and writes its JSON."""

from __future__ import annotations

import json
from pathlib import Path

from ascend_offload.cli import main as cli_main


def test_bench_smoke(tmp_path: Path, capsys) -> None:
    out = tmp_path / "sub" / "layerwise.json"
    rc = cli_main(["bench", "layerwise", "--layers", "4", "--shared-buffers", "1,2",
                   "--page-kib", "16", "--load-blocks", "4", "--save-blocks", "2",
                   "--compute-ms", "0.5", "--steps", "2", "--reps", "1", "--json", str(out)])
    assert rc == 0
    assert "ratio vs ideal" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["bench"] == "layerwise"
    assert [r["shared_buffers"] for r in data["results"]] == [1, 2]
    for r in data["results"]:
        assert r["load_errors"] == 0 and r["save_errors"] == 0
        assert r["ideal_ms"] > 0 and r["achieved_ms"] > 0 and r["serial_ms"] >= r["ideal_ms"]
        assert len(r["rounds"]) == 2 and r["no_traffic_vs_compute"] > 0
        # the dependency-free floor ran the same work (its loads count in the stats)
        assert r["floor_vs_ideal"] > 0 and r["ratio_vs_floor"] > 0
        for rd in r["rounds"]:
            assert abs(rd["ratio_vs_floor"] * rd["floor_ms"] - rd["achieved_ms"]) < 1e-6 * rd["achieved_ms"] + 1e-9
    assert data["results"][0]["physical_buffers"] == 2


def test_bench_calibrates_the_stand_in_to_the_transfer(tmp_path: Path) -> None:
    """Without --compute-ms the stand-in is re-aimed at the measured shared-layer transfer."""
    out = tmp_path / "lw.json"
    rc = cli_main(["bench", "layerwise", "--layers", "4", "--shared-buffers", "1",
                   "--page-kib", "64", "--load-blocks", "4", "--save-blocks", "2",
                   "--compute-kind", "sleep", "--steps", "1", "--reps", "1", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())["results"][0]
    assert r["compute_kind"] == "sleep" and r["compute_ms_per_layer"] > 0
    assert r["floor_vs_ideal"] > 0


def test_bench_bad_option(capsys) -> None:
    assert cli_main(["bench", "layerwise", "--shared-buffers", "x"]) == 2
    assert "--shared-buffers" in capsys.readouterr().err
