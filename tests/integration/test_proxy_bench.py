"""``ascend-offload bench proxy`` runs end to end (tiny durations; no timing assertions)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ascend_offload.bench.proxy import main

pytestmark = pytest.mark.integration


def test_bench_proxy_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sub" / "proxy.json"
    assert main(["--concurrency", "1,4", "--duration", "0.3", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["concurrency"] for r in res["results"]] == [1, 4]
    for r in res["results"]:
        for mode in ("direct", "proxied", "fastapi_httpx"):
            if mode == "fastapi_httpx" and mode not in r:
                continue  # baseline stack not installed
            assert r[mode]["requests_total"] > 0 and r[mode]["errors"] == 0
        assert r["proxied"]["proxy_cpu_ms_per_req"] > 0
        assert r["ratio_req_s"] > 0
    out_text = capsys.readouterr().out
    assert "proxied/direct req/s: c=1:" in out_text and "zero-cost proxy" in out_text
    assert all("ratio_if_proxy_were_free" in r["cpu_bound"] for r in res["results"])
