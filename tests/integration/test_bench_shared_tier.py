"""``bench store``'s shared-tier rows: the connector's ``RemotePages`` over a real
``mooncake_master`` on 127.0.0.1 against zero-copy Mooncake put/get of the same bytes
(tiny sizes: a smoke run of the rows and their JSON, not a measurement)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ascend_offload.bench.store import _rounds


def test_rotated_rounds_time_every_fn_and_change_who_runs_first() -> None:
    order: list[str] = []
    fns = [lambda name=name: order.append(name) for name in "abc"]
    times = _rounds(fns, 3, rotate=True)
    assert [len(t) for t in times] == [3, 3, 3]  # the warm-up round is not timed
    assert order == list("abc" "bca" "cab" "abc")


@pytest.mark.integration
@pytest.mark.bench
@pytest.mark.timeout(180)
def test_shared_tier_rows_report_the_zero_copy_ratio_and_parity(tmp_path: Path) -> None:
    pytest.importorskip("mooncake.store", reason="needs mooncake-transfer-engine-non-cuda and libibverbs")
    from ascend_offload.bench.store import SHARED_TIER_LAYOUTS, main
    from ascend_offload.store.services.mooncake_master import master_binary

    if master_binary() is None:
        pytest.skip("mooncake_master not installed")
    out = tmp_path / "store.json"
    # starts its own loopback master, like a plain `ascend-offload bench store`
    assert main(["--shared-tier", "only", "--mooncake-mib", "1", "--repeats", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    worst = result["shared_tier_zero_copy_worst_ratio"]
    assert isinstance(worst, float) and worst > 0
    assert result["shared_tier_multi_buffer_worst_ratio"] > 0
    assert result["shared_tier_one_core_bound_worst_ratio"] == min(
        min(r["one_core_bound_publish_ratio"], r["one_core_bound_fetch_ratio"]) for r in result["shared_tier_rows"])
    assert result["shared_tier_parity"] is True
    rows = result["shared_tier_rows"]
    assert [(r["layer_bytes"], r["layers"]) for r in rows] == list(SHARED_TIER_LAYOUTS)
    for r in rows:
        assert r["parity"] is True
        assert r["wire_bytes"] == r["object_bytes"] + 16  # payload and trailer, as published
        for k in ("publish_ratio", "fetch_ratio", "publish_GBps", "fetch_GBps", "zero_copy_put_GBps",
                  "zero_copy_get_GBps", "multi_buffer_put_GBps", "xxh3_GBps"):
            assert r[k] > 0, k
        # every timed publish and fetch went through the tier and counted whole blocks
        c = r["tier_counts"]
        assert c["published_blocks"] >= 3 * r["objects"] and c["publish_skipped"] == 0
        assert c["fetched_blocks"] >= 3 * r["objects"] and c["fetch_failed_blocks"] == 0
    assert worst == min(min(r["publish_ratio"], r["fetch_ratio"]) for r in rows)
    assert "rows" in result and result["rows"] == []  # only: no other rows ran


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_one_tiny_shared_tier_row_moves_the_bytes_whole(tmp_path: Path) -> None:
    """One row on a tiny layout (the part ``make test`` runs; the JSON test is a bench smoke run)."""
    pytest.importorskip("mooncake.store", reason="needs mooncake-transfer-engine-non-cuda and libibverbs")
    from ascend_offload.bench.store import bench_shared_tier
    from ascend_offload.store.services.mooncake_master import MooncakeMaster, master_binary

    if master_binary() is None:
        pytest.skip("mooncake_master not installed")
    with MooncakeMaster(tmp_path / "master.log") as master:
        row = bench_shared_tier(master.address, 4096, 3, 5, repeats=2)  # raises if a byte differs
    assert row["parity"] is True and row["objects"] == 5 and row["total_bytes"] == 5 * (3 * 4096 + 16)
    assert min(row["publish_ratio"], row["fetch_ratio"], row["multi_buffer_publish_ratio"],
               row["multi_buffer_fetch_ratio"]) > 0
