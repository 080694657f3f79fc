"""The on-disk format of one SSD-tier slot: a header, then one page of one rank.

A slot is ``slot_bytes(page_bytes)`` bytes (a multiple of 4096 so that O_DIRECT
reads and writes of whole slots are aligned):

``[header (64 bytes) | payload (page_bytes) | zero padding]``

The header names what the payload is and proves it is whole:

=========  =====  ============================================================
field      bytes  why
=========  =====  ============================================================
magic      8      a slot never written (zeros) or another file is not a slot
version    2      a future layout change is a miss, never a misread
rank       2      a file moved to another rank's name is a miss
slot       4      a write that landed at the wrong offset is a miss
key hash   8      the index's key -> slot entry is stale (slot reused) -> miss
length     8      the payload's size (the page size of the writer)
crc        4      crc32c of the payload: a torn or flipped payload is a miss
hdr crc    4      crc32c of the 36 header bytes above: a torn header is a miss
=========  =====  ============================================================

Why crc32c (``google-crc32c``): the hardware instruction (SSE4.2) runs at ~10 GB/s on
this VM (zlib's crc32: ~3 GB/s) and releases the GIL, so verifying a slot costs a
fraction of reading it. A slot whose header or checksum does not match is a miss:
the caller recomputes that block; it is never served.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import struct
from collections.abc import Callable
from pathlib import Path

import google_crc32c
import numpy as np

MAGIC = b"AOSSDv1\x00"
VERSION = 1
HEADER_BYTES = 64
ALIGN = 4096  # O_DIRECT needs offsets, lengths and buffers aligned to the logical block
_HEAD = struct.Struct("<8sHHIQQI")  # magic, version, rank, slot, key hash, length, crc
_HEAD_CRC = struct.Struct("<I")

#: why a slot was refused (the reason strings :func:`verify` returns)
REASONS = ("magic", "version", "header", "rank", "slot", "key", "length", "checksum")


def _native_extend() -> Callable[[int, int, int], int] | None:
    """``crc32c_extend(crc, address, length)`` of the library the wheel ships, via ctypes
    (which releases the GIL during the call). Why not ``google_crc32c.value``: its C
    extension accepts ``bytes`` only, so a slot in a staging buffer would be copied first."""
    here = Path(google_crc32c.__file__).resolve().parent
    candidates = sorted((here.parent / "google_crc32c.libs").glob("libcrc32c*.so*"))
    found = ctypes.util.find_library("crc32c")
    for lib in [*map(str, candidates), *([found] if found else [])]:
        try:
            fn = ctypes.CDLL(lib).crc32c_extend
        except (OSError, AttributeError):
            continue
        fn.argtypes = (ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t)
        fn.restype = ctypes.c_uint32
        return fn
    return None


_EXTEND = _native_extend()


def crc32c(data: bytes | bytearray | memoryview) -> int:
    """crc32c of ``data`` (the C implementation, GIL released, no copy of a buffer)."""
    if _EXTEND is None or isinstance(data, bytes):
        return int(google_crc32c.value(bytes(data)))
    arr = np.frombuffer(data, dtype=np.uint8)
    return int(_EXTEND(0, arr.ctypes.data, arr.size)) if arr.size else 0


def checksum_implementation() -> str:
    """``"native"`` (the wheel's C library through ctypes), ``"c"`` (its extension, copying
    buffers) or ``"python"`` (the slow fallback)."""
    return "native" if _EXTEND is not None else str(google_crc32c.implementation)


def key_hash(key: str) -> int:
    """A 64-bit digest of a store key (stable across processes and restarts)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def slot_bytes(page_bytes: int) -> int:
    """Bytes of one slot holding one page: header + payload, rounded up to 4096."""
    if page_bytes < 1:
        raise ValueError(f"page_bytes must be >= 1, got {page_bytes}")
    return -(-(HEADER_BYTES + page_bytes) // ALIGN) * ALIGN


def pack_header(buf: memoryview, *, rank: int, slot: int, key_hash_: int, payload_len: int,
                payload_crc: int) -> None:
    """Write the header of a slot into ``buf[:HEADER_BYTES]``."""
    _HEAD.pack_into(buf, 0, MAGIC, VERSION, rank, slot, key_hash_, payload_len, payload_crc)
    _HEAD_CRC.pack_into(buf, _HEAD.size, crc32c(buf[:_HEAD.size]))
    buf[_HEAD.size + _HEAD_CRC.size:HEADER_BYTES] = bytes(HEADER_BYTES - _HEAD.size - _HEAD_CRC.size)


def verify(buf: memoryview, *, rank: int, slot: int, key_hash_: int, payload_len: int) -> str | None:
    """None when ``buf`` (a whole slot) holds the payload of ``key_hash_`` intact for
    this rank and slot; otherwise the reason it must be a miss (one of :data:`REASONS`)."""
    magic, version, s_rank, s_slot, s_key, s_len, s_crc = _HEAD.unpack_from(buf, 0)
    if magic != MAGIC:
        return "magic"
    if version != VERSION:
        return "version"
    if _HEAD_CRC.unpack_from(buf, _HEAD.size)[0] != crc32c(buf[:_HEAD.size]):
        return "header"
    if s_rank != rank:
        return "rank"
    if s_slot != slot:
        return "slot"
    if s_key != key_hash_:
        return "key"
    if s_len != payload_len or HEADER_BYTES + payload_len > len(buf):
        return "length"
    if crc32c(buf[HEADER_BYTES:HEADER_BYTES + payload_len]) != s_crc:
        return "checksum"
    return None
