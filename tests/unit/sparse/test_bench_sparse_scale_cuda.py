"""``bench sparse-scale --quick --device cuda``: the device table on the GPU, eager
(``device_ops``), as a replayed CUDA graph (``device_graph``) and with its tensor ops
compiled inside that graph (``device_compiled``), against the host table reading the
top-k back each layer. Skipped without CUDA; imports torch, numpy and the
package's torch-only modules (no vLLM). Run it on a CUDA machine with::

    python -m pytest -p no:xdist -m cuda tests/unit/sparse/test_bench_sparse_scale_cuda.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ascend_offload import device as dev
from ascend_offload import native
from ascend_offload.bench import sparse_scale

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(dev.platform() != "cuda", reason="needs a CUDA device")]


def test_quick_run_on_cuda_graph_equals_eager_and_the_host_table(tmp_path: Path) -> None:
    # the host path needs the native library, which need not load on a GPU machine
    paths = (["device_ops", "device_graph", "device_compiled"]
             + (["host"] if native.available() else []))
    out = tmp_path / "scale-cuda.json"
    assert sparse_scale.main(["--quick", "--device", "cuda", "--paths", ",".join(paths),
                              "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    q = sparse_scale.QUICK
    assert res["config"]["device"] == "cuda" and res["machine"]["accelerator"]
    rows = res["rows"]
    assert len(rows) == len(paths) * len(q["batches"].split(",")) * 2  # two trace kinds
    for r in rows:
        assert r["device"] == "cuda" and "error" not in r, r
        assert 0.0 < r["hit_rate"] < 1.0 and r["host_ms_per_step"] > 0, r
        # the host path reads each layer's top-k off the GPU; the device paths nothing
        assert r["host_syncs_per_step"] == (q["layers"] if r["path"] == "host" else 0), r
    graph = [r for r in rows if r["path"] in ("device_graph", "device_compiled")]
    assert len(graph) == 2 * len(rows) // len(paths), graph
    assert all(r["equal_to_eager"] is True for r in graph), graph
    assert all(r["topk_copy_ms_per_step"] > 0 and r["capture_ms"] > 0 for r in graph), graph
    # device_compiled: the tensor ops compiled (CUDA compiles them by default: auto)
    kernels = {r["path"]: r["kernel"] for r in rows if r["path"] != "host"}
    assert kernels == {"device_ops": "ops", "device_graph": "ops",
                       "device_compiled": "ops_compiled"}, kernels
    assert "device_compiled" in sparse_scale.default_paths("cuda")
    # one semantics: the same traces give the same hit rate on every path
    by_case: dict[tuple, set[float]] = {}
    for r in rows:
        by_case.setdefault((r["batch"], r["trace"]), set()).add(r["hit_rate"])
    assert all(len(v) == 1 for v in by_case.values()), by_case
