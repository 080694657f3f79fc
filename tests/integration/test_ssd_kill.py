"""Kill mid-spill: a process spilling through the real SSD tier (``RankTier`` writer
thread, ``SsdIndex`` + ``SsdJobs`` with the index persisted atomically after every
settled job) is SIGKILLed while it writes; after every kill the persisted index is
loaded and every entry read back through the verified promote. No entry may ever
deliver bytes other than the ones spilled for its key: an entry is either exact or
a miss. Slots are reused all the time (the tier holds 6 of them), so the index on
disk often names a slot that was being rewritten for another key when the kill came.

Half of the rounds kill at a random point; the other half make the kill land inside a
slot write for certain: the child's file (a test subclass) writes the first half of a
batch, says so, and blocks, and the parent kills it then.

Run as a script (``python test_ssd_kill.py DIR FIRST TEAR_AFTER``) it is the child."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from ascend_offload.store.local import LocalStore
from ascend_offload.store.ssd import format as fmt
from ascend_offload.store.ssd.file import RankTier, SlotFile
from ascend_offload.store.ssd.index import SsdIndex, read_index_file, write_index_file
from ascend_offload.store.ssd.jobs import SsdJobs

PAGE = (1 << 20) - fmt.HEADER_BYTES  # one slot of exactly 1 MiB
SLOTS = 6
HOST_PAGES = 8
META = {"fingerprint": "kill-test", "slot_bytes": fmt.slot_bytes(PAGE)}


def content(key: str) -> torch.Tensor:
    """The bytes spilled for ``key`` (any process can recompute them)."""
    g = torch.Generator().manual_seed(fmt.key_hash(key) & 0x7FFFFFFF)
    return torch.randint(0, 256, (PAGE,), dtype=torch.uint8, generator=g)


class TearingFile(SlotFile):
    """A slot file whose ``tear_after``-th write stops half way and waits to be killed."""

    def __init__(self, *args, tear_after: int, **kw) -> None:
        super().__init__(*args, **kw)
        self.tear_after = tear_after
        self.writes = 0

    def write(self, slots, buf) -> None:
        self.writes += 1
        if self.writes != self.tear_after:
            super().write(slots, buf)
            return
        half = self.slot_bytes // 2  # the header and half the payload of the first slot
        os.pwrite(self._io_fd, buf[:half], slots[0] * self.slot_bytes)
        print("torn", flush=True)
        time.sleep(3600)


def child(directory: Path, first: int, tear_after: int) -> None:
    index = LocalStore(HOST_PAGES * PAGE, PAGE, with_data=False)
    ssd = SsdIndex(SLOTS)
    ssd.restore(read_index_file(directory / "index.json") or {}, META)
    jobs = SsdJobs(index, ssd, page_bytes=PAGE, world_size=1, timeout_s=30.0, max_inflight=4)
    planes = {"l0": torch.zeros((HOST_PAGES, PAGE), dtype=torch.uint8)}
    file = (TearingFile(directory / "r0.slots", SLOTS, META["slot_bytes"], keep=True, tear_after=tear_after)
            if tear_after else SlotFile(directory / "r0.slots", SLOTS, META["slot_bytes"], keep=True))
    tier = RankTier(planes, file, rank=0)
    i = first
    while True:
        keys = [f"key{i + j}" for j in range(2)]
        i += 2
        handles = index.allocate(keys, [PAGE] * 2)
        assert handles is not None
        for h in handles:
            planes["l0"][index.pages(h.key)[0]] = content(h.key)
        index.commit(handles)
        jobs.watch(keys)
        jobs.plan_spills()
        for job in jobs.take_spills():
            tier.submit_spill(job.job_id, job.keys, job.pages, job.slots)
        tier.wait_idle(30)
        done, failed = tier.take_spill_report()
        jobs.report_spills(done, failed)
        write_index_file(directory / "index.json", ssd.snapshot(META))
        print(f"settled {i}", flush=True)


def verify(directory: Path) -> tuple[int, int]:
    """(entries delivered exact, entries that were misses); fails on any wrong byte."""
    ssd = SsdIndex(SLOTS)
    ssd.restore(read_index_file(directory / "index.json") or {}, META)
    planes = {"l0": torch.zeros((1, PAGE), dtype=torch.uint8)}
    tier = RankTier(planes, SlotFile(directory / "r0.slots", SLOTS, META["slot_bytes"], keep=True), rank=0)
    exact = misses = 0
    try:
        for key, slot in ssd.snapshot(META)["entries"]:
            planes["l0"].fill_(0xEE)
            good, bad = tier.promote([key], [slot], [0])
            if good:
                assert torch.equal(planes["l0"][0], content(key)), f"wrong bytes served for {key}"
                exact += 1
            else:
                assert bad == [key] and torch.all(planes["l0"][0] == 0xEE), "a miss wrote the page"
                misses += 1
    finally:
        tier.close()
    return exact, misses


def test_sigkill_mid_spill_never_serves_a_corrupted_page(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                       os.environ.get("PYTHONPATH", "")]))
    rng = random.Random(1)
    first, exact_total, misses_total, torn_misses = 0, 0, 0, 0
    for round_ in range(4):
        tear = round_ % 2 == 0
        # settled jobs before the kill: the 6 slots wrap around (every job evicts two entries)
        want = rng.randrange(4, 10)
        proc = subprocess.Popen([sys.executable, __file__, str(tmp_path), str(first), str(want + 1 if tear else 0)],
                                env=env, stdout=subprocess.PIPE, text=True)
        try:
            seen, torn = 0, False
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith("settled"):
                    seen += 1
                    first = int(line.split()[1])
                    if not tear and seen >= want:
                        time.sleep(rng.uniform(0.0, 0.02))  # somewhere in the next job
                        break
                elif line.startswith("torn"):
                    torn = True  # the child is blocked inside a slot write: kill it there
                    break
            assert seen >= want and (torn or not tear), f"child exited early (rc={proc.poll()})"
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait(30)
        first += 100  # the restarted child spills keys no earlier round used
        exact, misses = verify(tmp_path)
        exact_total += exact
        misses_total += misses
        torn_misses += misses if tear else 0
    print(f"after 4 kills: {exact_total} entries served exact, {misses_total} misses "
          f"({torn_misses} after the kills inside a write)")
    assert exact_total > 0  # the persisted index keeps serving across kills
    assert torn_misses >= 2  # each torn slot was named by the index on disk: a miss, not bytes


if __name__ == "__main__":
    child(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
