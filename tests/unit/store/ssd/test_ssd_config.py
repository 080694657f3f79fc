"""``local.ssd`` config and ``check-config``: off by default, strict keys, refused with
a shared backend or layerwise mode, the path and the free space checked naming the key;
the scheduler's persisted index (connectors/store/ssd.py): throttled atomic writes,
restored at start, removed without ``persist``, one engine per directory."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from ascend_offload.check_config import check, check_ssd_path
from ascend_offload.config import ConfigError, StoreConnectorConfig, check_store_backend, parse


def cfg(ssd: dict | None = None, **extra) -> dict:
    local: dict = {"capacity_bytes": 1 << 20}
    if ssd is not None:
        local["ssd"] = ssd
    return {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"local": local, **extra}}


def test_off_by_default_and_typed() -> None:
    assert parse(StoreConnectorConfig, {}, where="x").local.ssd is None
    c = parse(StoreConnectorConfig, {"local": {"ssd": {"path": "/x", "capacity_bytes": 4096}}}, where="x")
    assert c.local.ssd.persist is False and c.local.ssd.direct_io == "auto"
    for bad in ({"path": "/x"}, {"path": "/x", "capacity_bytes": 0}, {"path": "", "capacity_bytes": 1},
                {"path": "/x", "capacity_bytes": 1, "direct_io": "maybe"},
                {"path": "/x", "capacity_bytes": 1, "typo": 1}):
        with pytest.raises(ConfigError, match="local"):
            parse(StoreConnectorConfig, {"local": {"ssd": bad}}, where="x")


@pytest.mark.parametrize("extra", [
    {"backend": "mooncake", "mooncake": {"master_address": "h:1"}},
    {"backend": "memcache"},
    {"use_layerwise": True},
])
def test_refused_where_it_does_not_compose(extra: dict) -> None:
    c = parse(StoreConnectorConfig, {"local": {"ssd": {"path": "/x", "capacity_bytes": 1}}, **extra}, where="x")
    with pytest.raises(ConfigError, match=r"key 'local\.ssd'"):
        check_store_backend(c)


def test_check_config_accepts_a_creatable_path(tmp_path: Path) -> None:
    out = check(cfg({"path": str(tmp_path / "new" / "dir"), "capacity_bytes": 1 << 20}))
    assert out["kv_connector_extra_config"]["local"]["ssd"]["capacity_bytes"] == 1 << 20
    assert not (tmp_path / "new").exists()  # checking creates nothing


def test_check_config_refuses_an_unwritable_path(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        f = tmp_path / "file"
        f.write_text("x")
        with pytest.raises(ConfigError, match=r"key 'local\.ssd\.path'.*not a directory"):
            check(cfg({"path": str(f / "sub"), "capacity_bytes": 1}))
        return
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    with pytest.raises(ConfigError, match=r"key 'local\.ssd\.path'"):
        check(cfg({"path": str(ro / "sub"), "capacity_bytes": 1}))


def test_check_config_refuses_a_directory_others_can_write(tmp_path: Path) -> None:
    """The engine refuses it at start (``store/private_files``); check-config says so first."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ConfigError, match=r"key 'local\.ssd\.path'.*writable by other users"):
        check(cfg({"path": str(shared), "capacity_bytes": 1 << 20}))
    shared.chmod(0o755)
    check(cfg({"path": str(shared), "capacity_bytes": 1 << 20}))


def test_check_config_refuses_more_than_the_free_space(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    with pytest.raises(ConfigError, match=r"key 'local\.ssd\.capacity_bytes'"):
        check(cfg({"path": str(tmp_path), "capacity_bytes": free * 2 + (1 << 30)}))
    check_ssd_path(str(tmp_path), 1 << 20)


# ----------------------------------------------------------------------------- scheduler side


def settings(tmp_path: Path, persist: bool, interval: float = 5.0) -> SimpleNamespace:
    c = parse(StoreConnectorConfig, {"local": {"capacity_bytes": 8 * 4000, "ssd": {
        "path": str(tmp_path), "capacity_bytes": 16 * 4096, "persist": persist,
        "persist_interval_s": interval}}}, where="x")
    return SimpleNamespace(cfg=c, page_bytes=4000, num_pages=8, world_size=1, fingerprint="fp0")


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _scheduler(s: SimpleNamespace, clock: Clock):
    from ascend_offload.connectors.store.ssd import SsdScheduler
    from ascend_offload.store.local import LocalStore

    return SsdScheduler(s, LocalStore(8 * 4000, 4000, with_data=False), clock=clock)  # type: ignore[arg-type]


def test_persisted_index_is_throttled_written_at_close_and_restored(tmp_path: Path) -> None:
    clock = Clock()
    s = settings(tmp_path, persist=True, interval=5.0)
    a = _scheduler(s, clock)
    a.ssd.allocate(["k0", "k1"])
    a.ssd.mark_ready(["k0", "k1"])
    assert not a.maybe_persist()  # changed, but written at most every 5 s
    clock.t += 5.0
    assert a.maybe_persist() and a.index_path.exists()
    assert not a.maybe_persist()  # unchanged
    with pytest.raises(ConfigError, match="in use by another engine"):
        _scheduler(s, clock)
    a.ssd.allocate(["k2"])
    a.ssd.mark_ready(["k2"])
    a.close()  # the last change is written at close, whatever the interval
    b = _scheduler(s, clock)
    assert b.ssd.lookup_prefix(["k0", "k1", "k2"]) == 3 and b.ssd.slot("k2") == 2
    b.close()
    c = _scheduler(settings(tmp_path, persist=False), clock)  # without persist: forgotten
    assert len(c.ssd) == 0 and not c.index_path.exists()
    c.close()


def test_an_idle_engines_last_change_is_written_without_a_step_or_close(tmp_path: Path) -> None:
    """vLLM may kill the engine core before its connector's shutdown runs: the persister
    thread writes the last change within the interval, with no scheduler call after it."""

    from ascend_offload.store.ssd.index import read_index_file

    a = _scheduler(settings(tmp_path, persist=True, interval=0.05), time.monotonic)  # type: ignore[arg-type]
    try:
        a.ssd.allocate(["k0", "k1"])
        a.ssd.mark_ready(["k0", "k1"])
        deadline = time.monotonic() + 10
        while not (a.index_path.exists() and len(read_index_file(a.index_path)["entries"]) == 2):
            assert time.monotonic() < deadline, "the idle change was never written"
            time.sleep(0.02)
        assert [k for k, _ in read_index_file(a.index_path)["entries"]] == ["k0", "k1"]
    finally:
        a.close()
    assert not any(t.name == "ascend-ssd-index" and t.is_alive() for t in threading.enumerate())


def test_an_index_of_another_geometry_is_not_restored(tmp_path: Path) -> None:
    clock = Clock()
    a = _scheduler(settings(tmp_path, persist=True), clock)
    a.ssd.allocate(["k0"])
    a.ssd.mark_ready(["k0"])
    a.close()
    s = settings(tmp_path, persist=True)
    s.page_bytes = 3000  # another model layout would also change the fingerprint; here only the page
    b = _scheduler(s, clock)
    assert len(b.ssd) == 0
    b.close()
