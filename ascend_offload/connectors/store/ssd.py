"""The store connector's SSD tier (``local.ssd``): the hooks the scheduler and the
workers call; the rules are vLLM-free in ``store/ssd/`` (docs/store.md, "SSD tier").

Files in ``local.ssd.path`` (one engine per directory; each file is held under an
exclusive ``flock``): ``ssd-<fingerprint>-r<rank>.slots`` per worker rank, and with
``persist`` the scheduler's ``ssd-<fingerprint>.index.json`` (and ``.lock``). All are
0600, never opened through a link, in a directory only this user can write
(``store/private_files.py``).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from ascend_offload.config import ConfigError, SsdTierConfig
from ascend_offload.connectors.store.settings import NAME, StoreSettings
from ascend_offload.store.local import LocalStore
from ascend_offload.store.private_files import PrivatePathError, open_private, private_dir
from ascend_offload.store.ssd import format as fmt
from ascend_offload.store.ssd.file import RankTier, SlotFile, SsdError
from ascend_offload.store.ssd.index import (
    SsdIndex,
    max_index_bytes,
    read_index_file,
    remove_index_file,
    write_index_file,
)
from ascend_offload.store.ssd.jobs import PromoteJob, SpillJob, SsdJobs

log = logging.getLogger(__name__)


def geometry(settings: StoreSettings) -> tuple[int, int]:
    """(slot bytes, slots per rank file) of the configured tier."""
    c = settings.cfg.local.ssd
    assert c is not None
    sb = fmt.slot_bytes(settings.page_bytes)
    n = c.capacity_bytes // sb
    if n < 1:
        raise ConfigError(f"key 'local.ssd.capacity_bytes'={c.capacity_bytes}: holds no slot of {sb} bytes "
                          f"(one block of {settings.page_bytes} bytes + header; accepted: >= {sb})")
    return sb, n


class SsdScheduler:
    """The scheduler's side: the tier's index, its jobs, and the persisted index file."""

    def __init__(self, settings: StoreSettings, index: LocalStore,
                 clock: Callable[[], float] = time.monotonic) -> None:
        c = settings.cfg.local.ssd
        assert c is not None
        self.cfg = c
        slot_b, num_slots = geometry(settings)
        self.ssd = SsdIndex(num_slots, settings.cfg.local.eviction)
        self.jobs = SsdJobs(index, self.ssd, page_bytes=settings.page_bytes, world_size=settings.world_size,
                            timeout_s=settings.cfg.load_timeout_s,
                            max_inflight=max(1, settings.num_pages // 2))
        self._clock = clock
        self._lock_fd = -1
        self._stop = threading.Event()
        self._persister: threading.Thread | None = None
        self._write_lock = threading.Lock()
        directory = Path(c.path)
        self.index_path = directory / f"ssd-{settings.fingerprint}.index.json"
        try:
            private_dir(directory, "local.ssd.path")
            self._lock_fd = open_private(directory / f"ssd-{settings.fingerprint}.lock",
                                         os.O_RDWR | os.O_CREAT, "local.ssd.path")
        except PrivatePathError as exc:
            raise ConfigError(str(exc)) from None
        try:  # from here on the lock file is ours: any error releases it
            self._start(settings, c, slot_b, num_slots)
        except BaseException:
            self._release()
            raise

    def _start(self, settings: StoreSettings, c: SsdTierConfig, slot_b: int, num_slots: int) -> None:
        """Take the directory's lock, load a persisted index (a bad one: start empty, logged
        once) and start the persister thread."""
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"key 'local.ssd.path'={c.path!r}: in use by another engine") from None
        # what a persisted index must match: the keys' layout, the slot geometry and the
        # weights it was computed with (an in-place checkpoint update keeps the key
        # fingerprint; its KV must not be served)
        self._meta = {"fingerprint": settings.fingerprint, "slot_bytes": slot_b,
                      "page_bytes": settings.page_bytes, "world_size": settings.world_size,
                      "weights": getattr(settings, "weights_id", "")}
        kept = 0
        if c.persist:
            data = read_index_file(self.index_path, max_index_bytes(num_slots))
            if data is not None:
                try:
                    kept = self.ssd.restore(data, self._meta)
                except Exception as exc:  # untrusted input: never a failed start
                    log.warning("%s: SSD index %s could not be restored (%s); starting empty",
                                NAME, self.index_path, exc)
                    self.ssd = SsdIndex(num_slots, settings.cfg.local.eviction)
                    self.jobs.ssd = self.ssd
                    kept = 0
                else:
                    if not kept and data.get("entries"):
                        why = ("of other weights" if data.get("weights") != self._meta["weights"]
                               else "of another layout or malformed")
                        log.warning("%s: SSD index %s is %s; starting empty", NAME, self.index_path, why)
        else:
            remove_index_file(self.index_path)
        self._saved_generation = self.ssd.generation
        self._last_save = self._clock()
        if c.persist:
            # an idle engine makes no more steps: its last changes are written from here
            self._persister = threading.Thread(target=self._persist_loop, name="ascend-ssd-index", daemon=True)
            self._persister.start()
        log.info("%s: SSD tier in %s: %d slots of %d bytes per rank%s", NAME, c.path, num_slots, slot_b,
                 f", persistent ({kept} entries kept)" if c.persist else "")

    def _release(self) -> None:
        """Stop the persister and close the lock file (start-up failure or close)."""
        self._stop.set()
        if self._persister is not None:
            self._persister.join(timeout=30)
            self._persister = None
        if self._lock_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = -1

    def meta(self) -> dict[str, Any]:
        """This step's spill and promote jobs (fields of ``StoreConnectorMetadata``)."""
        self.jobs.plan_spills()
        return {"ssd_spills": self.jobs.take_spills(), "ssd_promotes": self.jobs.take_promotes()}

    def watch(self, keys: Iterable[str]) -> None:
        self.jobs.watch(keys)

    def report(self, spilled: Mapping[int, int], spill_failed: Mapping[int, int],
               promoted: Mapping[tuple[int, int], int], corrupt: Mapping[str, int]) -> None:
        if spilled or spill_failed:
            self.jobs.report_spills(spilled, spill_failed)
        if promoted or corrupt:
            self.jobs.report_promotes(promoted, corrupt)

    def maybe_persist(self, force: bool = False) -> bool:
        """Write the index when it changed, at most every ``persist_interval_s`` (always when
        ``force``); True when written. The persister thread calls it, off the scheduler's
        step, so the last change of a run is on disk within the interval even if vLLM
        kills the engine core before its connector's shutdown."""
        if not self.cfg.persist:
            return False
        with self._write_lock:
            now = self._clock()
            if not force and now - self._last_save < self.cfg.persist_interval_s:
                return False
            changed = self.ssd.snapshot_if_changed(self._meta, self._saved_generation)
            if changed is None:
                return False
            try:
                write_index_file(self.index_path, changed[1])
            except OSError as exc:
                log.warning("%s: cannot write the SSD index %s: %s", NAME, self.index_path, exc)
                return False
            self._saved_generation, self._last_save = changed[0], now
            return True

    def _persist_loop(self) -> None:
        while not self._stop.wait(self._next_persist_wait()):
            try:
                self.maybe_persist()
            except Exception:  # never let the thread die silently: the next round retries
                log.exception("%s: persisting the SSD index failed", NAME)

    def _next_persist_wait(self) -> float:
        """Until the last write's interval ends (a change is then written at once), or a
        whole interval when it already has."""
        left = self._last_save + self.cfg.persist_interval_s - self._clock()
        return left if left > 0 else self.cfg.persist_interval_s

    def gauges(self) -> dict[str, int]:
        return {"ssd_used_slots": self.ssd.used_slots}

    def reset(self) -> None:
        """The store's reset: the tier forgets every entry, and a persisted index is
        rewritten now (a restart right after must not bring pre-reset entries back)."""
        gone = self.jobs.reset()
        self.maybe_persist(force=True)
        log.info("%s: SSD tier reset: %d entries dropped", NAME, gone)

    def close(self) -> None:
        self._stop.set()
        if self._persister is not None:
            self._persister.join(timeout=30)
            self._persister = None
        self.maybe_persist(force=True)
        self._release()


