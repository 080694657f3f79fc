"""LocalStore: contract behaviour and a randomized state machine (hypothesis)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

from ascend_offload import device, native
from ascend_offload.store.base import StoreError
from ascend_offload.store.eviction import EVICTION_POLICIES
from ascend_offload.store.local import LocalStore

PAGE = 64


@pytest.fixture(params=EVICTION_POLICIES)
def eviction(request: pytest.FixtureRequest) -> str:
    """Every contract test runs under each eviction policy."""
    return request.param


def payload(seed: int, size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)


def test_page_count_floors_odd_capacity(eviction: str) -> None:
    s = LocalStore(capacity_bytes=10 * PAGE + PAGE - 1, page_bytes=PAGE, eviction=eviction)
    assert s.num_pages == 10
    assert s.stats().free_pages == 10
    with pytest.raises(ValueError, match="holds no page"):
        LocalStore(capacity_bytes=PAGE - 1, page_bytes=PAGE, eviction=eviction)


def test_pending_is_invisible_and_commit_makes_readable(eviction: str) -> None:
    s = LocalStore(8 * PAGE, PAGE, eviction=eviction)
    (h,) = s.allocate(["a"], [150]) or [None]
    assert h is not None
    assert s.lookup_prefix(["a"]) == 0 and s.pin(["a"]) is None
    data = payload(1, 150)
    s.write(h, 0, data[:100])
    s.write(h, 100, data[100:])
    s.commit([h])
    pin = s.pin(["a"])
    assert pin is not None
    out = torch.empty(150, dtype=torch.uint8)
    s.read(pin, "a", 0, out)
    assert torch.equal(out, data)
    s.unpin(pin)
    with pytest.raises(StoreError, match="without an active pin"):
        s.read(pin, "a", 0, out)


def test_allocation_is_atomic_and_full_store_skips(eviction: str) -> None:
    s = LocalStore(4 * PAGE, PAGE, eviction=eviction)
    assert s.allocate(["a", "b", "c", "d", "e"], [PAGE] * 5) is None
    st_ = s.stats()
    assert st_.skipped_stores == 5 and st_.free_pages == 4 and st_.pending_objects == 0


def test_duplicates_are_not_rewritten(eviction: str) -> None:
    s = LocalStore(4 * PAGE, PAGE, eviction=eviction)
    hs = s.allocate(["a", "a", "b"], [PAGE] * 3)
    assert hs is not None and hs[0] is not None and hs[1] is None and hs[2] is not None
    assert s.stats().duplicate_stores == 1


def test_pinned_objects_are_never_evicted(eviction: str) -> None:
    s = LocalStore(2 * PAGE, PAGE, eviction=eviction)
    hs = s.allocate(["a", "b"], [PAGE, PAGE])
    assert hs is not None
    for i, h in enumerate(hs):
        assert h is not None
        s.write(h, 0, payload(i, PAGE))
    s.commit([h for h in hs if h is not None])
    pin = s.pin(["a"])
    assert pin is not None
    new = s.allocate(["c"], [PAGE])  # must evict b, the only unpinned object
    assert new is not None and new[0] is not None
    assert s.lookup_prefix(["a"]) == 1 and s.lookup_prefix(["b"]) == 0
    assert s.allocate(["d"], [PAGE]) is None  # a pinned, c pending: nothing evictable
    out = torch.empty(PAGE, dtype=torch.uint8)
    s.read(pin, "a", 0, out)
    assert torch.equal(out, payload(0, PAGE))


def test_eviction_order_follows_pins(eviction: str) -> None:
    """A pin is a use: the pinned object outlives one that was not (LRU: it is the most
    recent; ARC: it moved to T2 while the other is still in T1)."""
    s = LocalStore(2 * PAGE, PAGE, eviction=eviction)
    hs = s.allocate(["a", "b"], [PAGE, PAGE])
    assert hs is not None
    s.commit([h for h in hs if h is not None])
    p = s.pin(["a"])  # a becomes most recent
    assert p is not None
    s.unpin(p)
    assert s.allocate(["c"], [PAGE]) is not None
    assert s.lookup_prefix(["a"]) == 1 and s.lookup_prefix(["b"]) == 0


def test_batch_paths_equal_single_paths(eviction: str) -> None:
    s = LocalStore(16 * PAGE, PAGE, eviction=eviction)
    keys = [f"k{i}" for i in range(5)]
    hs = s.allocate(keys, [PAGE] * 5)
    assert hs is not None
    src = torch.stack([payload(i, PAGE) for i in range(5)])
    s.write_batch([h for h in hs if h is not None], src.view(torch.float32))
    s.commit([h for h in hs if h is not None])
    pin = s.pin(keys)
    assert pin is not None
    out = torch.empty(5, PAGE, dtype=torch.uint8)
    s.read_batch(pin, keys, out)
    assert torch.equal(out, src)
    one = torch.empty(PAGE, dtype=torch.uint8)
    s.read(pin, "k3", 0, one)
    assert torch.equal(one, src[3])


def test_index_only_store_refuses_bytes(eviction: str) -> None:
    s = LocalStore(4 * PAGE, PAGE, with_data=False, eviction=eviction)
    hs = s.allocate(["a"], [PAGE])
    assert hs is not None and hs[0] is not None
    assert s.pages("a") == [0]
    with pytest.raises(StoreError, match="index only"):
        s.write(hs[0], 0, payload(0, PAGE))


class StoreMachine(RuleBasedStateMachine):
    """Random interleavings never expose pending/evicted data or lose pinned data."""

    pending = Bundle("pending")

    eviction = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.store = LocalStore(12 * PAGE, PAGE, eviction=self.eviction)
        self.next_key = 0
        self.committed: dict[str, torch.Tensor] = {}  # expected content of committed objects
        self.pending_data: dict[str, torch.Tensor] = {}
        self.pins: list[tuple[object, tuple[str, ...]]] = []

    @rule(target=pending, sizes=st.lists(st.integers(1, 3 * PAGE), min_size=1, max_size=3))
    def allocate(self, sizes: list[int]):  # type: ignore[no-untyped-def]
        keys = [f"o{self.next_key + i}" for i in range(len(sizes))]
        self.next_key += len(sizes)
        hs = self.store.allocate(keys, sizes)
        if hs is None:
            return []
        out = []
        for h in hs:
            assert h is not None
            data = payload(self.next_key * 31 + h.size, h.size)
            self.store.write(h, 0, data)
            self.pending_data[h.key] = data
            out.append(h)
        return out

    @rule(hs=pending)
    def commit(self, hs) -> None:  # type: ignore[no-untyped-def]
        live = [h for h in hs if h.key in self.pending_data]
        self.store.commit(live)
        for h in live:
            self.committed[h.key] = self.pending_data.pop(h.key)

    @rule(hs=pending)
    def abort(self, hs) -> None:  # type: ignore[no-untyped-def]
        live = [h for h in hs if h.key in self.pending_data]
        self.store.abort(live)
        for h in live:
            self.pending_data.pop(h.key)

    @rule(data=st.data())
    def pin_some(self, data: st.DataObject) -> None:
        candidates = sorted(set(self.committed) | set(self.pending_data))
        if not candidates:
            return
        keys = tuple(data.draw(st.lists(st.sampled_from(candidates), min_size=1, max_size=3, unique=True)))
        pin = self.store.pin(list(keys))
        present = all(self.store.lookup_prefix([k]) == 1 for k in keys)
        if any(k in self.pending_data for k in keys):
            assert pin is None, "pending object was pinned"
        if pin is not None:
            assert present
            self.pins.append((pin, keys))

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def read_pinned(self, data: st.DataObject) -> None:
        pin, keys = data.draw(st.sampled_from(self.pins))
        for k in keys:
            expected = self.committed[k]
            out = torch.empty_like(expected)
            self.store.read(pin, k, 0, out)  # type: ignore[arg-type]
            assert torch.equal(out, expected), f"pinned object {k} lost its data"

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.pins) - 1))
        pin, _ = self.pins.pop(i)
        self.store.unpin(pin)  # type: ignore[arg-type]

    @rule()
    def forget_evicted(self) -> None:
        for k in list(self.committed):
            if self.store.lookup_prefix([k]) == 0:
                assert not any(k in keys for _, keys in self.pins), f"pinned {k} was evicted"
                del self.committed[k]

    @invariant()
    def pending_never_visible(self) -> None:
        for k in self.pending_data:
            assert self.store.lookup_prefix([k]) == 0

    @invariant()
    def pages_add_up(self) -> None:
        s = self.store.stats()
        assert 0 <= s.free_pages <= s.total_pages
        objs = self.store._objects
        evictable = sum(len(o.pages) for o in objs.values() if o.committed and o.pins == 0)
        assert self.store.evictable_pages() == evictable
        used = sum(len(o.pages) for o in objs.values())
        assert used + s.free_pages == s.total_pages
        committed = {k for k, o in objs.items() if o.committed}
        assert s.stored_objects == len(committed) == len(self.store._policy)
        assert all(k in self.store._policy for k in committed)

    def teardown(self) -> None:
        for pin, _ in self.pins:
            self.store.unpin(pin)  # type: ignore[arg-type]
        pend = []
        for k in list(self.pending_data):
            obj = self.store._objects[k]
            from ascend_offload.store.base import WriteHandle

            pend.append(WriteHandle(key=k, size=obj.size, token=obj.token))
        self.store.abort(pend)
        # Everything released: evict all by allocating the whole pool.
        full = self.store.allocate([f"fill{i}" for i in range(12)], [PAGE] * 12)
        assert full is not None, "free + evictable pages do not add up to the pool"
        self.store.abort([h for h in full if h is not None])
        assert self.store.stats().free_pages == 12


class ArcStoreMachine(StoreMachine):
    """The same contract with ARC ordering the victims."""

    eviction = "arc"


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestArcStoreMachine = ArcStoreMachine.TestCase
TestArcStoreMachine.settings = TestStoreMachine.settings


@pytest.mark.parametrize("row_bytes", [PAGE, 3 * PAGE])  # one page (one scatter) / several pages
@pytest.mark.parametrize("use_native", [True, False])  # native row copy / plan + index kernels
def test_write_rows_and_read_rows_scatter_layer_blocks(row_bytes: int, use_native: bool,
                                                        monkeypatch) -> None:
    """A KV layer's scattered blocks go to and from the store in one call each: rows
    [5, 1, 6] of a block-first tensor round-trip byte for byte into rows [0, 7, 2],
    through the native row copy and through the fallback path alike."""
    if use_native and not native.available():
        pytest.skip("native library unavailable")
    if not use_native:
        monkeypatch.setattr(native, "available", lambda: False)
    s = LocalStore(32 * PAGE, PAGE)
    kv = torch.stack([payload(i, row_bytes) for i in range(8)]).view(torch.int32)  # [8, row/4]
    keys = ["b5", "b1", "b6"]
    handles = s.allocate(keys, [row_bytes] * 3)
    assert handles is not None and all(h is not None for h in handles)
    s.write_rows(handles, kv, [5, 1, 6])
    s.commit(handles)
    out = torch.zeros_like(kv)
    pin = s.pin(keys)
    assert pin is not None
    s.read_rows(pin, keys, out, [0, 7, 2])
    s.unpin(pin)
    assert torch.equal(out[0], kv[5]) and torch.equal(out[7], kv[1]) and torch.equal(out[2], kv[6])
    untouched = [1, 3, 4, 5, 6]
    assert int(out[untouched].count_nonzero()) == 0
    st_ = s.stats()
    assert st_.bytes_written == 3 * row_bytes and st_.bytes_read == 3 * row_bytes


def test_copy_host_rows_refuses_what_it_cannot_move() -> None:
    """device.copy_host_rows copies only between contiguous host rows of one byte size
    (False otherwise, nothing written) and names an out-of-range row."""
    if not native.available():
        pytest.skip("native library unavailable")
    src = torch.arange(4 * 16, dtype=torch.int32).view(4, 16)
    dst = torch.zeros(3, 64, dtype=torch.uint8)
    assert device.copy_host_rows(src, [3, 0], dst, [2, 0])
    assert torch.equal(dst[2], src[3].view(torch.uint8)) and torch.equal(dst[0], src[0].view(torch.uint8))
    assert int(dst[1].count_nonzero()) == 0
    wide = torch.zeros(3, 128, dtype=torch.uint8)
    assert not device.copy_host_rows(src, [0], wide, [0]) and int(wide.count_nonzero()) == 0
    assert not device.copy_host_rows(src.t(), [0], dst, [0])  # not contiguous
    with pytest.raises(IndexError, match="index 1 out of range"):
        device.copy_host_rows(src, [0, 4], dst, [0, 1])


def test_read_rows_needs_a_pin(eviction: str) -> None:
    s = LocalStore(8 * PAGE, PAGE, eviction=eviction)
    handles = s.allocate(["a"], [PAGE])
    assert handles is not None
    s.write_rows(handles, torch.ones(2, PAGE, dtype=torch.uint8), [1])
    s.commit(handles)
    other = s.pin(["a"])
    assert other is not None
    s.unpin(other)
    with pytest.raises(StoreError, match="without an active pin"):
        s.read_rows(other, ["a"], torch.zeros(2, PAGE, dtype=torch.uint8), [0])
