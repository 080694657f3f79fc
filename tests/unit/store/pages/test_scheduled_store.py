"""ScheduledPageStore: the worker side of scheduler-placed objects."""

from __future__ import annotations

import pytest
import torch

from ascend_offload.store.base import StoreError
from ascend_offload.store.pages.scheduled_store import ScheduledPageStore

LAYERS = {"l0": 16, "l1": 16}


def _row(v: int) -> torch.Tensor:
    return torch.full((16,), v, dtype=torch.uint8)


def _save(s: ScheduledPageStore, block: str, v: int) -> None:
    hs = s.allocate([f"{block}|l0", f"{block}|l1"], [16, 16])
    assert hs is not None and all(h is not None for h in hs)
    for h in hs:
        assert h is not None
        s.write(h, 0, _row(v))
    s.commit([h for h in hs if h is not None])


def test_save_then_read_at_placed_page() -> None:
    s = ScheduledPageStore(LAYERS, num_pages=4)
    s.set_step({"A": 2}, ["A"], [])
    _save(s, "A", 7)
    assert s.take_results() == ({"A"}, set())
    assert s.lookup_prefix(["A|l0", "A|l1"]) == 2
    pin = s.pin(["A|l1"])
    assert pin is not None
    out = torch.empty(16, dtype=torch.uint8)
    s.read(pin, "A|l1", 0, out)
    assert torch.equal(out, _row(7))
    assert torch.equal(s.planes["l0"][2], _row(7))


def test_unplaced_or_stored_blocks_are_not_written() -> None:
    s = ScheduledPageStore(LAYERS, num_pages=4)
    s.set_step({"A": 0}, ["A"], [])
    _save(s, "A", 1)
    s.set_step({"A": 0, "B": 1}, ["A"], [])  # A already committed there; B not placed for saving
    assert s.allocate(["A|l0", "B|l0", "C|l0"], [16, 16, 16]) == [None, None, None]


def test_key_moved_to_another_page_is_not_readable_until_rewritten() -> None:
    s = ScheduledPageStore(LAYERS, num_pages=4)
    s.set_step({"A": 0}, ["A"], [])
    _save(s, "A", 3)
    s.set_step({"A": 3}, [], ["A"])  # evicted, then placed elsewhere
    assert s.pin(["A|l0"]) is None and s.lookup_prefix(["A|l0"]) == 0
    s.set_step({"A": 3}, ["A"], [])
    _save(s, "A", 4)
    pin = s.pin(["A|l0"])
    assert pin is not None
    out = torch.empty(16, dtype=torch.uint8)
    s.read(pin, "A|l0", 0, out)
    assert torch.equal(out, _row(4))


def test_abort_reports_failure_and_bad_keys_raise() -> None:
    s = ScheduledPageStore(LAYERS, num_pages=2)
    s.set_step({"A": 0}, ["A"], [])
    hs = s.allocate(["A|l0"], [16])
    assert hs is not None and hs[0] is not None
    s.abort([hs[0]])
    assert s.take_results() == (set(), {"A"})
    with pytest.raises(StoreError, match="not '<block key>"):
        s.allocate(["nolayer"], [16])
    with pytest.raises(StoreError, match="size 8"):
        s.allocate(["A|l0"], [8])
