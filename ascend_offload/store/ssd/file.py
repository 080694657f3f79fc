"""A worker rank's SSD-tier file: fixed-size slots, written behind, read with verification.

One preallocated file per rank (``posix_fallocate`` to the configured capacity, so
a full disk fails at start, not mid-write). O_DIRECT where the file system allows
it (decided by probing an aligned read at open, logged): the tier's bytes then do
not evict the host's page cache, and the cost of a read is the device's. Buffered
otherwise (tmpfs and some overlay file systems refuse O_DIRECT).

:class:`RankTier` moves whole slots between the rank's host page planes and the
file: spills (page -> slot) run on one writer thread per rank and never block the
model thread (the caller only enqueues); promotes (slot -> page) run in the
caller's thread, verify every slot's header and checksum (``store/ssd/format.py``) and
copy only verified payloads into pages. The scheduler decides every slot and page
(``store/ssd/index.py``, ``store/ssd/jobs.py``); a rank knows nothing of requests.

Why a buffered promote still stages (:class:`_SplitStaging`) rather than reading each
slot straight into its page: measured on the 2-vCPU VM of docs/store.md, the kernel's
copy from the page cache into cold host pages ran at 6-10 GB/s (every store first reads
the line it overwrites), into a cache-resident buffer at 15-20 GB/s; the payload is
then hashed in cache and copied to the pages with streaming stores (~22 GB/s, no line
read first). The staging is split per layer so that copy is a plain row copy.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import queue
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from ascend_offload import device, native
from ascend_offload.errors import AscendOffloadError
from ascend_offload.store.private_files import (
    PrivatePathError,
    open_private,
    private_dir,
    same_file,
)
from ascend_offload.store.ssd import format as fmt

log = logging.getLogger(__name__)

DirectIO = Literal["auto", "on", "off"]
#: bytes moved per system call batch (staging buffer of each direction)
CHUNK_BYTES = 4 << 20
#: chunks a promote reads ahead of the one it verifies
READ_AHEAD = 2
#: most buffers one preadv takes (Linux: 1024)
IOV_MAX = max(16, os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in getattr(os, "sysconf_names", {}) else 1024)


class SsdError(AscendOffloadError, RuntimeError):
    """The SSD tier cannot be used as configured (the message names the key)."""


def _runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first index, first slot, count) of each run of consecutive slot numbers."""
    out: list[tuple[int, int, int]] = []
    for i, s in enumerate(slots):
        if out and out[-1][1] + out[-1][2] == s and out[-1][0] + out[-1][2] == i:
            a, b, n = out[-1]
            out[-1] = (a, b, n + 1)
        else:
            out.append((i, s, 1))
    return out


