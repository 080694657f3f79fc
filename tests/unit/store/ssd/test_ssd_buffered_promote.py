"""Buffered promotes (store/ssd/file.py, ``RankTier.split``): each slot is scattered by
one preadv over a per-layer staging, verified there, and only verified payloads are
copied into their pages (one native streaming copy over every layer, a native call per
layer where the library lacks that, numpy without the library). A
damaged slot is a miss whose page is never written and never committed; a slot the
file is too short for fails that block alone."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
import torch

from ascend_offload.store.book.prefix_jobs import PrefixJobs
from ascend_offload.store.local import LocalStore
from ascend_offload.store.ssd import file as ssd_file
from ascend_offload.store.ssd import format as fmt
from ascend_offload.store.ssd.file import RankTier, SlotFile
from ascend_offload.store.ssd.index import SsdIndex
from ascend_offload.store.ssd.jobs import SsdJobs

# rows of 64-byte multiples take the streaming copy; 1000 bytes takes its unaligned path
LAYERS = (4096, 2048, 1000)
PAGE = sum(LAYERS)
SLOT = fmt.slot_bytes(PAGE)
BS = 4


def planes(pages: int, seed: int, layers: tuple[int, ...] = LAYERS) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"l{i}": torch.randint(0, 256, (pages, b), dtype=torch.uint8, generator=g) for i, b in enumerate(layers)}


def page_bytes(pl: dict[str, torch.Tensor], page: int) -> bytes:
    return b"".join(bytes(p[page].numpy()) for p in pl.values())


def buffered_tier(tmp_path: Path, pl: dict[str, torch.Tensor], slots: int, copy: str) -> RankTier:
    slot = fmt.slot_bytes(sum(p.shape[1] for p in pl.values()))
    t = RankTier(pl, SlotFile(tmp_path / "r0.slots", slots, slot, direct_io="off"), rank=0)
    assert t.split and not t.file.direct
    if copy == "numpy":
        t._native = False
    elif not t._native or (copy == "layers" and not t._layer_tables):
        t.close()
        pytest.skip("the native library (or its layer copy) is not available here")
    elif copy == "rows":  # a library without the one-call layer copy: a call per layer
        t._layer_tables = ()
    return t


def spill(t: RankTier, job: int, keys: list[str], pages: list[int], slots: list[int]) -> None:
    t.submit_spill(job, keys, pages, slots)
    assert t.wait_idle(30)
    assert t.take_spill_report() == (Counter({job: 1}), Counter())


def flip_payload_bit(path: Path, slot: int, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(slot * SLOT + fmt.HEADER_BYTES + offset)
        b = f.read(1)[0]
        f.seek(slot * SLOT + fmt.HEADER_BYTES + offset)
        f.write(bytes([b ^ 0x10]))


@pytest.mark.parametrize("layers", [LAYERS, (2048, 2048, 2048)])  # several widths / one width
@pytest.mark.parametrize("copy", ["layers", "rows", "numpy"])
def test_buffered_promote_lands_every_byte_in_its_page_across_chunks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, copy: str, layers: tuple[int, ...]) -> None:
    monkeypatch.setattr(ssd_file, "CHUNK_BYTES", 3 * fmt.slot_bytes(sum(layers)))  # 3 slots a chunk
    src = planes(32, seed=1, layers=layers)
    t = buffered_tier(tmp_path, src, 24, copy)
    keys = [f"k{i}" for i in range(10)]
    slots = [0, 1, 2, 3, 5, 6, 23, 22, 8, 9]
    spill(t, 1, keys, list(range(10)), slots)
    want = [page_bytes(src, p) for p in range(10)]
    others = {p: page_bytes(src, p) for p in range(10, 20)}
    dst = [31, 12, 30, 29, 28, 27, 26, 25, 24, 0]  # scattered, one of them a source page
    assert t.promote(keys, slots, dst) == (10, [])
    assert [page_bytes(src, p) for p in dst] == want
    assert {p: page_bytes(src, p) for p in range(10, 20) if p != 12} == {p: b for p, b in others.items() if p != 12}
    t.close()


@pytest.mark.parametrize("copy", ["layers", "rows", "numpy"])
def test_buffered_promote_refuses_a_page_outside_the_planes(tmp_path: Path, copy: str) -> None:
    src = planes(4, seed=2)
    t = buffered_tier(tmp_path, src, 4, copy)
    spill(t, 1, ["a"], [0], [0])
    with pytest.raises(IndexError):
        t.promote(["a"], [0], [4])
    t.close()


def test_flipped_payload_bit_is_a_miss_its_page_neither_written_nor_committed(tmp_path: Path) -> None:
    """Through the scheduler's bookkeeping: the blocks before the damaged one are committed
    with the spilled bytes; the damaged block and the rest are aborted, counted once, and the
    damaged slot is dropped from the tier's index."""
    index = LocalStore(8 * PAGE, PAGE, with_data=False)
    jobs = SsdJobs(index, SsdIndex(16), page_bytes=PAGE, world_size=1, timeout_s=5.0, max_inflight=64)
    book = PrefixJobs(index, block_size=BS, page_bytes=PAGE, world_size=1, min_load_blocks=1, remote=jobs)
    pl = planes(8, seed=3)
    t = RankTier(pl, SlotFile(tmp_path / "r0.slots", 16, SLOT, direct_io="off"), rank=0)
    assert t.split
    keys = [f"k{i}" for i in range(4)]
    save = book.plan_save("a", keys, list(range(4)))
    assert save is not None
    jobs.watch(save.keys)
    book.report({save.job_id: 1}, {})
    jobs.plan_spills()
    (sj,) = jobs.take_spills()
    want = {k: page_bytes(pl, p) for k, p in zip(sj.keys, sj.pages, strict=True)}
    t.submit_spill(sj.job_id, sj.keys, sj.pages, sj.slots)
    assert t.wait_idle(30)
    jobs.report_spills(*t.take_spill_report())
    index.discard(keys)  # the host lost them: the next lookup promotes from the tier
    assert book.lookup("r", 0, 4, lambda n: keys[:n]) is None
    (job,) = jobs.take_promotes()
    flip_payload_bit(tmp_path / "r0.slots", job.slots[2], 4096 + 7)  # k2's payload, in its second layer
    before = {p: page_bytes(pl, p) for p in job.pages[2:]}
    good, corrupt = t.promote(job.keys, job.slots, job.pages)
    assert (good, corrupt) == (2, ["k2"])
    assert {p: page_bytes(pl, p) for p in job.pages[2:]} == before  # never written
    jobs.report_promotes({(job.job_id, good): 1}, Counter(corrupt))
    assert book.lookup("r", 0, 4, lambda n: keys[:n]) == 2 * BS  # k0, k1 offered; k2.. recomputed
    assert [page_bytes(pl, index.pages(k)[0]) for k in keys[:2]] == [want["k0"], want["k1"]]
    assert not index.has("k2") and not index.has("k3") and index.stats().pending_objects == 0
    assert "k2" not in jobs.ssd and jobs.ssd.is_ready("k3")
    c = jobs.counters()
    assert c["ssd_checksum_failures"] == 1 and c["ssd_promoted_blocks"] == 2
    t.close()


