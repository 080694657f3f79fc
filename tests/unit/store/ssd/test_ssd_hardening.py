"""The SSD tier's files on disk are untrusted and private:

* a malformed persisted index (nested past the JSON parser's recursion limit, larger
  than the tier could need, a link) means "start empty, log once", never a failed
  start, and an error after the directory's lock was taken releases it;
* every file the tier creates is opened without following links (``O_NOFOLLOW``,
  ``O_EXCL`` for the index's temporary file), 0600, in a directory created 0700; a
  directory other users can write is refused, naming the key and the path;
* a persisted index is kept only for the same weights (an in-place checkpoint update
  keeps the key fingerprint);
* a worker whose tier cannot start (``RankTier`` refuses its pages) releases the slot
  file's descriptor and lock."""

from __future__ import annotations

import fcntl
import logging
import os
import stat
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ascend_offload.config import ConfigError, StoreConnectorConfig, parse
from ascend_offload.store.local import LocalStore
from ascend_offload.store.ssd.index import read_index_file, write_index_file

PAGE = 4000


def settings(path: Path, persist: bool = True, weights: str = "w1", tag: str = "") -> SimpleNamespace:
    c = parse(StoreConnectorConfig, {"model_tag": tag, "local": {"capacity_bytes": 8 * PAGE, "ssd": {
        "path": str(path), "capacity_bytes": 16 * 4096, "persist": persist}}}, where="x")
    return SimpleNamespace(cfg=c, page_bytes=PAGE, num_pages=8, world_size=1, fingerprint="fp0",
                           weights_id=weights)


def scheduler(s: SimpleNamespace) -> Any:
    from ascend_offload.connectors.store.ssd import SsdScheduler

    return SsdScheduler(s, LocalStore(8 * PAGE, PAGE, with_data=False))  # type: ignore[arg-type]


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def lock_is_free(path: Path) -> bool:
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- malformed index


def test_a_deeply_nested_index_starts_empty_and_logs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    s = settings(tmp_path)
    a = scheduler(s)
    a.ssd.allocate(["k0"])
    a.ssd.mark_ready(["k0"])
    a.close()
    a.index_path.write_bytes(b"[" * 200_000 + b"]" * 200_000)
    with caplog.at_level(logging.WARNING):
        b = scheduler(s)
    try:
        assert len(b.ssd) == 0
        # one warning about the index (the temp dir's name contains "index" too: match the line)
        assert sum(r.levelno >= logging.WARNING and "starting empty" in r.getMessage()
                   for r in caplog.records) == 1
    finally:
        b.close()


def test_an_index_larger_than_the_tier_could_need_is_not_read(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    s = settings(tmp_path)
    scheduler(s).close()
    index = tmp_path / "ssd-fp0.index.json"
    with open(index, "wb") as fh:
        fh.truncate(1 << 30)  # sparse: 1 GiB of zeros for a tier of 16 slots
    with caplog.at_level(logging.WARNING):
        b = scheduler(s)
    try:
        assert len(b.ssd) == 0
        assert any("not read" in r.getMessage() for r in caplog.records)
    finally:
        b.close()


def test_an_error_after_the_lock_was_taken_releases_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ascend_offload.connectors.store import ssd as ssd_mod

    s = settings(tmp_path)
    scheduler(s).close()

    def broken(*_: Any, **__: Any) -> None:
        raise MemoryError("no memory for the index")

    before = open_fds()
    monkeypatch.setattr(ssd_mod, "read_index_file", broken)
    with pytest.raises(MemoryError):
        scheduler(s)
    monkeypatch.undo()
    assert open_fds() <= before
    assert lock_is_free(tmp_path / "ssd-fp0.lock")
    scheduler(s).close()  # the next start takes the directory


# ----------------------------------------------------------------------------- private files


def test_files_are_created_0600_in_a_0700_directory(tmp_path: Path) -> None:
    from ascend_offload.connectors.store.ssd import SsdWorker

    d = tmp_path / "a" / "ssd"
    s = settings(d)
    sched = scheduler(s)
    sched.ssd.allocate(["k0"])
    sched.ssd.mark_ready(["k0"])
    assert sched.maybe_persist(force=True)
    w = SsdWorker(s, {"l0": torch.zeros(8, PAGE, dtype=torch.uint8)}, rank=0)  # type: ignore[arg-type]
    try:
        for p in (d, d.parent):
            assert stat.S_IMODE(p.stat().st_mode) == 0o700, p
        names = sorted(f.name for f in d.iterdir())
        assert names == ["ssd-fp0-r0.slots", "ssd-fp0.index.json", "ssd-fp0.lock"]
        for f in d.iterdir():
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    finally:
        w.close()
        sched.close()


def test_a_planted_slot_file_link_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    from ascend_offload.connectors.store.ssd import SsdWorker

    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * 100)
    d = tmp_path / "ssd"
    d.mkdir(mode=0o700)
    (d / "ssd-fp0-r0.slots").symlink_to(victim)
    with pytest.raises(ConfigError, match=r"local\.ssd\.path.*symbolic link"):
        SsdWorker(settings(d, persist=False), {"l0": torch.zeros(8, PAGE, dtype=torch.uint8)},  # type: ignore[arg-type]
                  rank=0)
    assert victim.read_bytes() == b"precious" * 100