class SlotFile:
    """``num_slots`` slots of ``slot_bytes`` in one file, held under an exclusive lock."""

    def __init__(self, path: Path, num_slots: int, slot_bytes: int, *, direct_io: DirectIO = "auto",
                 keep: bool = False) -> None:
        if slot_bytes % fmt.ALIGN:
            raise ValueError(f"slot_bytes {slot_bytes} is not a multiple of {fmt.ALIGN}")
        self.path = path
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.size = num_slots * slot_bytes
        self._fd = self._io_fd = -1
        try:
            private_dir(path.parent, "local.ssd.path")
            self._fd = open_private(path, os.O_RDWR | os.O_CREAT, "local.ssd.path")
        except PrivatePathError as exc:
            raise SsdError(str(exc)) from None
        self._io_fd = self._fd
        try:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise SsdError(f"key 'local.ssd.path': {path} is in use by another process "
                               "(give every engine its own directory)") from None
            #: whether the file kept its slots from an earlier run
            self.kept = keep and os.fstat(self._fd).st_size == self.size
            if not self.kept:
                os.ftruncate(self._fd, 0)
                try:
                    os.posix_fallocate(self._fd, 0, self.size)
                except OSError as exc:
                    raise SsdError(f"key 'local.ssd.capacity_bytes'={self.size}: cannot allocate "
                                   f"{path}: {exc}") from None
            self.direct = self._open_direct(direct_io)
        except BaseException:
            self.close()
            raise

    def _open_direct(self, mode: DirectIO) -> bool:
        if mode == "off" or not hasattr(os, "O_DIRECT"):
            if mode == "on":
                raise SsdError("key 'local.ssd.direct_io'='on': this platform has no O_DIRECT")
            return False
        why = ""
        fd = -1
        try:
            # by name again (O_DIRECT cannot be set on the open descriptor): never through a
            # link, and it must reach the file already held under the lock
            fd = os.open(self.path, os.O_RDWR | os.O_DIRECT | getattr(os, "O_NOFOLLOW", 0)
                         | getattr(os, "O_CLOEXEC", 0))
            if not same_file(fd, self._fd):
                os.close(fd)
                raise SsdError(f"key 'local.ssd.path': {self.path} was replaced while it was opened")
            probe = mmap.mmap(-1, fmt.ALIGN)
            try:
                os.preadv(fd, [probe], 0)
            finally:
                probe.close()
        except OSError as exc:
            why = exc.strerror or str(exc)
            if fd >= 0:
                os.close(fd)
            if mode == "on":
                raise SsdError(f"key 'local.ssd.direct_io'='on': O_DIRECT refused on {self.path}: "
                               f"{why}") from None
            log.info("SSD tier: %s uses buffered I/O (O_DIRECT refused: %s)", self.path, why)
            return False
        self._io_fd = fd
        return True

    def _check(self, slots: Sequence[int], buf: memoryview) -> None:
        if len(buf) < len(slots) * self.slot_bytes:
            raise ValueError(f"buffer of {len(buf)} bytes for {len(slots)} slots")
        self._check_slots(slots)

    def _check_slots(self, slots: Sequence[int]) -> None:
        for s in slots:
            if not 0 <= s < self.num_slots:
                raise ValueError(f"slot {s} outside [0, {self.num_slots})")

    def write(self, slots: Sequence[int], buf: memoryview) -> None:
        """Slot ``slots[i]`` <- ``buf[i * slot_bytes : (i + 1) * slot_bytes]``."""
        self._io(os.pwritev, "write", slots, buf)

    def read(self, slots: Sequence[int], buf: memoryview) -> None:
        """``buf[i * slot_bytes : ...]`` <- slot ``slots[i]``."""
        self._io(os.preadv, "read", slots, buf)

    def read_whole(self, slots: Sequence[int], buf: memoryview) -> int:
        """:meth:`read`, but a short read is not an error: how many leading slots of
        ``slots`` landed whole (all of them, or the first whose bytes the file lacks)."""
        self._check(slots, buf)
        sb = self.slot_bytes
        return self._read_runs(slots, lambda i, n: [buf[i * sb:(i + n) * sb]], len(slots))

    def read_into(self, slots: Sequence[int], parts: Sequence[Sequence[memoryview]]) -> int:
        """Slot ``slots[i]`` into the buffers ``parts[i]`` in order, which the caller made to
        cover exactly ``slot_bytes`` (e.g. header, the payload's part of each layer, padding).
        Buffered descriptors only (O_DIRECT needs every buffer aligned). How many leading
        slots landed whole, as :meth:`read_whole`."""
        if self.direct:
            raise ValueError("read_into needs a buffered descriptor")
        if len(parts) < len(slots):
            raise ValueError(f"buffers of {len(parts)} slots for {len(slots)} slots")
        self._check_slots(slots)
        per_call = max(1, IOV_MAX // max(1, len(parts[0]) if parts else 1))
        return self._read_runs(slots, lambda i, n: [b for p in parts[i:i + n] for b in p], per_call)

    def _read_runs(self, slots: Sequence[int], buffers: Callable[[int, int], list[memoryview]],
                   per_call: int) -> int:
        """One preadv per run of consecutive slots (at most ``per_call`` slots) into
        ``buffers(first index, count)``; stops at the first slot a short read left partial."""
        sb = self.slot_bytes
        for i, s, n in _runs(slots):
            for j in range(0, n, per_call):
                m = min(per_call, n - j)
                done = os.preadv(self._io_fd, buffers(i + j, m), (s + j) * sb)
                if done != m * sb:
                    return i + j + min(m, done // sb)
        return len(slots)

    def _io(self, call: Callable[[int, list[memoryview], int], int], what: str, slots: Sequence[int],
            buf: memoryview) -> None:
        """One ``call`` (pwritev / preadv) per run of consecutive slots; a short one is EIO."""
        self._check(slots, buf)
        sb = self.slot_bytes
        for i, s, n in _runs(slots):
            part = buf[i * sb:(i + n) * sb]
            done = call(self._io_fd, [part], s * sb)
            if done != len(part):
                raise OSError(errno.EIO, f"short {what} of slots {s}..{s + n - 1}: {done} of {len(part)} bytes")

    def close(self) -> None:
        for fd in {getattr(self, "_io_fd", -1), getattr(self, "_fd", -1)}:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fd = self._io_fd = -1


class _Staging:
    """An aligned host buffer of whole slots (anonymous mmap: page-aligned for O_DIRECT)."""

    def __init__(self, slot_bytes: int, slots: int) -> None:
        self.slots = slots
        self.map = mmap.mmap(-1, slot_bytes * slots)
        self.view = memoryview(self.map)
        self.rows = np.frombuffer(self.map, dtype=np.uint8).reshape(slots, slot_bytes)

    def close(self) -> None:
        del self.rows
        # a view still exported (e.g. held by a logged traceback) keeps the mapping alive
        # until it is collected; closing then is the garbage collector's job
        with contextlib.suppress(BufferError):
            self.view.release()
            self.map.close()


class _SplitStaging:
    """A buffered read's landing area for a chunk of slots: one preadv puts slot ``i``'s
    header in ``heads[i]``, its payload in rows as wide as the page planes' rows, its
    padding in a shared sink, so verified payloads go to their pages as whole-row copies
    (one native streaming copy for every layer of a chunk: ``native.copy_layer_rows``), not
    as column slices of whole slots. Layers of one width (every layer's page the same size,
    the usual case): the payloads lie whole one after another (slot ``i``'s layer ``l`` is
    row ``i * layers + l``), so each is read into one buffer and hashed in one call; that
    region starts ``HEADER_BYTES`` into a page, so every payload byte lands at the offset
    within its page it has in the file, as in a plain read of whole slots (measured on
    the AMD host of docs/benchmarks.md: the 1 MiB row's promote 0.54 -> 0.57 of a raw read,
    medians of ten runs each). Layers of several widths: one region a layer (slot ``i``'s
    layer ``l`` is row ``i`` of region ``l``)."""

    def __init__(self, widths: Sequence[int], slots: int, sink: memoryview | None) -> None:
        payload, n_layers = sum(widths), len(widths)
        one_width = len(set(widths)) == 1
        regions = [slots * fmt.HEADER_BYTES, *([slots * payload] if one_width else (slots * w for w in widths))]
        starts, off = [], 0
        for i, size in enumerate(regions):  # each region on its own pages, line-aligned (the payloads 64 B in)
            lead = fmt.HEADER_BYTES if i == 1 and one_width else 0
            starts.append(off + lead)
            off += -(-(size + lead) // mmap.PAGESIZE) * mmap.PAGESIZE
        self.slots = slots
        self.map = mmap.mmap(-1, max(off, mmap.PAGESIZE))
        mv = memoryview(self.map)
        self.heads = np.frombuffer(self.map, dtype=np.uint8, count=regions[0], offset=0).reshape(slots, -1)
        seq = torch.arange(slots, dtype=torch.int32)
        #: per layer: (source rows, the rows of slots 0, 1, ... among them)
        self.sources: list[tuple[torch.Tensor, torch.Tensor]]
        if one_width:
            rows = torch.frombuffer(self.map, dtype=torch.uint8, count=regions[1], offset=starts[1])
            rows = rows.view(slots * n_layers, widths[0])
            self.sources = [(rows, seq * n_layers + layer) for layer in range(n_layers)]
            #: per slot: the payload's buffers in order (hashed where they landed)
            self.payloads = [[mv[starts[1] + i * payload:starts[1] + (i + 1) * payload]] for i in range(slots)]
        else:
            self.sources = [(torch.frombuffer(self.map, dtype=torch.uint8, count=size, offset=a).view(slots, w), seq)
                            for a, size, w in zip(starts[1:], regions[1:], widths, strict=True)]
            self.payloads = [[mv[a + i * w:a + (i + 1) * w] for a, w in zip(starts[1:], widths, strict=True)]
                             for i in range(slots)]
        h = fmt.HEADER_BYTES
        #: per slot: the buffers one slot is read into (header, payload, padding)
        self.iov = [[mv[i * h:(i + 1) * h], *self.payloads[i], *([sink] if sink is not None else [])]
                    for i in range(slots)]
        #: per layer: (source address, source rows, address of the slots' row numbers)
        self.addresses = [(t.data_ptr(), t.shape[0], idx.data_ptr()) for t, idx in self.sources]
        #: the same rows for one native call over every layer: layer ``l``'s rows seen
        #: from its first row, so one index list (``slot_rows``) serves every layer
        if one_width:
            flat = rows.view(-1)
            self.layer_rows = [flat[layer * widths[0]:].view(-1, widths[0]) for layer in range(n_layers)]
            self.slot_rows = seq * n_layers
        else:
            self.layer_rows = [t for t, _ in self.sources]
            self.slot_rows = seq

    def close(self) -> None:
        del self.heads, self.sources, self.payloads, self.iov, self.layer_rows, self.slot_rows
        with contextlib.suppress(BufferError):  # as _Staging.close
            self.map.close()


class RankTier:
    """One rank's slots: spills behind on a writer thread, verified promotes (module doc)."""

    def __init__(self, planes: Mapping[str, torch.Tensor], file: SlotFile, rank: int) -> None:
        self.file = file
        self.rank = rank
        self._planes = list(planes.values())
        offsets, off = [], fmt.HEADER_BYTES
        for p in self._planes:
            if p.dtype != torch.uint8 or p.dim() != 2 or not p.is_contiguous() or not device.is_host(p):
                raise ValueError("page planes must be contiguous 2-D uint8 host tensors")
            offsets.append((off, off + p.shape[1]))
            off += p.shape[1]
        self._cols = offsets
        self.payload_bytes = off - fmt.HEADER_BYTES
        if fmt.slot_bytes(self.payload_bytes) != file.slot_bytes:
            raise ValueError(f"pages of {self.payload_bytes} bytes do not fit slots of {file.slot_bytes}")
        # numpy views: fancy-index row copies between strided views ran at ~5 GB/s here,
        # torch's index_copy_ / index_put_ on uint8 at ~0.3 GB/s
        self._np_planes = [p.numpy() for p in self._planes]
        per_chunk = max(1, CHUNK_BYTES // file.slot_bytes)
        self._write_buf = _Staging(file.slot_bytes, per_chunk)
        # READ_AHEAD chunks are read (GIL released) while one is verified and copied: on a
        # busy host a reader thread's wake-up can take a time slice, which a queue of reads absorbs
        self._per_chunk = per_chunk
        # buffered files: each part of a slot lands in its own region (_SplitStaging)
        pad = file.slot_bytes - fmt.HEADER_BYTES - self.payload_bytes
        self._sink = memoryview(bytearray(pad)) if pad else None
        self.split = not file.direct and 2 + len(self._planes) <= IOV_MAX
        self._split_bufs = tuple(_SplitStaging([p.shape[1] for p in self._planes], per_chunk, self._sink)
                                 for _ in range(READ_AHEAD + 1)) if self.split else ()
        self._native = self.split and native.available()
        self._plane_addresses = [(p.data_ptr(), p.shape[0], p.shape[1]) for p in self._planes]
        # one native call copies a chunk's rows of every layer: with 32 layers a call per
        # layer cost ~1.5 ms of a 64 MiB promote in Python and ctypes (copy 4.6-5.4 ms ->
        # 2.8-3.7 ms measured)
        self._layer_tables = tuple(native.layer_table(list(zip(b.layer_rows, self._planes, strict=True)))
                                   for b in self._split_bufs) if self._native and native.has_layer_copy() else ()
        self._read_bufs = () if self.split else tuple(_Staging(file.slot_bytes, per_chunk)
                                                      for _ in range(READ_AHEAD + 1))
        # whole slots (O_DIRECT): each layer's rows sit at the slot pitch; one native call
        # copies a chunk's rows of every layer (a numpy copy a layer held the GIL each time)
        self._slot_bytes_views = [torch.frombuffer(b.map, dtype=torch.uint8) for b in self._read_bufs]
        self._slot_seq = torch.arange(per_chunk, dtype=torch.int32)
        self._strided_tables = tuple(
            native.strided_table([(view, a, file.slot_bytes, p) for p, (a, _b) in zip(self._planes, self._cols, strict=True)])
            for view in self._slot_bytes_views) if self._read_bufs and native.has_strided_copy() else ()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix=f"ssd-reader-r{rank}")
        self._lock = threading.Lock()
        self._spilled: Counter[int] = Counter()
        self._spill_failed: Counter[int] = Counter()
        self._queue: queue.SimpleQueue[tuple[int, tuple[str, ...], tuple[int, ...], tuple[int, ...]] | None] = (
            queue.SimpleQueue())
        self._idle = threading.Event()
        self._idle.set()
        self._pending = 0
        self.written_slots = 0
        self.failed_writes = 0
        self._thread = threading.Thread(target=self._writer, name=f"ssd-writer-r{rank}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ spills

    def submit_spill(self, job_id: int, keys: Sequence[str], pages: Sequence[int], slots: Sequence[int]) -> None:
        """Queue ``slot[i] <- page[i]`` (returns at once; reported by :meth:`take_spill_report`).
        The scheduler keeps the pages pinned until every rank reported the job."""
        with self._lock:
            self._pending += 1
            self._idle.clear()
        self._queue.put((job_id, tuple(keys), tuple(pages), tuple(slots)))

    def _writer(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            job_id, keys, pages, slots = item
            ok = True
            try:
                self._write_job(keys, pages, slots)
            except Exception:
                ok = False
                log.exception("SSD tier: rank %d could not write spill job %d (%d blocks)",
                              self.rank, job_id, len(keys))
            with self._lock:
                (self._spilled if ok else self._spill_failed)[job_id] += 1
                if ok:
                    self.written_slots += len(keys)
                else:
                    self.failed_writes += 1
                self._pending -= 1
                if self._pending == 0:
                    self._idle.set()

    def _write_job(self, keys: Sequence[str], pages: Sequence[int], slots: Sequence[int]) -> None:
        buf, payload = self._write_buf, self.payload_bytes
        for start in range(0, len(keys), buf.slots):
            n = min(buf.slots, len(keys) - start)
            rows = buf.rows[:n]
            idx = np.asarray(pages[start:start + n], dtype=np.int64)
            for plane, (a, b) in zip(self._np_planes, self._cols, strict=True):
                rows[:, a:b] = plane[idx]
            fmt.pack_rows(rows, rank=self.rank, slots=slots[start:start + n],
                          key_hashes_=fmt.key_hashes(keys[start:start + n]), payload_len=payload)
            sb = self.file.slot_bytes
            self.file.write(slots[start:start + n], buf.view[:n * sb])

    def take_spill_report(self) -> tuple[Counter[int], Counter[int]]:
        """(spill jobs written, spill jobs failed) since the last call: job id -> 1."""
        with self._lock:
            done, failed = self._spilled, self._spill_failed
            self._spilled, self._spill_failed = Counter(), Counter()
        return done, failed

    def wait_idle(self, timeout_s: float) -> bool:
        """True once every queued spill ran (tests, shutdown)."""
        return self._idle.wait(timeout_s)

    # ------------------------------------------------------------------ promotes

    def promote(self, keys: Sequence[str], slots: Sequence[int], pages: Sequence[int]) -> tuple[int, list[str]]:
        """``page[i] <- slot[i]`` for the leading slots that verify. Returns (how many
        leading blocks arrived whole, keys whose slot failed verification or was cut short
        by the end of the file). Other read errors raise (the caller's to log). Chunks are
        read READ_AHEAD ahead on the reader thread, so verifying and copying overlap the I/O.
        Only verified payloads reach a page: a failed slot leaves its page as it was.

        O_DIRECT: a chunk lands in a staging buffer of whole slots (aligned, as O_DIRECT
        needs), verified payloads are copied to the pages by numpy. Buffered: one preadv
        scatters each slot over a :class:`_SplitStaging` (header, one row per layer,
        padding), the payload is hashed there and copied to the pages with the native
        streaming row copy (module doc: why not straight into the pages)."""
        per = self._per_chunk
        chunks = [(start, min(per, len(keys) - start)) for start in range(0, len(keys), per)]
        if not chunks:
            return 0, []
        sb = self.file.slot_bytes
        nbuf = READ_AHEAD + 1

        def read(k: int) -> Future[int]:
            start, n = chunks[k]
            if self.split:
                return self._reader.submit(self.file.read_into, slots[start:start + n], self._split_bufs[k % nbuf].iov)
            return self._reader.submit(self.file.read_whole, slots[start:start + n],
                                       self._read_bufs[k % nbuf].view[:n * sb])

        good = 0
        pending = collections.deque(read(k) for k in range(min(nbuf - 1, len(chunks))))
        try:
            for k, (start, n) in enumerate(chunks):
                landed = pending.popleft().result()
                if k + nbuf - 1 < len(chunks):
                    pending.append(read(k + nbuf - 1))
                ck, cs, cp = keys[start:start + landed], slots[start:start + landed], pages[start:start + landed]
                if self.split:
                    ok, why = self._verify_split(self._split_bufs[k % nbuf], ck, cs)
                    self._copy_split(self._split_bufs[k % nbuf], cp[:ok])
                else:
                    buf = self._read_bufs[k % nbuf]
                    ok, why = fmt.verify_rows(buf.rows, rank=self.rank, slots=cs, key_hashes_=fmt.key_hashes(ck),
                                              payload_len=self.payload_bytes)
                    self._scatter(buf, ok, cp[:ok])
                good += ok
                if why is None and landed < n:
                    ok, why = landed, "short read"
                if why is not None:
                    log.warning("SSD tier: rank %d slot %d of block %s failed verification (%s); "
                                "it is a miss and is recomputed", self.rank, slots[start + ok], keys[start + ok], why)
                    return good, [keys[start + ok]]
            return good, []
        finally:
            for fut in pending:  # reads ahead of a miss must land before their buffers are reused
                with contextlib.suppress(Exception):
                    fut.result()

    def _verify_split(self, buf: _SplitStaging, keys: Sequence[str], slots: Sequence[int]) -> tuple[int, str | None]:
        """:func:`fmt.verify_rows` of a chunk read into ``buf``."""
        return fmt.verify_heads(
            buf.heads, rank=self.rank, slots=slots, key_hashes_=fmt.key_hashes(keys), payload_len=self.payload_bytes,
            room=self.file.slot_bytes - fmt.HEADER_BYTES, sums=lambda k: fmt.checksums_of_parts(buf.payloads[:k]))

    def _copy_split(self, buf: _SplitStaging, pages: Sequence[int]) -> None:
        """Payload rows ``0..len(pages)-1`` of ``buf`` -> ``pages`` in every layer plane: one
        native streaming copy over every layer (tables built at start; the GIL released
        once), else one native row copy a layer on addresses checked at start
        (:func:`device.copy_host_rows`' per-call checks cost ~10 us, 32 layers a chunk),
        numpy's copy without the native library."""
        n = len(pages)
        if n == 0:
            return
        if self._native and self._layer_tables:
            self._copy_layers(native.copy_layer_rows, self._layer_tables[self._split_bufs.index(buf)],
                              buf.slot_rows.data_ptr(), pages)
            return
        if self._native:
            didx = native.int32_array(pages)
            daddr = didx.buffer_info()[0]
            for (src, n_src, sidx), (dst, rows, w) in zip(buf.addresses, self._plane_addresses, strict=True):
                rc = native.copy_byte_rows(src, n_src, sidx, dst, rows, daddr, n, w)
                if rc < 0:
                    raise IndexError(f"SSD promote: page {pages[-rc - 1]} outside [0, {rows})")
            return
        idx = np.asarray(pages, dtype=np.int64)
        for (src_rows, slot_rows), dst_plane in zip(buf.sources, self._np_planes, strict=True):
            dst_plane[idx] = src_rows.numpy()[slot_rows.numpy()[:n]]

    def _copy_layers(self, copy: Callable[[ctypes.Array[ctypes.c_int64], int, int, int, int], int],
                     table: ctypes.Array[ctypes.c_int64], src_rows: int, pages: Sequence[int]) -> None:
        """Rows ``0..len(pages)-1`` (int32 row numbers at ``src_rows``) -> ``pages`` in every
        layer plane by one native ``copy`` over ``table``; a page out of range is named."""
        didx = native.int32_array(pages)
        rc = copy(table, len(self._planes), src_rows, didx.buffer_info()[0], len(pages))
        if rc < 0:
            raise IndexError(f"SSD promote: page {pages[-rc - 1]} outside [0, {self._planes[0].shape[0]})")

    def _scatter(self, buf: _Staging, n: int, pages: Sequence[int]) -> None:
        """Payload rows of the first ``n`` whole slots of ``buf`` -> ``pages`` in every layer
        plane: one native call for every layer, numpy's copy a layer without the library."""
        if n == 0:
            return
        if self._strided_tables:
            self._copy_layers(native.copy_strided_rows, self._strided_tables[self._read_bufs.index(buf)],
                              self._slot_seq.data_ptr(), pages[:n])
            return
        idx = np.asarray(pages, dtype=np.int64)
        rows = buf.rows[:n]
        for plane, (a, b) in zip(self._np_planes, self._cols, strict=True):
            plane[idx] = rows[:, a:b]

    # ------------------------------------------------------------------ end

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish the queued spills (at most ``timeout_s``), stop the writer, close the file."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("SSD tier: rank %d writer still busy after %.0f s at close", self.rank, timeout_s)
            return
        self._reader.shutdown(wait=True)
        self._write_buf.close()
        self._strided_tables = ()
        self._slot_bytes_views.clear()
        for buf in self._read_bufs:
            buf.close()
        for split in self._split_bufs:
            split.close()
        self.file.close()
