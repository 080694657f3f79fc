"""A rank's SSD slot file (store/ssd/file.py): preallocation, the O_DIRECT probe, the
exclusive lock, spills behind on the writer thread, verified promotes (a damaged slot
is a miss, never bytes in a page)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ascend_offload.store.ssd import format as fmt
from ascend_offload.store.ssd.file import RankTier, SlotFile, SsdError

LAYERS = (1000, 3000, 512)  # bytes of one block per layer (planes of one rank)
PAGE = sum(LAYERS)
SLOT = fmt.slot_bytes(PAGE)


def planes(pages: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"l{i}": torch.randint(0, 256, (pages, b), dtype=torch.uint8, generator=g) for i, b in enumerate(LAYERS)}


def page_bytes(pl: dict[str, torch.Tensor], page: int) -> bytes:
    return b"".join(bytes(p[page].numpy()) for p in pl.values())


def tier(tmp_path: Path, pl: dict[str, torch.Tensor], slots: int = 16, **kw) -> RankTier:
    return RankTier(pl, SlotFile(tmp_path / "r0.slots", slots, SLOT, **kw), rank=0)


def spill(t: RankTier, job: int, keys: list[str], pages: list[int], slots: list[int]) -> None:
    t.submit_spill(job, keys, pages, slots)
    assert t.wait_idle(30)
    done, failed = t.take_spill_report()
    assert done == {job: 1} and not failed


def _file_system_allows(tmp_path: Path, what: str) -> bool:
    """Whether the file system under ``tmp_path`` supports ``fallocate`` / ``O_DIRECT``
    (tmpfs before Linux 6.6 and some overlays refuse O_DIRECT; some refuse fallocate)."""
    probe = tmp_path / f".probe-{what}"
    try:
        if what == "o_direct":
            os.close(os.open(probe, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600))
        else:
            fd = os.open(probe, os.O_CREAT | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, 4096)
            finally:
                os.close(fd)
        return True
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


def test_file_is_preallocated_locked_and_probed(tmp_path: Path) -> None:
    f = SlotFile(tmp_path / "d" / "r0.slots", 10, SLOT)
    assert os.stat(tmp_path / "d" / "r0.slots").st_size == 10 * SLOT
    if _file_system_allows(tmp_path, "fallocate"):
        assert os.stat(tmp_path / "d" / "r0.slots").st_blocks * 512 >= 10 * SLOT  # fallocated, not sparse
    with pytest.raises(SsdError, match="in use by another process"):
        SlotFile(tmp_path / "d" / "r0.slots", 10, SLOT)
    f.close()
    buffered = SlotFile(tmp_path / "d" / "r0.slots", 10, SLOT, direct_io="off")
    assert not buffered.direct
    buffered.close()


def test_file_system_refusing_o_direct_falls_back_or_fails_naming_the_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ascend_offload.store.ssd import file as ssd_file

    real_open = os.open

    def refusing_open(path, flags, *args):  # what tmpfs before Linux 6.6 and some overlays answer
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(ssd_file.os, "open", refusing_open)
    auto = SlotFile(tmp_path / "r0.slots", 2, SLOT)
    assert not auto.direct
    auto.close()
    with pytest.raises(SsdError, match=r"local\.ssd\.direct_io"):
        SlotFile(tmp_path / "r0.slots", 2, SLOT, direct_io="on")
    monkeypatch.undo()
    if not _file_system_allows(tmp_path, "o_direct"):
        pytest.skip(f"the file system under {tmp_path} refuses O_DIRECT: direct_io='on' cannot be shown")
    on = SlotFile(tmp_path / "r0.slots", 2, SLOT, direct_io="on")
    assert on.direct
    on.close()


@pytest.mark.parametrize(("direct_io", "copy"), [("auto", "native"), ("auto", "numpy"), ("off", "native")])
def test_spill_then_promote_returns_the_exact_bytes(tmp_path: Path, direct_io: str, copy: str) -> None:
    src = planes(seed=1)
    want = {p: page_bytes(src, p) for p in range(4)}
    t = tier(tmp_path, src, direct_io=direct_io)
    if copy == "numpy":  # whole slots (O_DIRECT, or buffered past IOV_MAX) without the library
        t._strided_tables = ()
    spill(t, 7, ["a", "b", "c", "d"], [0, 1, 2, 3], [3, 4, 5, 11])
    for p in src.values():
        p.zero_()
    assert t.promote(["a", "b", "c", "d"], [3, 4, 5, 11], [7, 6, 5, 4]) == (4, [])
    assert [page_bytes(src, p) for p in (7, 6, 5, 4)] == [want[0], want[1], want[2], want[3]]
    t.close()


def test_reopened_kept_file_serves_earlier_slots(tmp_path: Path) -> None:
    src = planes(seed=2)
    want = page_bytes(src, 2)
    t = tier(tmp_path, src, keep=True)
    spill(t, 1, ["k"], [2], [9])
    t.close()
    dst = planes(seed=3)
    again = tier(tmp_path, dst, keep=True)
    assert again.file.kept
    assert again.promote(["k"], [9], [0]) == (1, [])
    assert page_bytes(dst, 0) == want
    again.close()
    fresh = tier(tmp_path, planes(seed=3), keep=False)  # without persist the file is recreated
    assert not fresh.file.kept
    assert fresh.promote(["k"], [9], [0]) == (0, ["k"])
    fresh.close()


def test_flipped_byte_on_disk_is_a_miss_and_the_page_is_untouched(tmp_path: Path) -> None:
    src = planes(seed=4)
    t = tier(tmp_path, src)
    spill(t, 1, ["a", "b", "c"], [0, 1, 2], [0, 1, 2])
    with open(tmp_path / "r0.slots", "r+b") as f:  # one bit of b's payload, behind the tier's back
        f.seek(1 * SLOT + fmt.HEADER_BYTES + 1234)
        byte = f.read(1)[0]
        f.seek(1 * SLOT + fmt.HEADER_BYTES + 1234)
        f.write(bytes([byte ^ 0x01]))
        f.flush()
        os.fsync(f.fileno())
    before = {p: page_bytes(src, p) for p in (5, 6, 7)}
    good, corrupt = t.promote(["a", "b", "c"], [0, 1, 2], [5, 6, 7])
    assert (good, corrupt) == (1, ["b"])  # a arrived; b and everything after it is a miss
    assert page_bytes(src, 5) == page_bytes(src, 0)
    assert page_bytes(src, 6) == before[6] and page_bytes(src, 7) == before[7]
    t.close()


def test_slot_rewritten_for_another_key_is_a_miss(tmp_path: Path) -> None:
    src = planes(seed=5)
    t = tier(tmp_path, src)
    spill(t, 1, ["old"], [0], [4])
    spill(t, 2, ["new"], [1], [4])  # the slot was reused after "old" was evicted
    assert t.promote(["old"], [4], [6]) == (0, ["old"])
    assert t.promote(["new"], [4], [6]) == (1, [])
    assert page_bytes(src, 6) == page_bytes(src, 1)
    t.close()


def test_write_error_is_reported_as_a_failed_job(tmp_path: Path) -> None:
    t = tier(tmp_path, planes())
    t.submit_spill(3, ["a"], [0], [99])  # outside the file: the writer raises, the job fails
    assert t.wait_idle(30)
    assert t.take_spill_report() == ({}, {3: 1})
    assert t.failed_writes == 1
    t.close()


def test_many_slots_cross_the_staging_chunk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ascend_offload.store.ssd import file as ssd_file

    monkeypatch.setattr(ssd_file, "CHUNK_BYTES", 3 * SLOT)  # 3 slots a chunk: runs split across chunks
    src = planes(pages=10, seed=6)
    want = [page_bytes(src, p) for p in range(10)]
    t = tier(tmp_path, src, slots=12)
    keys = [f"k{i}" for i in range(10)]
    slots = [0, 1, 2, 3, 5, 6, 11, 10, 8, 9]
    spill(t, 1, keys, list(range(10)), slots)
    for p in src.values():
        p.zero_()
    assert t.promote(keys, slots, list(range(9, -1, -1))) == (10, [])
    assert [page_bytes(src, p) for p in range(9, -1, -1)] == want
    t.close()


def test_misplaced_slot_in_a_later_chunk_is_a_miss_after_the_blocks_before_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ascend_offload.store.ssd import file as ssd_file

    monkeypatch.setattr(ssd_file, "CHUNK_BYTES", 3 * SLOT)  # the bad slot is the last of the second chunk
    src = planes(pages=16, seed=7)
    t = tier(tmp_path, src, slots=12)
    keys = [f"k{i}" for i in range(8)]
    spill(t, 1, keys, list(range(8)), list(range(8)))
    with open(tmp_path / "r0.slots", "r+b") as f:  # slot 4's bytes written over slot 5 (a misplaced write)
        f.seek(4 * SLOT)
        moved = f.read(SLOT)
        f.seek(5 * SLOT)
        f.write(moved)
        f.flush()
        os.fsync(f.fileno())
    before = {p: page_bytes(src, p) for p in range(8, 16)}
    good, corrupt = t.promote(keys, list(range(8)), list(range(8, 16)))
    assert (good, corrupt) == (5, ["k5"])
    assert [page_bytes(src, 8 + i) for i in range(5)] == [page_bytes(src, i) for i in range(5)]
    assert [page_bytes(src, p) for p in range(13, 16)] == [before[p] for p in range(13, 16)]
    t.close()
