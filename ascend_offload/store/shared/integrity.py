"""Payload hashes of the shared tier's objects (store/shared/tier.py), straight from the
rank's page planes.

An object is one page's row of every plane, in plane (model layer) order. Its payload
hash is not one xxh3_64 streamed over the rows but the rows' own xxh3_64 digests
(each seeded with its plane's position) folded in plane order (:func:`fold_rows`).
Why: a streamed hash costs one Python call per row into the hasher's update, whose
streaming path is also slower than the one-shot function (measured on the 2-vCPU VM,
16 MiB in 16 KiB rows: 1.45 ms streamed, 0.6 ms one-shot, memcpy of the same bytes
0.9 ms). One-shot digests of many rows are a ``map`` over a plane's rows, so a call
hashes plane after plane, runs of consecutive pages as an iterator over a slice of the
plane (no Python per row; long rows go object after object instead,
``OBJECT_MAJOR_ROW_BYTES``), and the fold of all a call's objects is one weighted sum
in numpy. The digests are the same whatever the order.

What it detects, as one xxh3_64 over the object would: any changed row changes its
object's hash (every fold step is a bijection of the running value); several changed
rows, or rows moved to another layer position (the seed), leave it unchanged with
2^-64 odds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import chain, repeat

import numpy as np
import xxhash

#: odd 64-bit multiplier of :func:`fold_rows` (every step is a bijection of the running hash)
FOLD = np.uint64(0x9E3779B97F4A7C15)
#: pages per run (on average) from which a call hashes runs of consecutive pages as
#: slices of a plane; scattered pages cost one slice per row instead
RUN_MIN = 4
#: rows of at least this many bytes (on average) are hashed object by object instead of
#: plane by plane: measured on the 2-vCPU VM, 16 MiB of 64 KiB rows took 1.12 ms plane
#: by plane and 1.03 ms object by object (cold), while 16 KiB rows took 0.96-1.25 ms plane
#: by plane and 1.35-1.78 ms object by object
OBJECT_MAJOR_ROW_BYTES = 32 << 10
_xxh3 = xxhash.xxh3_64_intdigest


def fold_rows(digests: Sequence[np.ndarray]) -> np.ndarray:
    """Payload hashes of a call's objects from their rows' digests (``digests[l][i]``:
    the xxh3_64 of object ``i``'s row of plane position ``l``, seeded with ``l``):
    ``h = h * FOLD + d`` mod 2^64 from 0, in plane order."""
    h = np.zeros(len(digests[0]) if digests else 0, dtype=np.uint64)
    for d in digests:
        h *= FOLD  # wraps mod 2^64
        h += d
    return h


class PageHasher:
    """Payload hashes of pages of a rank's planes (``[num_pages, row bytes]`` uint8 arrays,
    views of the registered page planes: nothing is copied)."""

    def __init__(self, planes: Sequence[np.ndarray]) -> None:
        for p in planes:
            if p.dtype != np.uint8 or p.ndim != 2 or not p.flags.c_contiguous:
                raise ValueError("planes must be contiguous 2-D uint8 arrays")
        self._planes = list(planes)
        self._flat = [memoryview(p.reshape(-1)) for p in planes]  # type: ignore[arg-type]  # numpy declares ndarray.__buffer__ for Python >= 3.12 only
        self._rows = [p.shape[1] for p in planes]
        self._seeded = list(enumerate(self._planes))
        self._object_major = bool(planes) and sum(self._rows) >= OBJECT_MAJOR_ROW_BYTES * len(planes)
        # fold_rows as one weighted sum: h = sum_l d_l * FOLD^(L-1-l) mod 2^64 (two numpy
        # operations for all of a call's objects instead of two per plane)
        m, f = 1 << 64, int(FOLD)
        self._weights = np.array([pow(f, len(planes) - 1 - i, m) for i in range(len(planes))],
                                 dtype=np.uint64)[:, None]

    def payload_hashes(self, pages: np.ndarray) -> np.ndarray:
        """uint64 ``[len(pages)]``: the payload hash of every page's rows as they are now
        (:func:`fold_rows` of the rows' seeded digests). One read of the pages; never
        copies them."""
        pages = np.asarray(pages, dtype=np.int64)
        n = len(pages)
        if n == 0:
            return np.zeros(0, dtype=np.uint64)
        if n > 1 and bool((np.diff(pages) < 0).any()):
            # hashed in address order (pages a scheduler handed out are often near each
            # other: runs, and rows the prefetcher already streams), answered in call order
            order = np.argsort(pages, kind="stable")
            out = np.empty(n, dtype=np.uint64)
            out[order] = self.payload_hashes(pages[order])
            return out
        first, last = int(pages[0]), int(pages[-1])
        each: Iterable[int]
        if self._object_major:  # long rows: every object's rows, object after object
            at = pages.tolist()
            each = (_xxh3(rows[p], seed) for p in at for seed, rows in self._seeded)
            digests = np.fromiter(each, dtype=np.uint64, count=len(self._planes) * n).reshape(n, -1).T
            return (digests * self._weights).sum(axis=0, dtype=np.uint64)  # wraps mod 2^64
        if last - first + 1 == n:  # consecutive pages: one slice of every plane
            each = chain.from_iterable(map(_xxh3, rows[first:last + 1], repeat(seed))
                                       for seed, rows in enumerate(self._planes))
        else:
            breaks = np.flatnonzero(np.diff(pages) != 1) + 1
            if (len(breaks) + 1) * RUN_MIN <= n:  # mostly runs: iterate slices of each plane
                firsts = pages[np.concatenate(([0], breaks))].tolist()
                sizes = np.diff(np.concatenate(([0], breaks, [n]))).tolist()
                runs = [(lo, lo + k) for lo, k in zip(firsts, sizes, strict=True)]
                each = chain.from_iterable(map(_xxh3, rows[lo:hi], repeat(seed))
                                           for seed, rows in enumerate(self._planes) for lo, hi in runs)
            else:
                at = pages.tolist()
                each = (_xxh3(flat[p * row:p * row + row], seed)
                        for seed, (flat, row) in enumerate(zip(self._flat, self._rows, strict=True))
                        for p in at)
        digests = np.fromiter(each, dtype=np.uint64, count=len(self._planes) * n).reshape(-1, n)
        return (digests * self._weights).sum(axis=0, dtype=np.uint64)  # wraps mod 2^64
