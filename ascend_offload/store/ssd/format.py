"""The on-disk format of one SSD-tier slot: a header, then one page of one rank.

A slot is ``slot_bytes(page_bytes)`` bytes (a multiple of 4096 so that O_DIRECT
reads and writes of whole slots are aligned):

``[header (64 bytes) | payload (page_bytes) | zero padding]``

The header names what the payload is and proves it is whole:

=========  =====  ============================================================
field      bytes  why
=========  =====  ============================================================
magic      8      a slot never written (zeros) or another file is not a slot
version    2      a layout change (this is version 2) is a miss, never a misread
rank       2      a file moved to another rank's name is a miss
slot       4      a write that landed at the wrong offset is a miss
key hash   8      the index's key -> slot entry is stale (slot reused) -> miss
length     8      the payload's size (the page size of the writer)
checksum   8      xxh3_64 of the payload: a torn or flipped payload is a miss
(zeros)    24     reserved
=========  =====  ============================================================

Why no checksum of the header itself: the reader compares every header field with
the value it expects (magic, version, rank, slot, key hash, length), so a flipped
or torn field is already a miss, and a damaged checksum field fails the payload
check. A header checksum would only cost a second hash per slot.

Why xxh3_64 (``xxhash``): measured on the 2-vCPU VM this project benchmarks on, it
hashes a staging buffer at 4-19 GB/s (load dependent), crc32c through
``google-crc32c``'s native library at 2-4 GB/s in the same runs; it accepts a
memoryview without copying and releases the GIL, and 64 bits leave an undetected
random corruption at 2^-64 (crc32c: 2^-32). Its weakness, no guaranteed detection
of short burst errors (a CRC's), does not matter for whole-sector tears and bit
flips, which it catches with the 2^-64 odds.

Headers of many slots are checked at once (:func:`verify_rows`): a numpy
structured view over the staging rows, compared against arrays of expected
values; only the payload hash runs per slot (in C). A slot whose header or
checksum does not match is a miss: the caller recomputes that block; it is never
served.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np
import xxhash

MAGIC = b"AOSSDv1\x00"
VERSION = 2
HEADER_BYTES = 64
ALIGN = 4096  # O_DIRECT needs offsets, lengths and buffers aligned to the logical block
#: the header as numpy reads and writes it (little-endian, packed, 64 bytes)
HEAD_DTYPE = np.dtype({
    "names": ["magic", "version", "rank", "slot", "key", "length", "checksum"],
    "formats": ["S8", "<u2", "<u2", "<u4", "<u8", "<u8", "<u8"],
    "offsets": [0, 8, 10, 12, 16, 24, 32],
    "itemsize": HEADER_BYTES,
})
_USED = 40  # header bytes the fields above cover; the rest are written as zeros

#: why a slot was refused (the reason strings :func:`verify` returns), in checking order
REASONS = ("magic", "version", "rank", "slot", "key", "length", "checksum")

_hash = xxhash.xxh3_64_intdigest


def checksum(data: bytes | bytearray | memoryview | np.ndarray) -> int:
    """xxh3_64 of ``data`` (C, no copy of a contiguous buffer, GIL released)."""
    return _hash(data)  # type: ignore[arg-type]  # numpy declares ndarray.__buffer__ for Python >= 3.12 only


def checksums_of_parts(payloads: Iterable[Sequence[memoryview]]) -> np.ndarray:
    """:func:`checksum` of each payload given as its parts in order (a buffered promote
    stages a payload one region per layer when its layers differ in width): the digest of
    the parts joined, without joining them (xxh3_64's streaming form gives the one-shot
    digest)."""
    h = xxhash.xxh3_64()
    out = []
    for parts in payloads:
        if len(parts) == 1:  # a payload in one piece: the one-shot call
            out.append(_hash(parts[0]))
            continue
        h.reset()
        for part in parts:
            h.update(part)
        out.append(h.intdigest())
    return np.array(out, dtype=np.uint64)


def checksum_implementation() -> str:
    """The payload checksum, as benchmarks and logs name it."""
    return "xxh3_64"


def key_hash(key: str) -> int:
    """A 64-bit digest of a store key (stable across processes, restarts and machines)."""
    return _hash(key.encode())


def key_hashes(keys: Sequence[str]) -> np.ndarray:
    """:func:`key_hash` of every key, as a uint64 array (one call per chunk of slots)."""
    return np.fromiter((_hash(k.encode()) for k in keys), dtype=np.uint64, count=len(keys))


def slot_bytes(page_bytes: int) -> int:
    """Bytes of one slot holding one page: header + payload, rounded up to 4096."""
    if page_bytes < 1:
        raise ValueError(f"page_bytes must be >= 1, got {page_bytes}")
    return -(-(HEADER_BYTES + page_bytes) // ALIGN) * ALIGN


def _heads(rows: np.ndarray) -> np.ndarray:
    """The headers of ``rows`` (an (n, slot_bytes) uint8 array) as a structured view."""
    if rows.ndim != 2 or rows.dtype != np.uint8 or rows.shape[1] < HEADER_BYTES:
        raise ValueError(f"slot rows must be (n, >= {HEADER_BYTES}) uint8, got {rows.shape} {rows.dtype}")
    return rows[:, :HEADER_BYTES].view(HEAD_DTYPE)[:, 0]


def _payload_sums(rows: np.ndarray, n: int, payload_len: int) -> np.ndarray:
    end = HEADER_BYTES + payload_len
    # numpy declares ndarray.__buffer__ for Python >= 3.12 only
    return np.fromiter((_hash(rows[i, HEADER_BYTES:end]) for i in range(n)),  # type: ignore[arg-type]
                       dtype=np.uint64, count=n)


def pack_rows(rows: np.ndarray, *, rank: int, slots: Sequence[int] | np.ndarray,
              key_hashes_: np.ndarray, payload_len: int) -> None:
    """Write the headers of ``rows`` (payloads already in place), checksums included."""
    n = len(slots)
    if HEADER_BYTES + payload_len > rows.shape[1] or len(rows) < n or len(key_hashes_) != n:
        raise ValueError(f"{n} slots of {payload_len}-byte payloads do not fit rows {rows.shape}")
    rows[:n, _USED:HEADER_BYTES] = 0
    heads = _heads(rows[:n])
    heads["magic"] = MAGIC
    heads["version"] = VERSION
    heads["rank"] = rank
    heads["slot"] = slots
    heads["key"] = key_hashes_
    heads["length"] = payload_len
    heads["checksum"] = _payload_sums(rows, n, payload_len)


def pack_header(buf: memoryview | bytearray, *, rank: int, slot: int, key_hash_: int, payload_len: int) -> None:
    """Write the header of one slot (``buf``, payload already in place)."""
    rows = np.frombuffer(buf, dtype=np.uint8).reshape(1, -1)
    pack_rows(rows, rank=rank, slots=[slot], key_hashes_=np.array([key_hash_], dtype=np.uint64),
              payload_len=payload_len)


def verify_rows(rows: np.ndarray, *, rank: int, slots: Sequence[int] | np.ndarray, key_hashes_: np.ndarray,
                payload_len: int) -> tuple[int, str | None]:
    """(how many leading slots of ``rows`` verify, the reason the next one is a miss, or
    None when all ``len(slots)`` do). ``rows[i]`` is the slot read from ``slots[i]``, which
    must hold the payload of ``key_hashes_[i]`` for this rank. Same answers as
    :func:`verify` slot by slot; the headers are compared in bulk."""
    if len(rows) < len(slots):
        raise ValueError(f"{len(rows)} rows for {len(slots)} slots")
    return verify_heads(rows[:len(slots)], rank=rank, slots=slots, key_hashes_=key_hashes_,
                        payload_len=payload_len, room=rows.shape[1] - HEADER_BYTES,
                        sums=lambda k: _payload_sums(rows, k, payload_len))


def verify_heads(heads_rows: np.ndarray, *, rank: int, slots: Sequence[int] | np.ndarray,
                 key_hashes_: np.ndarray, payload_len: int, room: int,
                 sums: Callable[[int], np.ndarray]) -> tuple[int, str | None]:
    """:func:`verify_rows` with the payloads elsewhere: ``heads_rows[i]`` starts with the
    header of ``slots[i]`` (at least :data:`HEADER_BYTES` columns), ``room`` is the payload
    room of a slot, ``sums(k)`` the checksums of the first ``k`` payloads wherever they
    landed (the buffered promote stages headers and payloads apart)."""
    n = len(slots)
    if len(heads_rows) < n or len(key_hashes_) != n:
        raise ValueError(f"{len(heads_rows)} rows, {len(key_hashes_)} key hashes for {n} slots")
    if n == 0:
        return 0, None
    heads = _heads(heads_rows[:n])
    checks = (
        ("magic", heads["magic"] == MAGIC),
        ("version", heads["version"] == VERSION),
        ("rank", heads["rank"] == rank),
        ("slot", heads["slot"] == np.asarray(slots, dtype=np.int64)),
        ("key", heads["key"] == key_hashes_),
        ("length", (heads["length"] == payload_len) & (payload_len <= room)),
    )
    ok = np.logical_and.reduce([c for _, c in checks])
    first_bad = int(np.argmin(ok)) if not ok.all() else n
    # payload hashes only up to the first bad header (the rest are not served anyway)
    sums_ok = sums(first_bad) == heads["checksum"][:first_bad]
    if not sums_ok.all():
        return int(np.argmin(sums_ok)), "checksum"
    if first_bad == n:
        return n, None
    return first_bad, next(name for name, c in checks if not c[first_bad])


def verify(buf: memoryview | bytes | bytearray, *, rank: int, slot: int, key_hash_: int,
           payload_len: int) -> str | None:
    """None when ``buf`` (a whole slot) holds the payload of ``key_hash_`` intact for
    this rank and slot; otherwise the reason it must be a miss (one of :data:`REASONS`)."""
    rows = np.frombuffer(buf, dtype=np.uint8).reshape(1, -1)
    return verify_rows(rows, rank=rank, slots=[slot], key_hashes_=np.array([key_hash_], dtype=np.uint64),
                       payload_len=payload_len)[1]
