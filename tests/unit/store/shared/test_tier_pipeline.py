"""The shared tier's integrity check and its overlap with the transfer
(store/shared/tier.py, store/shared/integrity.py), over the Memcache fakes
(tests/support/fake_ascend.py, the real ``memcache_hybrid`` signatures):

* payload hashes: one changed byte in any row, or rows swapped between layers, change
  the object's hash; pages hashed in any order answer in call order;
* a call split in two transfers (``pipeline_min_bytes``) moves the same bytes, overlaps
  the hash of one part with the other part's transfer (a transfer that waits for that
  hash would otherwise stall), and still makes a corrupt object a miss, whether the
  store's copy or the fetched page is wrong;
* deadlines: a first part that outlives its deadline ends the call at that deadline, the
  second part is never sent, and the call's token comes back only once the late part
  really ended;
* counters add up to the call's blocks on every path.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

from ascend_offload.store.shared import tier as shared_tier
from ascend_offload.store.shared.integrity import (
    FOLD,
    OBJECT_MAJOR_ROW_BYTES,
    PageHasher,
    fold_rows,
)
from ascend_offload.store.shared.memcache import RemotePages
from ascend_offload.store.shared.tier import TierCounts, _LateEnds
from tests.support.fake_ascend import FakeDistributedObjectStore, FakeMemcacheCluster

PAGES = 16
ROWS = (48, 80, 32)  # bytes of one block's row in each layer plane
CFG = SimpleNamespace(meta_service_url="tcp://127.0.0.1:1", config_store_url="tcp://127.0.0.1:2",
                      call_timeout_s=30.0, retry_interval_s=0.01, replica_num=1)
KEYS = [f"b{i}" for i in range(8)]
Rank = Callable[..., RemotePages]  # the rank fixture: rank(seed, *, cfg, client, pipelined)


def planes(seed: int | None) -> dict[str, torch.Tensor]:
    """A rank's page planes; ``seed`` None: zeros (a reader)."""
    g = torch.Generator().manual_seed(seed or 0)
    return {f"model.layers.{i}.attn": (torch.randint(0, 256, (PAGES, n), dtype=torch.uint8, generator=g)
                                       if seed is not None else torch.zeros(PAGES, n, dtype=torch.uint8))
            for i, n in enumerate(ROWS)}




def block(pages: RemotePages, page: int) -> list[torch.Tensor]:
    return [p[page].clone() for p in pages._planes]


def consistent(c: TierCounts, published: int, fetched: int) -> None:
    """Every block of every call counted exactly once."""
    assert c.published_blocks + c.publish_duplicates + c.publish_skipped == published
    assert c.fetched_blocks + c.fetch_failed_blocks == fetched
    assert c.fetch_corrupt_blocks <= c.fetch_failed_blocks


def ended_tokens(pages: RemotePages, timeout_s: float = 5.0) -> list:
    """The tokens of late calls once one has ended (bounded wait)."""
    deadline = time.monotonic() + timeout_s
    while not (ended := pages.take_ended()):
        assert time.monotonic() < deadline, "no late call ended"
        time.sleep(0.01)
    return ended


@pytest.fixture
def cluster() -> Iterator[FakeMemcacheCluster]:
    c = FakeMemcacheCluster()
    yield c
    c.unhang()


@pytest.fixture
def rank(cluster: FakeMemcacheCluster) -> Iterator[Rank]:
    """Makes a rank's tier over ``cluster`` (``rank(seed)``; seed None: a reader's zero
    pages); every one made is closed after the test."""
    made: list[RemotePages] = []

    def make(seed: int | None, *, cfg: SimpleNamespace = CFG,
             client: FakeDistributedObjectStore | None = None, pipelined: bool = True) -> RemotePages:
        if client is None:
            client = FakeDistributedObjectStore(cluster)
            client.init(0, True)
        pages = RemotePages(cfg, planes(seed), 0, client=client)
        pages.pipeline_min_bytes = 1 if pipelined else float("inf")
        made.append(pages)
        return pages

    yield make
    for pages in made:
        pages.close()


# ------------------------------------------------------------------ payload hashes


def test_any_changed_byte_or_swapped_rows_change_the_payload_hash() -> None:
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, (6, n), dtype=np.uint8) for n in (64, 64, 96)]
    h = PageHasher(arrays)
    pages = np.arange(6)
    before = h.payload_hashes(pages)
    assert len(set(before.tolist())) == 6
    for plane in range(3):
        for at in (0, 17, arrays[plane].shape[1] - 1):
            arrays[plane][2, at] ^= 0x01
            after = h.payload_hashes(pages)
            arrays[plane][2, at] ^= 0x01
            assert after[2] != before[2] and np.array_equal(np.delete(after, 2), np.delete(before, 2))
    rows0, rows1 = arrays[0][4].copy(), arrays[1][4].copy()
    arrays[0][4], arrays[1][4] = rows1, rows0  # the same bytes under the other layer
    assert h.payload_hashes(pages)[4] != before[4]


