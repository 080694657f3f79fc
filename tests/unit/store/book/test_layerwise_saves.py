"""LayerwiseSaves: the layerwise scheduler bookkeeping, driven with plain block keys."""

from __future__ import annotations

from ascend_offload.store.book.layerwise_saves import LayerwiseSaves
from ascend_offload.store.local import LocalStore

PAGE = 64
BS = 4
PARTIAL = "partial:e0"


def make(num_pages: int = 16, world_size: int = 2) -> LayerwiseSaves:
    index = LocalStore(num_pages * PAGE, PAGE, with_data=False)
    return LayerwiseSaves(index, block_size=BS, page_bytes=PAGE, world_size=world_size,
                          min_load_blocks=1, partial_prefix=PARTIAL)


def every_rank_done(saves: LayerwiseSaves, keys: list[str]) -> None:
    for _ in range(saves.world_size):
        saves.report(dict.fromkeys(keys, 1), {})


def stats(saves: LayerwiseSaves) -> tuple[int, int, int]:
    """(stored, pinned, pending) objects of the index."""
    s = saves.index.stats()
    return s.stored_objects, s.pinned_objects, s.pending_objects


def test_block_commits_after_every_rank_and_stays_pinned_for_its_request() -> None:
    saves = make(world_size=3)
    assert saves.place("r", ["a", "b"]) == ["a", "b"]
    assert saves.saving == {"a", "b"}
    assert saves.pages(["a", "b", "a"]) == {"a": saves.index.pages("a")[0], "b": saves.index.pages("b")[0]}
    saves.report({"a": 2, "b": 1}, {})
    assert stats(saves) == (0, 0, 2)
    saves.report({"a": 1}, {})  # a: 3 of 3 ranks, b: 1 of 3
    assert saves.saving == {"b"}
    assert saves.index.is_committed("a") and not saves.index.is_committed("b")
    assert stats(saves) == (1, 1, 1)  # r reads a back in later steps: pinned
    saves.report({"b": 2}, {})
    assert stats(saves) == (2, 2, 0) and saves.saving == frozenset()
    counts = saves.finish("r")
    assert counts is not None and counts["saved_blocks"] == 2
    assert stats(saves) == (2, 0, 0)  # full blocks stay stored, unpinned
    assert saves.totals["saved_blocks"] == 2


def test_failed_rank_aborts_the_block() -> None:
    saves = make(num_pages=4, world_size=2)
    saves.place("r", ["a"])
    saves.report({"a": 1}, {"a": 1})
    assert stats(saves) == (0, 0, 0) and saves.index.stats().free_pages == 4
    assert not saves.index.has("a") and saves.saving == frozenset()
    assert saves.totals["save_failed_jobs"] == 1


def test_reports_for_settled_or_unknown_keys_are_ignored() -> None:
    saves = make(world_size=1)
    saves.place("r", ["a"])
    every_rank_done(saves, ["a"])
    saves.report({"a": 1, "zzz": 1}, {"a": 1})  # a late duplicate report changes nothing
    assert saves.index.is_committed("a") and stats(saves) == (1, 1, 0)
    assert "save_failed_jobs" not in saves.totals


def test_same_block_in_one_step_is_written_once_and_pinned_for_both() -> None:
    saves = make()
    assert saves.place("r1", ["a"]) == ["a"]
    assert saves.place("r2", ["a"]) == []  # r1 writes it
    every_rank_done(saves, ["a"])
    assert stats(saves) == (1, 1, 0)
    assert saves.index.stats().allocated_objects == 1
    c2 = saves.finish("r2")
    assert c2 is not None and c2["duplicate_blocks"] == 1 and c2["saved_blocks"] == 0
    assert stats(saves) == (1, 1, 0)  # still pinned for r1
    saves.finish("r1")
    assert stats(saves) == (1, 0, 0)


def test_stored_block_is_pinned_for_the_request_that_would_save_it() -> None:
    saves = make()
    saves.place("w", ["a"])
    every_rank_done(saves, ["a"])
    saves.finish("w")
    assert saves.place("r", ["a"]) == []
    assert stats(saves) == (1, 1, 0)
    assert saves.totals["duplicate_blocks"] == 1
    saves.finish("r")
    assert stats(saves) == (1, 0, 0)


def test_full_store_skips_a_block_and_gives_it_no_page() -> None:
    saves = make(num_pages=1)
    assert saves.place("r", ["a", "b"]) == ["a"]  # a pending fills the only page
    assert saves.pages(["a", "b"]) == {"a": saves.index.pages("a")[0]}
    counts = saves.finish("r")
    assert counts is not None and counts["skipped_blocks"] == 1 and counts["saved_blocks"] == 1


def test_partial_block_of_a_finished_request_is_discarded_when_it_commits() -> None:
    saves = make(num_pages=4)
    partial = f"{PARTIAL}/r/0/3"
    assert saves.place("r", [partial]) == [partial]
    saves.take_freed()
    saves.finish("r")  # still being written: not discarded yet
    assert saves.index.has(partial)
    every_rank_done(saves, [partial])
    assert not saves.index.has(partial)  # nobody can read it again
    assert stats(saves) == (0, 0, 0) and saves.index.stats().free_pages == 4
    assert saves.take_freed() == [partial]  # workers forget its page


def test_partial_block_is_discarded_when_its_request_ends() -> None:
    saves = make(num_pages=4)
    partial, full = f"{PARTIAL}/r/1/2", "a"
    saves.place("r", [full, partial])
    every_rank_done(saves, [full, partial])
    assert stats(saves) == (2, 2, 0)  # both read back by r while it runs
    saves.finish("r")
    assert saves.index.is_committed(full) and not saves.index.has(partial)
    assert stats(saves) == (1, 0, 0) and saves.index.stats().free_pages == 3


def test_full_block_of_a_finished_request_is_kept() -> None:
    saves = make()
    saves.place("r", ["a"])
    saves.finish("r")
    every_rank_done(saves, ["a"])
    assert saves.index.is_committed("a") and stats(saves) == (1, 0, 0)


def test_accepted_hit_is_pinned_until_the_request_ends() -> None:
    saves = make()
    saves.place("w", ["a", "b"])
    every_rank_done(saves, ["a", "b"])
    saves.finish("w")
    assert saves.lookup("r", 0, 2, lambda n: ["a", "b"][:n]) == 2 * BS
    assert saves.accept_load("r", 2 * BS)
    assert saves.hit_keys("r") == ("a", "b")
    assert stats(saves) == (2, 2, 0)  # the pipeline loads them layer by layer
    assert saves.metrics()[1] == {"pinned_objects": 2, "pending_objects": 0}  # the idle gauges
    counts = saves.finish("r")
    assert counts is not None and counts["loaded_blocks"] == 2
    assert stats(saves) == (2, 0, 0)
    assert saves.metrics()[1] == {"pinned_objects": 0, "pending_objects": 0}


def test_offer_taken_with_another_count_is_released() -> None:
    saves = make()
    saves.place("w", ["a", "b"])
    every_rank_done(saves, ["a", "b"])
    saves.finish("w")
    assert saves.lookup("r", 0, 2, lambda n: ["a", "b"][:n]) == 2 * BS
    assert not saves.accept_load("r", BS)
    assert saves.hit_keys("r") == () and stats(saves) == (2, 0, 0)
    assert saves.totals["loaded_blocks"] == 0
