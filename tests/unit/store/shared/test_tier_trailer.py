"""The shared tier's object format and its check (store/shared/tier.py), over an in-memory
store client that moves bytes through the span pointers like a real one: every object
is its rows in layer order then a 16-byte trailer (key hash, payload hash folded from
per-row xxh3_64), published and fetched whole-call at a time; an object whose bytes are
not its block's is a miss and removed. The Mooncake adapter's size check of gets too."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import xxhash

from ascend_offload.store.shared import tier
from ascend_offload.store.shared.mooncake import SHORT_READ, MooncakeTierClient
from ascend_offload.store.shared.tier import (
    FOLD,
    TRAILER_VERSION,
    RemotePages,
    fold_rows,
    shard_key,
)

PAGES = 12
#: layer name -> (dtype, elements of one block's row); registered out of model order on purpose
LAYERS = {"model.layers.2.attn": (torch.float32, 20), "model.layers.0.attn": (torch.uint8, 48),
          "model.layers.1.attn": (torch.bfloat16, 8)}


class MemoryClient:
    """A ``TierClient`` holding objects as bytes: puts read the spans, gets write them."""

    service = "memory store"
    duplicate = -705

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.removed: list[str] = []
        self.registered: list[tuple[int, int]] = []

    def exists(self, keys: Sequence[str]) -> list[int]:
        return [int(k in self.objects) for k in keys]

    @staticmethod
    def unreachable(code: int) -> bool:
        return False

    def put(self, keys: Sequence[str], ptrs: list[list[int]], lens: list[list[int]],
            on_late: Callable[[], None] | None = None) -> list[int]:
        out = []
        for key, ps, ns in zip(keys, ptrs, lens, strict=True):
            if key in self.objects:
                out.append(self.duplicate)
                continue
            self.objects[key] = b"".join(ctypes.string_at(p, n) for p, n in zip(ps, ns, strict=True))
            out.append(0)
        return out

    def get(self, keys: Sequence[str], ptrs: list[list[int]], lens: list[list[int]],
            on_late: Callable[[], None] | None = None) -> list[int]:
        out = []
        for key, ps, ns in zip(keys, ptrs, lens, strict=True):
            data = self.objects.get(key)
            if data is None or len(data) != sum(ns):
                out.append(-704)
                continue
            at = 0
            for p, n in zip(ps, ns, strict=True):
                ctypes.memmove(p, data[at:at + n], n)
                at += n
            out.append(0)
        return out

    def remove(self, keys: Sequence[str]) -> None:
        for k in keys:
            self.removed.append(k)
            self.objects.pop(k, None)

    @staticmethod
    def safe_failure(code: int) -> bool:
        return True

    def register(self, ptr: int, nbytes: int) -> int:
        self.registered.append((ptr, nbytes))
        return 0

    def unregister(self, ptr: int, nbytes: int) -> None:
        pass

    def close(self) -> None:
        pass


def planes(seed: int | None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed or 0)
    out = {}
    for name, (dtype, n) in LAYERS.items():
        t = torch.zeros((PAGES, n), dtype=dtype)
        if seed is not None:
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8,
                                                    generator=g))
        out[name] = t
    return out


def rows_of(p: dict[str, torch.Tensor], page: int) -> list[bytes]:
    """A page's rows as bytes, in model layer order."""
    return [bytes(p[name][page].view(torch.uint8).numpy()) for name in sorted(p, key=lambda n: n.split(".")[2])]


def reference_trailer(shard: str, rows: list[bytes]) -> bytes:
    """The trailer written out longhand: xxh3_64(key, seed=version), then the fold of every
    row's xxh3_64 seeded with its layer position; little-endian words."""
    h = 0
    for pos, row in enumerate(rows):
        h = (h * int(FOLD) + xxhash.xxh3_64_intdigest(row, seed=pos)) % (1 << 64)
    key = xxhash.xxh3_64_intdigest(shard.encode(), seed=TRAILER_VERSION)
    return key.to_bytes(8, "little") + h.to_bytes(8, "little")


@pytest.mark.parametrize("pages", [
    [7, 2, 9, 0],  # scattered, unsorted: one slice per row
    [0, 1, 2, 3, 4, 5, 6, 7],  # one run of consecutive pages: rows iterated from a plane slice
    [3, 4, 5, 6, 10, 11, 0, 1],  # three runs
])
def test_objects_are_rows_in_layer_order_then_the_trailer(pages: list[int]) -> None:
    client, src = MemoryClient(), planes(1)
    w = RemotePages(client, src, 3, 1.0)
    keys = [f"k{i}" for i in range(len(pages))]
    assert w.publish(keys, pages)
    assert w.counts.published_blocks == len(pages)
    for key, page in zip(keys, pages, strict=True):
        rows = rows_of(src, page)
        obj = client.objects[shard_key(key, 3)]
        assert obj == b"".join(rows) + reference_trailer(shard_key(key, 3), rows)
    # fetched into pages laid out the other way (scattered <-> runs), every object verifies
    dst = planes(None)
    r = RemotePages(client, dst, 3, 1.0)
    back = list(range(len(pages))) if pages != sorted(pages) else [p * 5 % PAGES for p in range(len(pages))]
    assert r.fetch(keys, back) == (True, True)
    assert r.counts.fetch_corrupt_blocks == 0
    assert all(rows_of(dst, b) == rows_of(src, p) for p, b in zip(pages, back, strict=True))
    w.close()
    r.close()