def test_the_payload_hash_is_the_seeded_row_digests_folded_in_layer_order() -> None:
    """The trailer's format (version 2), computed the plain way: every engine must agree."""
    rng = np.random.default_rng(2)
    mask = (1 << 64) - 1
    # short rows are hashed plane by plane, long ones object by object: the same values
    for sizes in ((40, 24, 72), (OBJECT_MAJOR_ROW_BYTES, OBJECT_MAJOR_ROW_BYTES + 8)):
        arrays = [rng.integers(0, 256, (5, n), dtype=np.uint8) for n in sizes]
        hasher = PageHasher(arrays)
        want = []
        for page in range(5):
            h = 0
            for seed, rows in enumerate(arrays):
                h = (h * int(FOLD) + xxhash.xxh3_64_intdigest(rows[page].tobytes(), seed=seed)) & mask
            want.append(h)
            digests = [np.array([xxhash.xxh3_64_intdigest(rows[page].tobytes(), seed=s)], dtype=np.uint64)
                       for s, rows in enumerate(arrays)]
            assert int(fold_rows(digests)[0]) == h
        for pages in ([0, 1, 2, 3, 4], [4, 0, 2], [3]):
            assert hasher.payload_hashes(np.array(pages)).tolist() == [want[p] for p in pages]


def test_pages_in_any_order_answer_in_call_order() -> None:
    rng = np.random.default_rng(1)
    arrays = [rng.integers(0, 256, (32, 40), dtype=np.uint8) for _ in range(2)]
    h = PageHasher(arrays)
    one_by_one = np.array([h.payload_hashes(np.array([p]))[0] for p in range(32)], dtype=np.uint64)
    for pages in (np.arange(32), rng.permutation(32), np.array([9, 3, 3, 30, 0]), np.arange(5, 25),
                  np.array([1, 2, 3, 4, 5, 9, 10, 11, 12, 20, 21, 22, 23]), np.array([4, 4, 5, 6])):
        assert np.array_equal(h.payload_hashes(pages), one_by_one[pages])


# ------------------------------------------------------------------ the two-part path


def test_two_part_publish_and_fetch_move_identical_bytes(cluster: FakeMemcacheCluster, rank: Rank) -> None:
    w, r = rank(3), rank(None)
    src, dst = [0, 1, 2, 3, 5, 8, 13, 14], [15, 2, 9, 4, 0, 11, 6, 7]
    assert w.publish(KEYS, src)
    assert cluster.calls.count("batch_put_from_layers") == 2  # two parts: 2 blocks, then 6
    assert r.fetch(KEYS, dst) == (True, True)
    assert cluster.calls.count("batch_get_into_layers") == 2
    for s, d in zip(src, dst, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(block(w, s), block(r, d), strict=True))
    consistent(w.counts, 8, 0)
    consistent(r.counts, 0, 8)
    assert w.counts.published_blocks == 8 and r.counts.fetched_blocks == 8
    # one-part calls read what two-part calls wrote, and the other way round
    r.pipeline_min_bytes = float("inf")
    assert r.fetch(KEYS[:3], [1, 3, 5]) == (True, True)
    assert torch.equal(block(r, 5)[2], block(w, 2)[2])


class Gated(FakeDistributedObjectStore):
    """A client whose put / get of the call's first or second part waits for ``gate`` (set
    by the hash of the other part): only a call that hashes while that transfer runs ends
    without waiting out the 5 s."""

    def __init__(self, cluster: FakeMemcacheCluster) -> None:
        super().__init__(cluster)
        self.init(0, True)
        self.gate = threading.Event()
        self.gated: str | None = None  # the key whose transfer waits
        self.waited: list[bool] = []

    def _wait(self, keys: Sequence[str]) -> None:
        if self.gated in keys:
            self.waited.append(self.gate.wait(5.0))

    def batch_put_from_layers(self, keys: Sequence[str], *args: Any, **kw: Any) -> list[int]:
        self._wait(keys)
        return super().batch_put_from_layers(keys, *args, **kw)

    def batch_get_into_layers(self, keys: Sequence[str], *args: Any, **kw: Any) -> list[int]:
        self._wait(keys)
        return super().batch_get_into_layers(keys, *args, **kw)