def test_a_planted_lock_file_link_is_refused(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"x")
    d = tmp_path / "ssd"
    d.mkdir(mode=0o700)
    (d / "ssd-fp0.lock").symlink_to(victim)
    with pytest.raises(ConfigError, match=r"local\.ssd\.path.*symbolic link"):
        scheduler(settings(d))


def test_a_planted_index_temp_link_is_never_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    index = tmp_path / "ssd-fp0.index.json"
    (tmp_path / "ssd-fp0.index.json.tmp").symlink_to(victim)
    write_index_file(index, {"format": 1})
    assert victim.read_bytes() == b"precious"
    assert read_index_file(index) == {"format": 1}
    assert stat.S_IMODE(index.stat().st_mode) == 0o600


def test_a_planted_index_link_is_not_read(tmp_path: Path) -> None:
    other = tmp_path / "elsewhere.json"
    other.write_text('{"format": 1, "entries": []}')
    index = tmp_path / "ssd-fp0.index.json"
    index.symlink_to(other)
    assert read_index_file(index) is None


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_a_directory_other_users_can_write_is_refused(tmp_path: Path, mode: int) -> None:
    from ascend_offload.connectors.store.ssd import SsdWorker

    d = tmp_path / "ssd"
    d.mkdir()
    d.chmod(mode)
    with pytest.raises(ConfigError, match=rf"local\.ssd\.path.*{d}.*writable by other users"):
        scheduler(settings(d))
    with pytest.raises(ConfigError, match=rf"local\.ssd\.path.*{d}.*writable by other users"):
        SsdWorker(settings(d), {"l0": torch.zeros(8, PAGE, dtype=torch.uint8)}, rank=0)  # type: ignore[arg-type]
    assert list(d.iterdir()) == []


def test_files_of_an_earlier_run_are_narrowed_to_0600(tmp_path: Path) -> None:
    d = tmp_path / "ssd"
    d.mkdir(mode=0o755)
    lock = d / "ssd-fp0.lock"
    lock.touch(mode=0o644)
    lock.chmod(0o644)
    scheduler(settings(d)).close()
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600


# ----------------------------------------------------------------------------- weights identity


def test_a_persisted_index_of_other_weights_is_not_restored(tmp_path: Path) -> None:
    a = scheduler(settings(tmp_path, weights="w1"))
    a.ssd.allocate(["k0"])
    a.ssd.mark_ready(["k0"])
    a.close()
    b = scheduler(settings(tmp_path, weights="w2"))  # the checkpoint was updated in place
    try:
        assert len(b.ssd) == 0
    finally:
        b.close()
    c = scheduler(settings(tmp_path, weights="w2"))
    c.close()
    d = scheduler(settings(tmp_path, weights="w2"))
    assert len(d.ssd) == 0  # b started empty and wrote nothing stale back
    d.close()


def test_weights_identity_follows_the_weight_files(tmp_path: Path) -> None:
    from ascend_offload.store.weights_id import weights_identity

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 8}')
    assert weights_identity(str(model)) is None  # no weight file: no identity
    w = model / "model.safetensors"
    w.write_bytes(b"a" * 64)
    os.utime(w, ns=(1_000_000_000, 1_000_000_000))
    first = weights_identity(str(model))
    assert first is not None and weights_identity(str(model)) == first
    w.write_bytes(b"b" * 64)  # same size, rewritten in place: a new modification time
    os.utime(w, ns=(2_000_000_000, 2_000_000_000))
    second = weights_identity(str(model))
    assert second not in (None, first)
    (model / "config.json").write_text('{"hidden_size": 9}')
    assert weights_identity(str(model)) not in (None, first, second)


def test_persist_needs_a_weights_identity_or_model_tag(tmp_path: Path) -> None:
    from ascend_offload.connectors.store.settings import persisted_weights_id

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"x")
    assert persisted_weights_id(settings(tmp_path).cfg, str(model), None).startswith("files:")
    assert persisted_weights_id(settings(tmp_path, persist=False).cfg, "no/such-model", None) == ""
    with pytest.raises(ConfigError, match=r"local\.ssd\.persist.*model_tag"):
        persisted_weights_id(settings(tmp_path).cfg, "no/such-model", None)
    assert persisted_weights_id(settings(tmp_path, tag="v2").cfg, "no/such-model", None) == "model_tag:v2"


# ----------------------------------------------------------------------------- worker start-up


def test_a_worker_whose_tier_refuses_its_pages_releases_the_slot_file(tmp_path: Path) -> None:
    from ascend_offload.connectors.store.ssd import SsdWorker

    s = settings(tmp_path, persist=False)
    before = open_fds()
    with pytest.raises(ValueError, match="page planes"):
        SsdWorker(s, {"l0": torch.zeros(8, PAGE, dtype=torch.float32)}, rank=0)  # type: ignore[arg-type]
    assert open_fds() <= before
    assert lock_is_free(tmp_path / "ssd-fp0-r0.slots")
    w = SsdWorker(s, {"l0": torch.zeros(8, PAGE, dtype=torch.uint8)}, rank=0)  # type: ignore[arg-type]
    w.close()
