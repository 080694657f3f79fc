"""SSD slot format (store/ssd/format.py): a slot verifies only for its own key, rank,
slot and intact bytes; every other case names why it is a miss; the bulk check of a
chunk of slots answers exactly what the slot-by-slot check answers."""

from __future__ import annotations

import os

import numpy as np
import pytest
import xxhash

from ascend_offload.store.ssd import format as fmt

PAYLOAD = 5000
SB = fmt.slot_bytes(PAYLOAD)


def _slot(key: str = "k", rank: int = 0, slot: int = 3) -> bytearray:
    buf = bytearray(SB)
    buf[fmt.HEADER_BYTES:fmt.HEADER_BYTES + PAYLOAD] = os.urandom(PAYLOAD)
    fmt.pack_header(memoryview(buf), rank=rank, slot=slot, key_hash_=fmt.key_hash(key), payload_len=PAYLOAD)
    return buf


def _verify(buf: bytearray, key: str = "k", rank: int = 0, slot: int = 3) -> str | None:
    return fmt.verify(memoryview(buf), rank=rank, slot=slot, key_hash_=fmt.key_hash(key), payload_len=PAYLOAD)


def _flip(at: int):
    return lambda b: b.__setitem__(at, b[at] ^ 0x10)


def test_slot_bytes_are_aligned_and_hold_header_and_page() -> None:
    for page in (1, 4032, 4033, 65536, 1 << 20):
        sb = fmt.slot_bytes(page)
        assert sb % fmt.ALIGN == 0 and sb >= page + fmt.HEADER_BYTES and sb - fmt.ALIGN < page + fmt.HEADER_BYTES
    with pytest.raises(ValueError):
        fmt.slot_bytes(0)


def test_header_layout_round_trips_and_checksum_is_xxh3_of_the_payload() -> None:
    buf = _slot(key="block-7", rank=5, slot=123456)
    payload = bytes(buf[fmt.HEADER_BYTES:fmt.HEADER_BYTES + PAYLOAD])
    assert buf[:8] == fmt.MAGIC
    assert int.from_bytes(buf[8:10], "little") == fmt.VERSION == 2
    assert int.from_bytes(buf[10:12], "little") == 5
    assert int.from_bytes(buf[12:16], "little") == 123456
    assert int.from_bytes(buf[16:24], "little") == fmt.key_hash("block-7") == xxhash.xxh3_64_intdigest(b"block-7")
    assert int.from_bytes(buf[24:32], "little") == PAYLOAD
    assert int.from_bytes(buf[32:40], "little") == xxhash.xxh3_64_intdigest(payload) == fmt.checksum(payload)
    assert bytes(buf[40:fmt.HEADER_BYTES]) == bytes(fmt.HEADER_BYTES - 40)
    assert _verify(buf, key="block-7", rank=5, slot=123456) is None
    assert list(fmt.key_hashes(["a", "block-7"])) == [fmt.key_hash("a"), fmt.key_hash("block-7")]


def test_checksum_reads_buffers_without_a_copy_and_matches_bytes() -> None:
    data = os.urandom(70000)
    ref = xxhash.xxh3_64_intdigest(data)
    assert fmt.checksum(memoryview(bytearray(data))) == ref
    assert fmt.checksum(np.frombuffer(data, dtype=np.uint8)) == ref
    assert fmt.checksum(memoryview(bytearray(data))[100:200]) == xxhash.xxh3_64_intdigest(data[100:200])


def test_intact_slot_verifies() -> None:
    assert _verify(_slot()) is None


CORRUPTIONS = [
    (lambda b: b.__setitem__(slice(0, 8), b"\0" * 8), "magic"),
    (_flip(8), "version"),
    (_flip(10), "rank"),
    (_flip(13), "slot"),
    (_flip(20), "key"),  # a torn or flipped key-hash byte
    (_flip(25), "length"),
    (_flip(35), "checksum"),  # a flipped checksum field fails the payload check
    (_flip(fmt.HEADER_BYTES + 77), "checksum"),
    (_flip(fmt.HEADER_BYTES + PAYLOAD - 1), "checksum"),
    (lambda b: b.__setitem__(slice(fmt.HEADER_BYTES + 4096, fmt.HEADER_BYTES + PAYLOAD), bytes(PAYLOAD - 4096)),
     "checksum"),  # torn write: the tail of the payload never landed
    (lambda b: b.__setitem__(slice(0, SB), bytes(SB)), "magic"),  # torn write: nothing landed
]


@pytest.mark.parametrize(("mutate", "reason"), CORRUPTIONS)
def test_damaged_slot_is_refused_with_its_reason(mutate, reason: str) -> None:
    buf = _slot()
    mutate(buf)
    assert _verify(buf) == reason