def _o_direct_allowed(tmp_path: Path) -> bool:
    probe = tmp_path / ".probe"
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600))
        return True
    except (OSError, AttributeError):
        return False
    finally:
        probe.unlink(missing_ok=True)


@pytest.mark.parametrize("chunk_slots", [2, 8])  # the cut slot opens a chunk / is inside one run
@pytest.mark.parametrize("direct_io", ["off", "on"])
def test_a_slot_cut_short_by_a_truncated_file_fails_that_block_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct_io: str, chunk_slots: int) -> None:
    if direct_io == "on" and not _o_direct_allowed(tmp_path):
        pytest.skip(f"the file system under {tmp_path} refuses O_DIRECT")
    monkeypatch.setattr(ssd_file, "CHUNK_BYTES", chunk_slots * SLOT)
    src = planes(16, seed=4)
    t = RankTier(src, SlotFile(tmp_path / "r0.slots", 8, SLOT, direct_io=direct_io), rank=0)
    assert t.split == (direct_io == "off")
    keys = [f"k{i}" for i in range(5)]
    spill(t, 1, keys, list(range(5)), list(range(5)))
    want = [page_bytes(src, p) for p in range(5)]
    os.truncate(tmp_path / "r0.slots", 2 * SLOT + SLOT // 2)  # behind the tier's back: slot 2 half gone
    before = {p: page_bytes(src, p) for p in range(10, 13)}
    assert t.promote(keys, list(range(5)), list(range(8, 13))) == (2, ["k2"])  # not an error: a miss
    assert [page_bytes(src, p) for p in (8, 9)] == want[:2]
    assert {p: page_bytes(src, p) for p in range(10, 13)} == before
    t.close()
