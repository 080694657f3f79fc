"""``bench sparse-scale --quick``: the JSON it promises (a few seconds, no engine), and
which paths each ``--device`` accepts. The run on a CUDA device:
``test_bench_sparse_scale_cuda.py``."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ascend_offload import cli, native
from ascend_offload import device as dev
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
    # --device cpu by default: every path but the graph, nothing on an accelerator
    assert res["config"]["device"] == "cpu" and res["machine"]["accelerator"] is None
    paths = ("host", "host_threads", "device", "device_ops")
    assert sparse_scale.default_paths("cpu") == paths and tuple(res["config"]["paths"]) == paths
    rows = res["rows"]
    batches = [int(b) for b in q["batches"].split(",")]
    assert len(rows) == len(paths) * len(batches) * 2  # two trace kinds
    for r in rows:
        assert {"path", "batch", "context", "trace", "hit_rate", "host_ms_per_step",
                "host_syncs_per_step"} <= set(r)
        assert r["path"] in paths and r["trace"] in ("drift", "uniform")
        assert r["device"] == "cpu" and "equal_to_eager" not in r
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


@pytest.mark.parametrize("path", ["device_graph", "device_compiled"])
def test_graph_paths_are_refused_without_a_cuda_device(path: str) -> None:
    # the graph captures the device table on the accelerator: never with --device cpu
    with pytest.raises(SystemExit, match=f"--paths {path}: .*--device"):
        sparse_scale.main(["--quick", "--paths", f"device_ops,{path}"])


@pytest.mark.parametrize("compiles", [True, False])
def test_cuda_default_paths_include_the_compiled_graph_where_it_compiles(
        monkeypatch: pytest.MonkeyPatch, compiles: bool) -> None:
    monkeypatch.setattr(dev, "graph_capture_supported", lambda: True)
    monkeypatch.setattr(dev, "compiles_tensor_ops", lambda where: compiles)
    paths = ("host", "host_threads", "device_ops", "device_graph")
    assert sparse_scale.default_paths("cuda") == paths + (("device_compiled",) if compiles else ())
    assert "device_compiled" not in sparse_scale.default_paths("cpu")


def test_device_compiled_table_runs_the_compiled_tensor_ops() -> None:
    # building the table compiles nothing (torch.compile is lazy): its kernel name only
    a = sparse_scale.parse_args(["--quick"])
    steps = sparse_scale._Steps(a, 1, int(a.contexts))
    where = torch.device("cpu")
    assert sparse_scale._device_table(a, "device_compiled", steps, where).kernel == "ops_compiled"
    assert sparse_scale._device_table(a, "device_graph", steps, where).kernel == "ops"
    assert sparse_scale._device_table(a, "device_ops", steps, where).kernel == "ops"


def test_unknown_device_is_refused() -> None:
    with pytest.raises(SystemExit, match="--device tpu"):
        sparse_scale.main(["--quick", "--device", "tpu"])


@pytest.mark.skipif(dev.platform() != "cpu", reason="this machine has an accelerator")
def test_cuda_is_refused_where_torch_sees_no_accelerator() -> None:
    with pytest.raises(SystemExit, match="--device cuda"):
        sparse_scale.main(["--quick", "--device", "cuda", "--paths", "device_ops"])


def test_device_ops_runs_without_the_native_library(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    monkeypatch.setattr(native, "available", lambda: False)
    with pytest.raises(SystemExit, match="native residency library"):
        sparse_scale.main(["--quick", "--paths", "host,device_ops"])
    with pytest.raises(SystemExit, match="native residency library"):
        sparse_scale.main(["--quick", "--paths", "device"])  # its C++ kernel on the CPU
    out = tmp_path / "ops.json"
    assert sparse_scale.main(["--quick", "--paths", "device_ops", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["path"] == "device_ops" and r["kernel"] == "ops"
                        and 0.0 < r["hit_rate"] < 1.0 for r in rows), rows


class _ReplayByCalling:
    """Stand-in for ``device.CapturedGraph`` on the CPU: capture records the function
    without running it (as a CUDA capture executes nothing), a replay calls it."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn, self.outputs = fn, None

    def replay(self) -> None:
        self.outputs = self.fn()


class _ReplayNothing(_ReplayByCalling):
    def replay(self) -> None:
        return None


@pytest.mark.parametrize(("graph", "equal"), [(_ReplayByCalling, True), (_ReplayNothing, False)])
def test_device_graph_flow_and_its_eager_check(monkeypatch: pytest.MonkeyPatch, graph: type,
                                               equal: bool) -> None:
    # The device_graph path's steps on the CPU (warm-up, capture after it, static inputs
    # refilled per step, the eager check), a stand-in for the CUDA graph; a graph that
    # replays nothing must not pass the eager check.
    monkeypatch.setattr(dev, "CapturedGraph", graph)
    a = sparse_scale.parse_args(["--quick"])
    traces = sparse_scale._traces(a, "drift", int(a.contexts))
    steps = sparse_scale._Steps(a, 2, int(a.contexts))
    topks = sparse_scale._topks(a, traces, 2, torch.device("cpu"))
    row = sparse_scale._run_path(a, "device_graph", steps, topks)
    ops = sparse_scale._run_path(a, "device_ops", steps, topks)
    assert row["equal_to_eager"] is equal and row["host_syncs_per_step"] == 0
    assert row["topk_copy"] == sparse_scale.TOPK_COPY and row["topk_copy_ms_per_step"] >= 0
    assert len(row["ms_per_step_steps"]) == a.steps and "error" not in row
    assert (row["hit_rate"] == ops["hit_rate"]) is equal