class SsdWorker:
    """A rank's side: its slot file, spills handed to the writer thread, verified promotes."""

    def __init__(self, settings: StoreSettings, planes: Mapping[str, torch.Tensor], rank: int) -> None:
        c = settings.cfg.local.ssd
        assert c is not None
        slot_b, num_slots = geometry(settings)
        path = Path(c.path) / f"ssd-{settings.fingerprint}-r{rank}.slots"
        try:
            file = SlotFile(path, num_slots, slot_b, direct_io=c.direct_io, keep=c.persist)
        except SsdError as exc:
            raise ConfigError(str(exc)) from None
        try:
            self.tier = RankTier(planes, file, rank)
        except BaseException:
            file.close()  # its descriptor and lock: the next start may take the file
            raise
        log.info("%s: rank %d SSD tier file %s (%d slots, %s I/O%s)", NAME, rank, path, num_slots,
                 "O_DIRECT" if file.direct else "buffered", ", kept" if file.kept else "")
        self._promoted: Counter[tuple[int, int]] = Counter()
        self._corrupt: Counter[str] = Counter()

    def submit_spills(self, jobs: Iterable[SpillJob]) -> None:
        for job in jobs:
            self.tier.submit_spill(job.job_id, job.keys, job.pages, job.slots)

    def run_promotes(self, jobs: Iterable[PromoteJob]) -> None:
        """Read, verify and copy each job's slots into its pages (before the step's loads)."""
        for job in jobs:
            try:
                good, corrupt = self.tier.promote(job.keys, job.slots, job.pages)
            except Exception:
                log.exception("%s: rank %d SSD promote %d failed", NAME, self.tier.rank, job.job_id)
                good, corrupt = 0, []
            self._promoted[(job.job_id, good)] += 1
            self._corrupt.update(corrupt)

    def take_report(self) -> dict[str, Counter[Any]]:
        """This rank's spill and promote results since the last call (worker metadata fields)."""
        spilled, failed = self.tier.take_spill_report()
        promoted, corrupt = self._promoted, self._corrupt
        self._promoted, self._corrupt = Counter(), Counter()
        return {"ssd_spilled": spilled, "ssd_spill_failed": failed, "ssd_promoted": promoted,
                "ssd_corrupt": corrupt}

    def close(self) -> None:
        self.tier.close()