def test_fetch_verifies_each_object_and_removes_only_the_bad_ones() -> None:
    client, src, dst = MemoryClient(), planes(2), planes(None)
    w, r = RemotePages(client, src, 0, 1.0), RemotePages(client, dst, 0, 1.0)
    keys = ["k0", "k1", "k2", "k3", "k4"]
    w.publish(keys, [0, 1, 2, 3, 4])
    assert r.fetch(keys, [11, 5, 8, 6, 10]) == (True, True)
    for page_w, page_r in zip([0, 1, 2, 3, 4], [11, 5, 8, 6, 10], strict=True):
        assert rows_of(dst, page_r) == rows_of(src, page_w)
    # one byte of a middle layer's row of k1; k3 holds k2's object (bytes and trailer)
    data = bytearray(client.objects["k1@r0"])
    data[len(rows_of(src, 1)[0]) + 3] ^= 1
    client.objects["k1@r0"] = bytes(data)
    client.objects["k3@r0"] = client.objects["k2@r0"]
    assert r.fetch(keys, [11, 5, 8, 6, 10]) == (False, True)
    assert sorted(client.removed) == ["k1@r0", "k3@r0"]
    assert r.counts.fetch_corrupt_blocks == 2 and r.counts.fetched_blocks == 5 + 3
    w.close()
    r.close()


def test_rows_that_trade_layer_positions_are_a_miss() -> None:
    """Two layers with rows of the same size swap rows in the object: same bytes, same
    multiset of rows, another block (the seeds make the position part of the hash)."""
    client = MemoryClient()
    g = torch.Generator().manual_seed(5)
    src = {f"model.layers.{i}.attn": torch.randint(0, 256, (4, 32), dtype=torch.uint8, generator=g)
           for i in range(3)}
    dst = {name: torch.zeros_like(t) for name, t in src.items()}
    w, r = RemotePages(client, src, 0, 1.0), RemotePages(client, dst, 0, 1.0)
    w.publish(["x"], [1])
    obj = client.objects["x@r0"]
    client.objects["x@r0"] = obj[32:64] + obj[:32] + obj[64:]
    assert r.fetch(["x"], [2]) == (False, True)
    assert r.counts.fetch_corrupt_blocks == 1
    w.close()
    r.close()


def test_fold_rows_matches_the_longhand_fold_and_wraps() -> None:
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 2**63, size=6, dtype=np.uint64) * np.uint64(2) + np.uint64(1) for _ in range(5)]
    got = fold_rows(rows)
    for i in range(6):
        h = 0
        for d in rows:
            h = (h * int(FOLD) + int(d[i])) % (1 << 64)
        assert int(got[i]) == h
    assert fold_rows([]).shape == (0,)


def test_one_changed_row_digest_always_changes_the_fold() -> None:
    rng = np.random.default_rng(1)
    rows = [rng.integers(0, 2**63, size=64, dtype=np.uint64) for _ in range(4)]
    base = fold_rows(rows)
    for layer in range(4):
        changed = [d.copy() for d in rows]
        changed[layer] += np.arange(1, 65, dtype=np.uint64)  # every object's row differs
        assert (fold_rows(changed) != base).all()


def test_an_empty_publish_or_fetch_calls_nothing() -> None:
    client = MemoryClient()
    w = RemotePages(client, planes(3), 0, 1.0)
    before = w._trailers.clone()
    assert w.publish([], [])
    assert w.fetch([], []) == (True, True)
    assert torch.equal(w._trailers, before) and client.objects == {}
    w.close()


class RawMooncake:
    """``batch_get_into_multi_buffers`` answering given byte counts."""

    def __init__(self, answers: list[int]) -> None:
        self.answers = answers

    def batch_get_into_multi_buffers(self, keys: list[str], ptrs: list[list[int]],
                                     lens: list[list[int]]) -> list[int]:
        return list(self.answers)


@pytest.mark.parametrize("shared", [True, False])
def test_mooncake_get_codes_whole_objects_only(shared: bool) -> None:
    """0 for an object that arrived whole, its error code, or SHORT_READ for another byte
    count; the length lists may be one shared list (RemotePages) or one per object."""
    lens_row = [100, 28, 16]
    lens = [lens_row] * 4 if shared else [list(lens_row) for _ in range(4)]
    c = MooncakeTierClient(RawMooncake([144, 144, 144, 144]), "127.0.0.1:1")
    assert c.get(["a", "b", "c", "d"], [[0, 0, 0]] * 4, lens) == [0, 0, 0, 0]
    c.client = RawMooncake([144, -704, 143, 144])
    assert c.get(["a", "b", "c", "d"], [[0, 0, 0]] * 4, lens) == [0, -704, SHORT_READ, 0]
    c.client = RawMooncake([])
    assert c.get([], [], []) == []


def test_mooncake_get_sizes_per_object_when_lengths_differ() -> None:
    c = MooncakeTierClient(RawMooncake([10, 20]), "127.0.0.1:1")
    assert c.get(["a", "b"], [[0], [0, 0]], [[10], [15, 5]]) == [0, 0]
    c.client = RawMooncake([10, 10])
    assert c.get(["a", "b"], [[0], [0, 0]], [[10], [15, 5]]) == [0, SHORT_READ]


def test_mooncake_puts_reuse_one_replicate_config() -> None:
    pytest.importorskip("mooncake.store", reason="needs mooncake-transfer-engine-non-cuda")
    seen: list[object] = []
    raw = SimpleNamespace(batch_put_from_multi_buffers=lambda k, p, n, rep: seen.append(rep) or [0] * len(k))
    c = MooncakeTierClient(raw, "127.0.0.1:1", replica_num=2)
    assert c.put(["a"], [[0]], [[1]]) == [0]
    assert c.put(["b"], [[0]], [[1]]) == [0]
    assert seen[0] is seen[1] and seen[0].replica_num == 2


def test_trailer_key_is_the_versioned_xxh3_of_the_shard() -> None:
    assert tier.trailer_key("b@r1") == xxhash.xxh3_64_intdigest(b"b@r1", seed=TRAILER_VERSION)
