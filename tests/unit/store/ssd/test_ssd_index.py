"""The SSD tier's index (store/ssd/index.py): slots, states, eviction order, pins,
and the persisted file (atomic replace: a crash before the rename keeps the old one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ascend_offload.store.ssd import index as ssd_index
from ascend_offload.store.ssd.index import SsdIndex, read_index_file, write_index_file

META = {"fingerprint": "fp", "slot_bytes": 8192}


def ready(ix: SsdIndex, keys: list[str]) -> list[int | None]:
    slots = ix.allocate(keys)
    ix.mark_ready(keys)
    return slots


def test_writing_entries_are_not_found_until_ready() -> None:
    ix = SsdIndex(4)
    assert ix.allocate(["a", "b"]) == [0, 1]
    assert ix.lookup_prefix(["a", "b"]) == 0 and ix.used_slots == 2
    assert ix.allocate(["a", "c"]) == [None, 2]  # a key already on the tier gets no second slot
    ix.mark_ready(["a"])
    assert ix.lookup_prefix(["a", "b", "c"]) == 1
    ix.mark_ready(["b", "c"])
    assert ix.lookup_prefix(["a", "b", "c", "d"]) == 3


def test_full_tier_evicts_least_recently_used_ready_unpinned() -> None:
    ix = SsdIndex(3)
    ready(ix, ["a", "b", "c"])
    ix.pin(["a"])  # a hit: most recent, and held while ranks read it
    ix.unpin(["a"])
    assert ix.allocate(["d"]) == [1]  # b was the least recently used
    assert "b" not in ix and ix.evicted == 1
    ix.pin(["c"])
    ix.mark_ready(["d"])
    assert ix.allocate(["e"]) == [0]  # c pinned: a goes
    assert "c" in ix and "a" not in ix


def test_nothing_evictable_means_no_slot() -> None:
    ix = SsdIndex(2)
    ix.allocate(["a"])  # writing: not evictable
    ready(ix, ["b"])
    ix.pin(["b"])
    assert ix.allocate(["c"]) == [None]
    assert ix.evicted == 0 and ix.used_slots == 2
    ix.unpin(["b"])
    assert ix.allocate(["c"]) == [1]


def test_drop_frees_the_slot_but_not_while_pinned() -> None:
    ix = SsdIndex(2)
    ready(ix, ["a", "b"])
    ix.pin(["a"])
    assert ix.drop(["a", "b", "zz"]) == 1
    assert "a" in ix and "b" not in ix and ix.used_slots == 1
    ix.unpin(["a"])
    assert ix.drop(["a"]) == 1 and ix.used_slots == 0
    with pytest.raises(KeyError):
        ix.allocate(["x"])
        ix.pin(["x"])  # writing entries cannot be read


def test_snapshot_restores_ready_entries_in_order() -> None:
    ix = SsdIndex(4)
    ready(ix, ["a", "b", "c"])
    ix.allocate(["w"])  # a write in flight is not persisted
    ix.pin(["a"])  # a is now the most recent
    snap = ix.snapshot(META)
    assert [k for k, _ in snap["entries"]] == ["b", "c", "a"]
    again = SsdIndex(4)
    assert again.restore(json.loads(json.dumps(snap)), META) == 3
    assert again.lookup_prefix(["a", "b", "c"]) == 3
    assert again.slot("a") == ix.slot("a") and again.used_slots == 3
    assert again.allocate(["x", "y"]) == [3, ix.slot("b")]  # then b, the oldest, is evicted
    assert "b" not in again and again.evicted == 1


@pytest.mark.parametrize("bad", [
    {"format": 99},
    {"num_slots": 5},
    {"slot_bytes": 4096},
    {"entries": [["a", 0], ["b", 0]]},  # one slot twice
    {"entries": [["a", 0], ["a", 1]]},  # one key twice
    {"entries": [["a", 4]]},  # outside the file
    {"entries": [["a", "0"]]},
    {"entries": "x"},
])
def test_restore_refuses_a_foreign_or_malformed_snapshot(bad: dict) -> None:
    ix = SsdIndex(4)
    ready(ix, ["a"])
    snap = {**ix.snapshot(META), **bad}
    fresh = SsdIndex(4)
    assert fresh.restore(snap, META) == 0
    assert len(fresh) == 0 and fresh.used_slots == 0


def test_index_file_round_trip_and_unreadable_files(tmp_path: Path) -> None:
    path = tmp_path / "ix.json"
    assert read_index_file(path) is None
    write_index_file(path, {"format": 1, "entries": [["a", 0]]})
    assert read_index_file(path) == {"format": 1, "entries": [["a", 0]]}
    assert not path.with_name("ix.json.tmp").exists()
    path.write_bytes(b"{not json")
    assert read_index_file(path) is None
    path.write_bytes(b"[1, 2]")
    assert read_index_file(path) is None


def test_crash_between_tmp_write_and_rename_keeps_the_old_index(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ix.json"
    ix = SsdIndex(4)
    ready(ix, ["a", "b"])
    old = ix.snapshot(META)
    write_index_file(path, old)
    ready(ix, ["c"])

    def crash(src: object, dst: object) -> None:  # the process dies right before the rename
        raise SystemExit("killed")

    monkeypatch.setattr(ssd_index.os, "replace", crash)
    with pytest.raises(SystemExit):
        write_index_file(path, ix.snapshot(META))
    monkeypatch.undo()
    assert path.with_name("ix.json.tmp").exists()  # the new one was written, never renamed
    back = SsdIndex(4)
    assert back.restore(read_index_file(path) or {}, META) == 2
    assert back.lookup_prefix(["a", "b", "c"]) == 2
    # a torn tmp file left behind is overwritten by the next save, never read
    path.with_name("ix.json.tmp").write_bytes(b"\0garbage")
    write_index_file(path, ix.snapshot(META))
    assert SsdIndex(4).restore(read_index_file(path) or {}, META) == 3