def test_slot_of_another_key_rank_or_offset_is_refused() -> None:
    buf = _slot()
    assert _verify(buf, key="other") == "key"  # stale: the slot was reused by another block
    assert _verify(buf, rank=1) == "rank"
    assert _verify(buf, slot=4) == "slot"  # misplaced
    assert _verify(bytearray(SB)) == "magic"  # never written (zeros)
    buf[8:10] = (1).to_bytes(2, "little")  # a slot of the previous layout
    assert _verify(buf) == "version"
    buf = _slot()
    short = fmt.verify(memoryview(buf), rank=0, slot=3, key_hash_=fmt.key_hash("k"), payload_len=PAYLOAD - 1)
    assert short == "length"


def _chunk(n: int) -> tuple[np.ndarray, list[int], list[str]]:
    slots, keys = [10 + 3 * i for i in range(n)], [f"key-{i}" for i in range(n)]
    rows = np.frombuffer(bytearray(n * SB), dtype=np.uint8).reshape(n, SB)
    rows[:, fmt.HEADER_BYTES:fmt.HEADER_BYTES + PAYLOAD] = np.random.default_rng(0).integers(
        0, 256, (n, PAYLOAD), dtype=np.uint8)
    fmt.pack_rows(rows, rank=2, slots=slots, key_hashes_=fmt.key_hashes(keys), payload_len=PAYLOAD)
    return rows, slots, keys


def _per_slot(rows: np.ndarray, slots: list[int], keys: list[str]) -> tuple[int, str | None]:
    for i, (s, k) in enumerate(zip(slots, keys, strict=True)):
        why = fmt.verify(memoryview(rows[i]), rank=2, slot=s, key_hash_=fmt.key_hash(k), payload_len=PAYLOAD)
        if why is not None:
            return i, why
    return len(slots), None


def test_bulk_verify_of_intact_chunk_and_pack_rows_equals_pack_header() -> None:
    rows, slots, keys = _chunk(6)
    assert fmt.verify_rows(rows, rank=2, slots=slots, key_hashes_=fmt.key_hashes(keys),
                           payload_len=PAYLOAD) == (6, None) == _per_slot(rows, slots, keys)
    one = bytearray(rows[4].tobytes())
    one[:fmt.HEADER_BYTES] = bytes(fmt.HEADER_BYTES)
    fmt.pack_header(memoryview(one), rank=2, slot=slots[4], key_hash_=fmt.key_hash(keys[4]), payload_len=PAYLOAD)
    assert bytes(one) == rows[4].tobytes()


@pytest.mark.parametrize("at", [0, 3, 5])
@pytest.mark.parametrize(("mutate", "reason"), CORRUPTIONS)
def test_bulk_verify_equals_per_slot_verify(mutate, reason: str, at: int) -> None:
    rows, slots, keys = _chunk(6)
    row = bytearray(rows[at].tobytes())
    mutate(row)
    rows[at] = np.frombuffer(row, dtype=np.uint8)
    got = fmt.verify_rows(rows, rank=2, slots=slots, key_hashes_=fmt.key_hashes(keys), payload_len=PAYLOAD)
    assert got == _per_slot(rows, slots, keys) == (at, reason)


def test_bulk_verify_stops_at_the_first_miss_of_either_kind() -> None:
    rows, slots, keys = _chunk(6)
    rows[4, :8] = 0  # a header miss after ...
    rows[2, fmt.HEADER_BYTES + 9] ^= 1  # ... a payload miss: the earlier one is reported
    hashes = fmt.key_hashes(keys)
    assert fmt.verify_rows(rows, rank=2, slots=slots, key_hashes_=hashes, payload_len=PAYLOAD) == (2, "checksum")
    rows, slots, keys = _chunk(6)
    assert fmt.verify_rows(rows, rank=2, slots=[*slots[:3], 99, 98, 97], key_hashes_=hashes,
                           payload_len=PAYLOAD) == (3, "slot")
    assert fmt.verify_rows(rows, rank=2, slots=[], key_hashes_=hashes[:0], payload_len=PAYLOAD) == (0, None)
    with pytest.raises(ValueError):
        fmt.verify_rows(rows, rank=2, slots=slots, key_hashes_=hashes[:2], payload_len=PAYLOAD)


def test_checksums_of_parts_equal_the_checksum_of_the_joined_payload() -> None:
    rng = np.random.default_rng(7)
    payloads = [rng.integers(0, 256, size, dtype=np.uint8) for size in (1, 255, 256, 4096, 70001)]
    cuts = [[], [17], [0, 128], [1000, 1024, 3000], [64, 65536]]
    parts = [[memoryview(p[a:b]) for a, b in zip([0, *c], [*c, len(p)], strict=True)] for p, c in zip(payloads, cuts, strict=True)]
    assert list(fmt.checksums_of_parts(parts)) == [fmt.checksum(p) for p in payloads]
