"""The demo's parsing and table: Prometheus text, counter deltas, footprint lines, the table."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest

from ascend_offload.demo import run
from ascend_offload.demo.footprint import footprint_ratio
from ascend_offload.demo.prom import delta, parse
from ascend_offload.demo.run import index_topk, with_kv_port
from ascend_offload.demo.table import (
    RD2H,
    SPARSE,
    STORE,
    Footprint,
    RequestResult,
    render,
    request_row,
)
from ascend_offload.demo.workload import PREFIX_TOKENS, SPEC, workload

PAGE = """\
# HELP vllm:ascend_offload_rd2h_bytes_pulled_total decode: KV bytes read from prefill
# TYPE vllm:ascend_offload_rd2h_bytes_pulled_total counter
vllm:ascend_offload_rd2h_bytes_pulled_total{engine="0",model_name="m"} 4096.0
vllm:ascend_offload_rd2h_bytes_pulled_created{engine="0",model_name="m"} 1.7e9
vllm:ascend_offload_rd2h_bytes_pulled_total{engine="1",model_name="m"} 1024.0
vllm:num_requests_running{engine="0",model_name="m"} 0.0
vllm:odd{label="a } b"} 2.0
vllm:broken{engine="0" 3.0
vllm:nan_gauge{engine="0"} NaN
vllm:not_a_number{engine="0"} abc
process_cpu_seconds_total 12.0
"""


def test_parse_sums_label_sets_drops_created_and_other_prefixes() -> None:
    m = parse(PAGE)
    assert m["vllm:ascend_offload_rd2h_bytes_pulled"] == 5120.0
    assert m["vllm:num_requests_running"] == 0.0
    assert m["vllm:odd"] == 2.0  # a '}' inside a label value does not end the label set early
    assert "vllm:ascend_offload_rd2h_bytes_pulled_created" not in m
    assert "process_cpu_seconds" not in m and "process_cpu_seconds_total" not in m
    # malformed or non-finite samples are skipped, not fatal
    assert "vllm:broken" not in m and "vllm:nan_gauge" not in m and "vllm:not_a_number" not in m


def test_delta_counts_new_families_from_zero() -> None:
    assert delta({"a": 2.0, "gone": 1.0}, {"a": 5.0, "b": 3.0}) == {"a": 3.0, "b": 3.0}


def test_footprint_ratio_from_layout_lines() -> None:
    decode = ("INFO x ascend-offload sparse decode: main KV of 4 layers kept in the host pool, not on the "
              "device; device KV 100.0 -> 50.0 MiB (indexer + hot buffers), blocks 1000 -> 2000\n")
    assert footprint_ratio(decode) == pytest.approx(0.25)
    layerwise = "ascend-offload layerwise: 8 cache layers share 2 physical buffers (independent=[0], B=1); KV blocks 100 -> 400"
    assert footprint_ratio(layerwise) == pytest.approx(0.25)
    assert footprint_ratio("INFO nothing about KV here\n") == 1.0


def _result(i: int, identical: bool, prefill: dict[str, float], decode: dict[str, float]) -> RequestResult:
    return RequestResult(i, 300, "A", i % 2 == 0, 0.5, 0.1 if i % 2 == 0 else None, 0.02 if i % 2 == 0 else None,
                         identical, prefill, decode)


def test_table_shows_na_for_families_a_server_does_not_export() -> None:
    decode = {RD2H + "bytes_pulled": 2048.0, RD2H + "layers_pulled": 4.0, RD2H + "read_failures": 0.0,
              SPARSE + "hit_positions": 30.0, SPARSE + "resolved_positions": 40.0,
              SPARSE + "offload_bytes": 1024.0, SPARSE + "miss_bytes": 512.0}
    row = request_row(_result(1, True, {}, decode))
    assert "n/a" in row  # no store, no gate on this prefill
    assert "75.0%" in row and "2.0" in row
    out = render([_result(1, True, {}, decode), _result(2, False, {}, decode)], Footprint(1.0, 0.3))
    assert out.splitlines()[-1] == "demo: 1/2 requests identical"
    assert "RD2H prefill->decode pool 4.0 KiB (8 layer reads, 0 failed)" in out
    assert "hit rate 75.0% of 80 top-k positions" in out
    assert "prefill 1.00, decode 0.30" in out
    assert "prefix hits n/a" in out


def test_sparse_counters_of_an_rd2h_decode_are_read_too() -> None:
    decode = {RD2H + "sparse_hit_positions": 9.0, RD2H + "sparse_resolved_positions": 10.0}
    assert "90.0%" in request_row(_result(1, True, {}, decode))
    out = render([_result(1, True, {}, decode)], Footprint(1.0, 0.3))
    assert "hit rate 90.0% of 10 top-k positions" in out


def test_speculation_column_and_totals_from_the_decode_counters() -> None:
    spec = "vllm:spec_decode_"
    decode = {spec + "num_drafts": 5.0, spec + "num_draft_tokens": 5.0,
              spec + "num_accepted_tokens": 2.0, RD2H + "sparse_verify_rows": 5.0}
    assert "2/5" in request_row(_result(1, True, {}, decode))
    out = render([_result(1, True, {}, decode), _result(2, True, {}, decode)], Footprint(1.0, 0.3))
    assert ("speculation   accepted 4 of 10 draft tokens (40.0%) in 10 verification rows, 10 of "
            "them on the hot buffers") in out
    # a decode that does not speculate exports no spec_decode family
    assert "the decode does not speculate" in render([_result(1, True, {}, {})], Footprint(1.0, 0.3))


def test_table_store_columns_when_the_prefill_has_a_store() -> None:
    prefill = {STORE + "hit_objects": 8.0, STORE + "miss_objects": 2.0, STORE + "loaded_blocks": 8.0,
               STORE + "saved_blocks": 2.0, STORE + "layerwise_gate_waits": 3.0}
    row = request_row(_result(1, True, prefill, {}))
    assert "8/10" in row
    out = render([_result(1, True, prefill, {}), _result(2, True, prefill, {})], Footprint(0.5, None))
    assert "prefix hits 16/20 objects; 16 blocks loaded, 4 saved" in out
    assert "gate waits    6" in out
    assert "decode n/a" in out
    assert out.endswith("demo: 2/2 requests identical")


def test_workload_shape() -> None:
    reqs = workload()
    assert len(reqs) == len(SPEC) >= 12
    assert any(r.stream for r in reqs) and any(not r.stream for r in reqs)
    assert sum(len(r.prompt) > 64 for r in reqs) >= len(reqs) // 2  # beyond the decode hot buffer
    for group, n in PREFIX_TOKENS.items():
        members = [r.prompt for r in reqs if r.prefix == group]
        assert len(members) >= 2 and all(p[:n] == members[0][:n] for p in members)
    assert workload(5) == reqs[:5]  # a reduced run is a prefix of the full one


def test_with_kv_port_replaces_every_level() -> None:
    cfg = {"kv_port": 1, "kv_connector_extra_config": {"connectors": [{"kv_port": 2}, {"x": 3}]}}
    assert with_kv_port(cfg, 9) == {"kv_port": 9, "kv_connector_extra_config": {"connectors": [{"kv_port": 9},
                                                                                              {"x": 3}]}}
    assert index_topk({"kv_connector_extra_config": {"sparse_offload": {"index_topk": 64}}}) == 64


# --------------------------------------------------------------- HTTP side, over httpx's mock transport

def _client(handler: Callable[[httpx.Request], httpx.Response]) -> httpx.Client:
    return httpx.Client(transport=httpx.MockTransport(handler))


def test_settled_waits_for_idle_and_two_equal_reads() -> None:
    pages = iter(["vllm:num_requests_running 1\nvllm:x_total 1\n", "vllm:num_requests_running 0\nvllm:x_total 2\n",
                  "vllm:num_requests_running 0\nvllm:x_total 3\n", "vllm:num_requests_running 0\nvllm:x_total 3\n"])
    with _client(lambda req: httpx.Response(200, text=next(pages))) as client:
        [m] = run.settled(client, ["http://a"])
    assert m["vllm:x"] == 3.0


def test_settled_gives_up_at_its_deadline() -> None:
    with _client(lambda req: httpx.Response(200, text="vllm:num_requests_running 1\n")) as client, \
            pytest.raises(RuntimeError, match="not idle"):
        run.settled(client, ["http://a"], timeout_s=0.0)


def test_complete_streamed_collects_token_ids_and_times() -> None:
    chunks = [{"choices": [{"text": "a", "token_ids": [5]}]}, {"choices": [{"text": "", "token_ids": None}]},
              {"choices": [{"text": "bc", "token_ids": [6, 7]}]}]
    sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    with _client(lambda req: httpx.Response(200, text=sse)) as client:
        ids, e2e, ttft, tpot = run.complete(client, "http://p", {"stream": True})
    assert ids == [5, 6, 7]
    assert ttft is not None and tpot is not None and 0 <= ttft <= e2e


def test_a_failed_request_is_reported_not_raised(capsys: pytest.CaptureFixture[str]) -> None:
    with _client(lambda req: httpx.Response(500, text="boom")) as client:
        assert run._attempt(client, "http://p", {"stream": False}, 3)[0] is None
        assert run._attempt(client, "http://p", {"stream": True}, 4)[0] is None
    err = capsys.readouterr().err
    assert "request 3 via http://p failed: http://p: HTTP 500: boom" in err and "request 4" in err


def test_decode_prefix_cache_column_and_totals() -> None:
    decode = {RD2H + "sparse_prefix_loaded_blocks": 7.0, RD2H + "sparse_prefix_kept_blocks": 3.0}
    cells = request_row(_result(1, True, {}, decode)).split()
    assert cells[8] == "7"  # the "D cached" column, after the store's
    out = render([_result(1, True, {}, decode), _result(2, True, {}, decode)], Footprint(1.0, 0.3))
    assert "decode cache  14 prompt blocks served from the decode's prefix cache (not pulled), 6 kept" in out
    assert "decode cache  n/a" in render([_result(1, True, {}, {})], Footprint(1.0, 0.3))
