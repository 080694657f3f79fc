"""SSD slot format (store/ssd_format.py): a slot verifies only for its own key, rank,
slot and intact bytes; every other case names why it is a miss."""

from __future__ import annotations

import os

import google_crc32c
import pytest

from ascend_offload.store import ssd_format as fmt

PAYLOAD = 5000


def _slot(key: str = "k", rank: int = 0, slot: int = 3) -> bytearray:
    buf = bytearray(fmt.slot_bytes(PAYLOAD))
    buf[fmt.HEADER_BYTES:fmt.HEADER_BYTES + PAYLOAD] = os.urandom(PAYLOAD)
    view = memoryview(buf)
    fmt.pack_header(view, rank=rank, slot=slot, key_hash_=fmt.key_hash(key), payload_len=PAYLOAD,
                    payload_crc=fmt.crc32c(view[fmt.HEADER_BYTES:fmt.HEADER_BYTES + PAYLOAD]))
    return buf


def _verify(buf: bytearray, key: str = "k", rank: int = 0, slot: int = 3) -> str | None:
    return fmt.verify(memoryview(buf), rank=rank, slot=slot, key_hash_=fmt.key_hash(key), payload_len=PAYLOAD)


def test_slot_bytes_are_aligned_and_hold_header_and_page() -> None:
    for page in (1, 4032, 4033, 65536, 1 << 20):
        sb = fmt.slot_bytes(page)
        assert sb % fmt.ALIGN == 0 and sb >= page + fmt.HEADER_BYTES and sb - fmt.ALIGN < page + fmt.HEADER_BYTES
    with pytest.raises(ValueError):
        fmt.slot_bytes(0)


def test_crc32c_matches_the_reference_on_buffers() -> None:
    data = os.urandom(70000)
    ref = google_crc32c.value(data)
    assert fmt.crc32c(data) == ref
    assert fmt.crc32c(memoryview(bytearray(data))) == ref
    assert fmt.crc32c(memoryview(bytearray(data))[100:200]) == google_crc32c.value(data[100:200])


def test_intact_slot_verifies() -> None:
    assert _verify(_slot()) is None


@pytest.mark.parametrize(("mutate", "reason"), [
    (lambda b: b.__setitem__(slice(0, 8), b"\0" * 8), "magic"),
    (lambda b: b.__setitem__(8, b[8] ^ 1), "version"),
    (lambda b: b.__setitem__(20, b[20] ^ 1), "header"),  # a torn key-hash byte
    (lambda b: b.__setitem__(fmt.HEADER_BYTES + 77, b[fmt.HEADER_BYTES + 77] ^ 0x10), "checksum"),
    (lambda b: b.__setitem__(slice(fmt.HEADER_BYTES + 4096, fmt.HEADER_BYTES + PAYLOAD), bytes(PAYLOAD - 4096)),
     "checksum"),  # torn write: the tail of the payload never landed
])
def test_damaged_slot_is_refused_with_its_reason(mutate, reason: str) -> None:
    buf = _slot()
    mutate(buf)
    assert _verify(buf) == reason


def test_slot_of_another_key_rank_or_offset_is_refused() -> None:
    buf = _slot()
    assert _verify(buf, key="other") == "key"
    assert _verify(buf, rank=1) == "rank"
    assert _verify(buf, slot=4) == "slot"
    assert _verify(bytearray(fmt.slot_bytes(PAYLOAD))) == "magic"  # never written (zeros)
    short = fmt.verify(memoryview(buf), rank=0, slot=3, key_hash_=fmt.key_hash("k"), payload_len=PAYLOAD - 1)
    assert short == "length"
