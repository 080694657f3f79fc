"""`ascend-offload bench pd` runs end to end (tiny sizes) and writes its JSON."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("mooncake.engine")

from ascend_offload.bench import pd as bench_pd

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_bench_pd_small(tmp_path):
    out = tmp_path / "sub" / "pd.json"
    rc = bench_pd.main(["--json", str(out), "--layers", "2", "--blocks", "4", "--iters", "2",
                        "--main-block-bytes", "4096", "--indexer-block-bytes", "512"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["bytes_total"] == 2 * 4 * (2 * 4096 + 512)
    assert res["pd"]["median_s"] > 0 and res["raw"]["median_s"] > 0
    assert res["ratio_pd_over_raw"] > 0
    assert res["descriptors_per_read"] == 3.0  # contiguous runs: one descriptor per tensor
