"""``bench sparse-scale --quick``: the JSON it promises (a few seconds, no engine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ascend_offload import cli, native
from ascend_offload.bench import sparse_scale


def test_registered_and_skipped_by_bench_all() -> None:
    assert cli.BENCHES["sparse-scale"] == "ascend_offload.bench.sparse_scale"
    assert "sparse-scale" in cli.SLOW_BENCHES  # minutes at full scale: run by name


@pytest.mark.skipif(not native.available(), reason="native residency library unavailable")
def test_quick_run_writes_the_promised_json(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    assert sparse_scale.main(["--quick", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    q = sparse_scale.QUICK
    assert res["bench"] == "sparse-scale" and res["config"]["quick"] is True
    assert res["machine"]["cpus"] >= 1 and res["date_utc"]
    rows = res["rows"]
    batches = [int(b) for b in q["batches"].split(",")]
    assert len(rows) == len(sparse_scale.PATHS) * len(batches) * 2  # two trace kinds
    for r in rows:
        assert {"path", "batch", "context", "trace", "hit_rate", "host_ms_per_step",
                "host_syncs_per_step"} <= set(r)
        assert r["path"] in sparse_scale.PATHS and r["trace"] in ("drift", "uniform")
        assert r["context"] == int(q["contexts"]) and r["batch"] in batches
        assert 0.0 < r["hit_rate"] < 1.0 and r["host_ms_per_step"] > 0
        # the host paths hand every layer's top-k to the host; the device paths nothing
        on_device = r["path"] in sparse_scale.DEVICE_PATHS
        assert r["host_syncs_per_step"] == (0 if on_device else q["layers"]), r
    # the device table's two kernels: the C++ one of this host device, the tensor ops
    assert {r["kernel"] for r in rows if r["path"] == "device"} == {"native"}
    assert {r["kernel"] for r in rows if r["path"] == "device_ops"} == {"ops"}
    # one semantics: the same traces give the same hit rate on every path
    by_case: dict[tuple, set[float]] = {}
    for r in rows:
        by_case.setdefault((r["batch"], r["trace"]), set()).add(r["hit_rate"])
    assert all(len(v) == 1 for v in by_case.values()), by_case