def test_the_hash_of_one_part_runs_while_the_other_part_moves(cluster: FakeMemcacheCluster, rank: Rank) -> None:
    client = Gated(cluster)
    w = rank(4, client=client)
    r_client = Gated(cluster)
    r = rank(None, client=r_client)
    hashed: list[int] = []

    def watch(pages: RemotePages, client: Gated, after: int) -> None:
        real = pages._hasher.payload_hashes

        def payload_hashes(idx: np.ndarray) -> np.ndarray:
            hashed.append(len(idx))
            out = real(idx)
            if len(hashed) == after:
                client.gate.set()
            return out

        pages._hasher.payload_hashes = payload_hashes  # type: ignore[method-assign]

    try:
        # publish: parts [b0, b1] and [b2..b7]; the first put waits for the second part's hash
        client.gated = "b0@r0"
        watch(w, client, after=2)
        t0 = time.monotonic()
        assert w.publish(KEYS, list(range(8)))
        assert client.waited == [True] and time.monotonic() - t0 < 4.0
        assert hashed == [2, 6]
        # fetch: parts [b0..b5] and [b6, b7]; the second get waits for the first part's check
        hashed.clear()
        r_client.gated = "b6@r0"
        watch(r, r_client, after=1)
        t0 = time.monotonic()
        assert r.fetch(KEYS, list(range(8, 16))) == (True, True)
        assert r_client.waited == [True] and time.monotonic() - t0 < 4.0
        assert hashed == [6, 2]
        assert torch.equal(block(r, 15)[1], block(w, 7)[1])
    finally:
        client.gate.set()
        r_client.gate.set()


def test_a_corrupt_object_in_either_part_is_a_miss(cluster: FakeMemcacheCluster, rank: Rank) -> None:
    w, r = rank(5), rank(None)
    assert w.publish(KEYS, list(range(8)))
    for key, at in (("b1@r0", 3), ("b7@r0", 150)):  # the first part's, the last part's
        data = bytearray(cluster.objects[key])
        data[at] ^= 0x40
        cluster.objects[key] = bytes(data)
    assert r.fetch(KEYS, list(range(8, 16))) == (False, True)  # a miss; nothing still writes
    c = r.counts
    assert (c.fetched_blocks, c.fetch_failed_blocks, c.fetch_corrupt_blocks) == (6, 2, 2)
    assert "b1@r0" not in cluster.objects and "b7@r0" not in cluster.objects  # removed
    consistent(c, 0, 8)


class Tearing(FakeDistributedObjectStore):
    """A get that writes one wrong byte into the first page it fills (a torn transfer)."""

    def __init__(self, cluster: FakeMemcacheCluster) -> None:
        super().__init__(cluster)
        self.init(0, True)
        self.tear: str | None = None

    def batch_get_into_layers(self, keys: Sequence[str], buffer_ptrs: Sequence[Sequence[int]],
                              *args: Any, **kw: Any) -> list[int]:
        out = super().batch_get_into_layers(keys, buffer_ptrs, *args, **kw)
        if self.tear in keys:
            at = buffer_ptrs[list(keys).index(self.tear)][1] + 7  # a byte of the second layer's row
            ctypes.c_uint8.from_address(at).value ^= 0x01
        return out


def test_a_byte_torn_in_the_fetched_page_is_a_miss_in_either_part(cluster: FakeMemcacheCluster, rank: Rank) -> None:
    w = rank(6)
    client = Tearing(cluster)
    r = rank(None, client=client)
    assert w.publish(KEYS, list(range(8)))
    for key in ("b2", "b7"):  # verified while the last part is fetched; verified last
        client.tear = f"{key}@r0"
        assert r.fetch(KEYS, list(range(8, 16))) == (False, True)
        assert f"{key}@r0" not in cluster.objects  # removed: no engine fetches it again
        assert w.publish([key], [int(key[1:])])  # published again
    assert r.counts.fetch_corrupt_blocks == 2 and r.counts.fetched_blocks == 14
    consistent(r.counts, 0, 16)


def test_a_failed_first_part_ends_the_fetch_and_the_rest_is_a_miss(cluster: FakeMemcacheCluster, rank: Rank) -> None:
    w, r = rank(7), rank(None)
    assert w.publish(KEYS, list(range(8)))
    cluster.evict(["b3@r0"])
    calls = cluster.calls.count("batch_get_into_layers")
    assert r.fetch(KEYS, list(range(8, 16))) == (False, True)  # evicted: a safe miss
    assert cluster.calls.count("batch_get_into_layers") == calls + 1  # the last part not sent
    c = r.counts
    assert (c.fetched_blocks, c.fetch_failed_blocks, c.fetch_corrupt_blocks) == (5, 3, 0)
    consistent(c, 0, 8)


