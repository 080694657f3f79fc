"""``bench sparse-multiturn`` without servers: registration, the workload, and the summary's
arithmetic (bytes saved against cached blocks, ratios, parity count)."""

from __future__ import annotations

import argparse

from ascend_offload import cli
from ascend_offload.bench import sparse_multiturn as mt


def test_registered_as_a_slow_bench() -> None:
    assert cli.BENCHES["sparse-multiturn"] == "ascend_offload.bench.sparse_multiturn"
    assert "sparse-multiturn" in cli.SLOW_BENCHES
    assert mt.main(["--turns", "1"]) == 2  # a second turn is the point


def test_conversations_are_fixed_by_the_seed() -> None:
    a, fa = mt.conversations(3)
    b, fb = mt.conversations(3)
    assert a == b and fa == fb and all(200 <= len(p) <= 800 for p in a)
    assert mt.conversations(3, seed=6)[0] != a


def _row(turn: int, with_bytes: float, cached: float, without_bytes: float | None,
         ttft: float = 100.0) -> dict:
    row = {"conversation": 0, "turn": turn, "prompt_tokens": 300, "parity_with": True,
           "with": {"ttft_ms": ttft, "decode_ttft_ms": ttft / 2, "bytes_pulled": with_bytes,
                    "cached_blocks": cached}}
    if without_bytes is not None:
        row["without"] = {"ttft_ms": 2 * ttft, "decode_ttft_ms": ttft, "bytes_pulled": without_bytes,
                          "cached_blocks": 0.0}
        row["parity_without"] = True
    return row


def test_summary_checks_the_saved_bytes_against_the_cached_blocks() -> None:
    args = argparse.Namespace(conversations=1, turns=3, output_tokens=16, cache_blocks=64)
    block = mt.WIRE_BLOCK_BYTES
    rows = [_row(1, 10 * block, 0, None), _row(2, 3 * block, 9, 12 * block),
            _row(3, 2 * block, 14, 16 * block)]
    res = mt._summary(args, rows, [], "/tmp/x")
    assert res["later_turns"] == 2 and res["cached_blocks"] == 23
    assert res["bytes_saved_equal_cached"] is True
    assert res["multiturn_bytes_ratio"] == 5 / 28
    assert res["multiturn_ttft_ratio"] == 0.5 and res["parity"] == "5/5"
    rows[1]["with"]["cached_blocks"] = 8  # one block unaccounted for
    assert mt._summary(args, rows, [], "/tmp/x")["bytes_saved_equal_cached"] is False
    assert "sparse-multiturn: 1 conversations x 3 turns" in mt.report(res)
