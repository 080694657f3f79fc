"""The SSD tier under the host store (``local.ssd``) on real vLLM CPU engines: a
multi-turn workload whose prefix set is >= 4x the host pages hits more with the tier
than without, every answer equal to a plain engine's; slots damaged on disk are
misses (counted) and the answers stay equal."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from ascend_offload.bench.store_ssd import (
    multi_turn_prompts,
    prefix_set_blocks,
    run_sequence,
    store_config,
    summarize,
)
from ascend_offload.harness.engines import tiny_llm
from ascend_offload.store.ssd import format as fmt
from tests.e2e.harness import BLOCK_SIZE, tiny_model

OBJECT_BYTES = 4 * 2 * BLOCK_SIZE * 64 * 4  # one block of the 4-layer tiny model on one rank
HOST_PAGES = 12
PROMPTS = multi_turn_prompts(6, 3, seed=3)


def _tokens(outs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    with tiny_llm(tiny_model(), None, in_process=True) as llm:
        return _tokens(run_sequence(llm, PROMPTS, 16))


def test_ssd_tier_raises_the_hit_rate_and_damaged_slots_are_misses(plain: list[list[int]], tmp_path: Path) -> None:
    assert prefix_set_blocks(PROMPTS) >= 4 * HOST_PAGES
    with tiny_llm(tiny_model(), store_config(HOST_PAGES, OBJECT_BYTES, None), in_process=True) as llm:
        host_outs = run_sequence(llm, PROMPTS, 16)
    assert _tokens(host_outs) == plain
    host = summarize(PROMPTS, host_outs)

    ssd_dir = tmp_path / "ssd"
    cfg = store_config(HOST_PAGES, OBJECT_BYTES, {"path": str(ssd_dir), "capacity_bytes": 32 << 20})
    with tiny_llm(tiny_model(), cfg, in_process=True) as llm:
        outs = run_sequence(llm, PROMPTS, 16)
        assert _tokens(outs) == plain
        ssd = summarize(PROMPTS, outs)
        print(f"hit rate host only {host['hit_rate']:.3f}, with SSD {ssd['hit_rate']:.3f}")
        assert ssd["hit_rate"] > host["hit_rate"]
        st = ssd["store"]
        assert st["ssd_spilled_blocks"] > 0 and st["ssd_promoted_blocks"] > 0
        assert st["ssd_checksum_failures"] == 0 and st["ssd_used_slots"] > 0

        # Damage every slot on disk (one payload bit each), behind the engine's back.
        (slot_file,) = ssd_dir.glob("ssd-*-r0.slots")
        slot_bytes = fmt.slot_bytes(OBJECT_BYTES)
        with open(slot_file, "r+b") as f:
            for s in range(os.path.getsize(slot_file) // slot_bytes):
                at = s * slot_bytes + fmt.HEADER_BYTES + 999
                f.seek(at)
                b = f.read(1)[0]
                f.seek(at)
                f.write(bytes([b ^ 0x04]))
            f.flush()
            os.fsync(f.fileno())
        last_turn = PROMPTS[-6:]
        again = run_sequence(llm, last_turn, 16)
        assert _tokens(again) == plain[-6:]
        after = again[-1].kv_transfer_params["ascend_store"]["store"]
        assert after["ssd_checksum_failures"] > 0  # served as misses: recomputed, never loaded
        assert after["pinned_objects"] == 0 and after["pending_objects"] == 0


def test_persistent_tier_serves_a_restarted_engine(plain: list[list[int]], tmp_path: Path) -> None:
    """``persist: true``: the index written at close is loaded by the next engine on the
    same directory, whose requests then load their prefixes from the slot files."""
    # a short interval: the index is on disk before the shutdown, which vLLM may cut short
    # (it kills an engine core whose workers take over 5 s to exit, before our close)
    ssd = {"path": str(tmp_path / "ssd"), "capacity_bytes": 32 << 20, "persist": True, "persist_interval_s": 0.5}
    cfg = store_config(HOST_PAGES, OBJECT_BYTES, ssd)
    first_turn, second_turn = PROMPTS[:6], PROMPTS[6:12]
    with tiny_llm(tiny_model(), cfg, in_process=True) as llm:
        outs = run_sequence(llm, first_turn, 16)
        assert _tokens(outs) == plain[:6]
        assert outs[-1].kv_transfer_params["ascend_store"]["store"]["ssd_spilled_blocks"] > 0
    assert list((tmp_path / "ssd").glob("ssd-*.index.json"))
    with tiny_llm(tiny_model(), cfg, in_process=True) as llm:
        outs = run_sequence(llm, second_turn, 16)
        assert _tokens(outs) == plain[6:12]
        st = outs[-1].kv_transfer_params["ascend_store"]["store"]
        assert st["ssd_promoted_blocks"] > 0 and st["ssd_checksum_failures"] == 0
        assert sum(o.kv_transfer_params["ascend_store"]["loaded_blocks"] for o in outs) > 0