def test_a_get_that_raises_keeps_the_pages_and_counts_every_block(cluster: FakeMemcacheCluster, rank: Rank) -> None:
    class Raising(FakeDistributedObjectStore):
        def batch_get_into_layers(self, keys: Sequence[str], *args: Any, **kw: Any) -> list[int]:
            if "b7@r0" in keys:
                raise RuntimeError("broken client")
            return super().batch_get_into_layers(keys, *args, **kw)

    w = rank(8)
    client = Raising(cluster)
    client.init(0, True)
    r = rank(None, client=client)
    assert w.publish(KEYS, list(range(8)))
    assert r.fetch(KEYS, list(range(8, 16))) == (False, False)  # may still write: kept
    consistent(r.counts, 0, 8)
    assert r.counts.fetched_blocks == 6  # the first part arrived and verified


# ------------------------------------------------------------------ deadlines and late parts


def test_a_hung_first_put_ends_the_publish_at_its_deadline_and_holds_the_token(
        cluster: FakeMemcacheCluster, rank: Rank) -> None:
    cfg = SimpleNamespace(**{**vars(CFG), "call_timeout_s": 0.2})
    w = rank(9, cfg=cfg)
    cluster.hang()
    t0 = time.monotonic()
    assert w.publish(KEYS, list(range(8)), token="save-1") is False  # may still read pages
    took = time.monotonic() - t0
    assert took < 1.0, f"publish waited {took:.2f} s past a 0.2 s deadline"
    assert cluster.calls.count("batch_put_from_layers") == 1  # the second part never sent
    c = w.counts
    assert c.late_calls == 1 and c.published_blocks == 0
    consistent(c, 8, 0)
    time.sleep(0.1)
    assert w.take_ended() == []  # the late put still runs: the pages stay held
    cluster.unhang()
    assert ended_tokens(w) == ["save-1"]
    assert w.health.outages == 1


def test_a_hung_get_ends_the_fetch_at_its_deadline_and_quarantines_until_it_ended(
        cluster: FakeMemcacheCluster, rank: Rank) -> None:
    cfg = SimpleNamespace(**{**vars(CFG), "call_timeout_s": 0.2})
    w, r = rank(10, cfg=cfg), rank(None, cfg=cfg)
    assert w.publish(KEYS, list(range(8)))
    cluster.hang()
    t0 = time.monotonic()
    assert r.fetch(KEYS, list(range(8, 16)), token="fetch-1") == (False, False)
    assert time.monotonic() - t0 < 1.0
    assert cluster.calls.count("batch_get_into_layers") == 1
    assert r.counts.late_calls == 1 and r.counts.fetched_blocks == 0
    consistent(r.counts, 0, 8)
    assert r.take_ended() == []
    cluster.unhang()
    assert ended_tokens(r) == ["fetch-1"]


def test_a_late_calls_token_comes_once_every_late_part_ended() -> None:
    got: list[str] = []
    ends = _LateEnds(lambda: got.append("t"))
    ends.part_ended()  # ended before the call saw its IN_FLIGHT
    assert got == []
    ends.settle(1)
    assert got == ["t"]
    ends.part_ended()
    assert got == ["t"]  # never twice
    two = _LateEnds(lambda: got.append("u"))
    two.settle(2)
    two.part_ended()
    assert got == ["t"]
    two.part_ended()
    assert got == ["t", "u"]
    none = _LateEnds(lambda: got.append("v"))
    none.settle(0)
    none.part_ended()
    assert got == ["t", "u"]


def test_overlap_only_where_a_core_is_spare(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shared_tier.os, "sched_getaffinity", lambda _pid: set(range(2)))
    assert shared_tier.default_pipeline_min_bytes() == float("inf")
    monkeypatch.setattr(shared_tier.os, "sched_getaffinity", lambda _pid: set(range(8)))
    assert shared_tier.default_pipeline_min_bytes() == shared_tier.PIPELINE_MIN_BYTES


def test_small_calls_are_one_part(cluster: FakeMemcacheCluster, rank: Rank) -> None:
    w = rank(11)
    four = 4 * (w.object_bytes + shared_tier.TRAILER_BYTES)  # bytes four blocks move
    w.pipeline_min_bytes = four + 1
    assert w.publish(KEYS[:4], [0, 1, 2, 3])
    assert cluster.calls.count("batch_put_from_layers") == 1
    w.pipeline_min_bytes = four
    assert w.publish(KEYS[4:], [4, 5, 6, 7])
    assert cluster.calls.count("batch_put_from_layers") == 3
    assert w.publish(KEYS[4:5], [4])  # one block is one part whatever its size
    assert cluster.calls.count("batch_put_from_layers") == 4
    consistent(w.counts, 9, 0)
    assert w.counts.publish_duplicates == 1
