"""The real Memcache metadata path on loopback: a ``memcache_hybrid`` meta service on
127.0.0.1 and a metadata-only client (``init_bm=False``, no Ascend driver needed)
answering existence lookups, directly, through ``MemcacheStore`` and through the
connector's shared tier (``store/shared/memcache.py: RemoteIndex``); the meta service
killed mid-run turns lookups into misses (one log line), and they answer again when it
is back. The data path (puts, gets) needs the driver: tests/npu covers it.

The client runs in a child process: the library's client, when a call is in flight
as its link breaks, waits up to 60 s and drains for 120 s on close; the child exits
with ``os._exit`` and the test bounds it with a deadline.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ascend_offload.store.services.memcache_meta import MemcacheMeta, available

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not available(), reason="memcache_hybrid not installed (pip install 'ascend-offload[ascend]')"),
]

CHILD = textwrap.dedent("""
    import json, logging, os, sys, time
    from ascend_offload.bench.stores.memcache import MemcacheStore
    from ascend_offload.store.shared.memcache import metadata_client

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="LOG %(message)s")

    def say(**kw):
        print("@@" + json.dumps(kw), flush=True)  # the library logs on stdout too

    class MetadataOnly:
        # The real client with its data path off: existence and size lookups reach the real
        # meta service; register_buffer is skipped (it needs the data path).
        def __init__(self, client):
            self.client = client
        def __getattr__(self, name):
            return getattr(self.client, name)
        def register_buffer(self, ptr, size):
            return 0

    client = metadata_client(sys.argv[1], sys.argv[2])
    raw = client.batch_is_exist(["k0", "k1"])
    sizes = [i.size() for i in client.batch_get_key_info(["k0"])]
    store = MemcacheStore(MetadataOnly(client), page_bytes=4096, staging_bytes=1 << 16,
                          call_timeout_s=3.0, retry_interval_s=2.0)
    hs = store.allocate(["k0", "k1"], [4096, 4096])
    allocated = hs is not None and all(h is not None for h in hs)
    store.abort(hs or [])
    say(step="up", raw=raw, sizes=sizes, lookup=store.lookup_prefix(["k0", "k1"]),
        pin=store.pin(["k0"]) is not None, allocated=allocated, down=store.down,
        misses=store.stats().miss_objects)
    sys.stdin.readline()  # the meta service was killed
    end = time.monotonic() + 20
    while not store.down and time.monotonic() < end:
        store.lookup_prefix(["k0"])
        time.sleep(0.1)
    t = time.monotonic()
    hits = [store.lookup_prefix(["k0"]) for _ in range(5)]  # answered from the outage state (retry_interval_s)
    say(step="down", down=store.down, outages=store.outages, hits=hits,
        allocate=store.allocate(["k2"], [4096]), pin=store.pin(["k0"]) is not None,
        fast=time.monotonic() - t < 1.0)
    sys.stdin.readline()  # the meta service is back
    end = time.monotonic() + 60
    while store.down and time.monotonic() < end:
        store.lookup_prefix(["k0"])
        time.sleep(0.2)
    say(step="back", down=store.down, outages=store.outages, raw=client.batch_is_exist(["k0"]))
    os._exit(0)
""")


@pytest.fixture
def meta(tmp_path: Path) -> Iterator[MemcacheMeta]:
    with MemcacheMeta(tmp_path / "meta") as m:
        yield m


def _line(proc: subprocess.Popen[str]) -> dict:
    """The child's next report (its other stdout lines are the library's log)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("@@"):
            return json.loads(line[2:])
    raise AssertionError(f"client exited early: {proc.stderr.read() if proc.stderr else ''}")


def _service_back(meta: MemcacheMeta, proc: subprocess.Popen[str]) -> tuple[dict, list[str]]:
    """Restart the meta service, tell the child, and return its report and its log lines
    once it exited."""
    meta.start()
    assert proc.stdin is not None
    proc.stdin.write("back\n")
    proc.stdin.flush()
    back = _line(proc)
    proc.wait(30)
    logs = [ln for ln in (proc.stderr.read() if proc.stderr else "").splitlines() if ln.startswith("LOG")]
    return back, logs


def test_metadata_client_answers_existence_and_survives_a_meta_restart(meta: MemcacheMeta) -> None:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, meta.meta_service_url, meta.config_store_url],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        up = _line(proc)
        assert up["raw"] == [0, 0]  # a real answer: absent (not an error code)
        assert up["sizes"] == [0]
        assert up["lookup"] == 0 and up["misses"] == 2 and not up["down"]
        assert up["pin"] is False  # absent: a miss
        assert up["allocated"] is True  # absent keys get pending staging objects

        meta.stop()
        assert proc.stdin is not None
        proc.stdin.write("killed\n")
        proc.stdin.flush()
        down = _line(proc)
        assert down["down"] and down["outages"] == 1
        assert down["hits"] == [0] * 5 and down["allocate"] is None and down["pin"] is False
        assert down["fast"], "lookups during an outage must not wait on the dead service"

        back, logs = _service_back(meta, proc)
        assert not back["down"] and back["outages"] == 1 and back["raw"] == [0]
        assert sum("unreachable" in ln for ln in logs) == 1, logs
        assert sum("resumed" in ln for ln in logs) == 1, logs
        print(f"memcache meta: lookups answered, outage logged once, resumed after restart ({meta.meta_service_url})")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


TIER_CHILD = textwrap.dedent("""
    import json, logging, os, sys, threading, time
    from types import SimpleNamespace
    from ascend_offload.store.shared.memcache import RemoteIndex, metadata_client

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="LOG %(message)s")

    def say(**kw):
        print("@@" + json.dumps(kw), flush=True)

    class Counting:
        # The real metadata-only client; counts the lookups of the scheduler's thread
        # (the background probe asks from its own).
        def __init__(self, client):
            self.client, self.calls = client, 0
        def __getattr__(self, name):
            return getattr(self.client, name)
        def batch_is_exist(self, keys):
            if threading.current_thread() is threading.main_thread():
                self.calls += 1
            return self.client.batch_is_exist(keys)

    cfg = SimpleNamespace(meta_service_url=sys.argv[1], config_store_url=sys.argv[2],
                          call_timeout_s=3.0, retry_interval_s=0.5, replica_num=1)
    client = Counting(metadata_client(cfg.meta_service_url, cfg.config_store_url))
    index = RemoteIndex(cfg, world_size=2, client=client)
    raw = client.batch_is_exist(["k0@r0", "k0@r1"])
    say(step="up", raw=raw, lookup=index.lookup_prefix(["k0", "k1"]), up=index.available(),
        counters=index.counters())
    sys.stdin.readline()  # the meta service was killed
    end = time.monotonic() + 90
    while index.available() and time.monotonic() < end:
        index.lookup_prefix(["k0"])
        time.sleep(0.1)
    calls = client.calls
    hits = [index.lookup_prefix(["k0"]) for _ in range(5)]
    say(step="down", up=index.available(), outages=index.health.outages, hits=hits,
        asked=client.calls - calls)
    sys.stdin.readline()  # the meta service is back
    end = time.monotonic() + 120
    while not index.available() and time.monotonic() < end:
        time.sleep(0.2)
    say(step="back", up=index.available(), outages=index.health.outages,
        lookup=index.lookup_prefix(["k0"]), counters=index.counters())
    os._exit(0)
""")


def test_scheduler_tier_lookups_on_the_real_meta_service(meta: MemcacheMeta) -> None:
    """The connector's scheduler-side shared tier (``store/shared/memcache.py: RemoteIndex``) on the
    real metadata path: real answers (absent, not error codes), a killed meta service is
    an outage logged once during which the scheduler's lookups miss without asking it,
    and the background probe brings it back after a restart."""
    proc = subprocess.Popen([sys.executable, "-c", TIER_CHILD, meta.meta_service_url, meta.config_store_url],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        up = _line(proc)
        assert up["raw"] == [0, 0] and up["lookup"] == 0 and up["up"]
        assert up["counters"] == {"remote_lookups": 1, "remote_hit_blocks": 0, "remote_outages": 0,
                                  "remote_retries": 0}

        meta.stop()
        assert proc.stdin is not None
        proc.stdin.write("killed\n")
        proc.stdin.flush()
        down = _line(proc)
        assert not down["up"] and down["outages"] == 1
        assert down["hits"] == [0] * 5 and down["asked"] == 0  # misses without calling the service

        back, logs = _service_back(meta, proc)
        assert back["up"] and back["outages"] == 1 and back["lookup"] == 0
        assert sum("unreachable from the scheduler" in ln for ln in logs) == 1, logs
        assert sum("store service resumed" in ln for ln in logs) == 1, logs
        print(f"memcache tier: scheduler lookups answered, outage logged once, probed back ({meta.meta_service_url})")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)

CONFS = Path(__file__).resolve().parents[2] / "configs" / "ascend"


def test_shipped_memcache_confs_start_the_real_service_and_client(tmp_path: Path) -> None:
    """configs/ascend/mmc-meta.conf starts the real meta service, and mmc-local.conf sets up
    a real (metadata-only) client against it: Memcache's own parsers accept both files.
    Only the ports (and the log directory) are moved, so the test can run beside others."""
    from ascend_offload.store.services.loopback import free_port as _free_port

    ports = {":5000": f":{_free_port()}", ":6000": f":{_free_port()}", ":8000": f":{_free_port()}"}

    def moved(name: str, extra: str = "") -> Path:
        text = (CONFS / name).read_text()
        for a, b in ports.items():
            text = text.replace(a, b)
        out = tmp_path / name
        out.write_text(text + extra)
        return out

    # (the client's parser refuses keys it does not know, log_path among them)
    meta_conf = moved("mmc-meta.conf", f"\nock.mmc.log_path = {tmp_path}\n")
    local_conf = moved("mmc-local.conf")
    meta = subprocess.Popen([sys.executable, "-c", "from memcache_hybrid import MetaService; MetaService.main()"],
                            env={**os.environ, "MMC_META_CONFIG_PATH": str(meta_conf)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        port = int(ports[":5000"][1:])
        end = time.monotonic() + 30
        while True:
            assert meta.poll() is None, "the meta service refused configs/ascend/mmc-meta.conf"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert time.monotonic() < end, "meta service did not listen"
                time.sleep(0.1)
        client = subprocess.run(
            [sys.executable, "-c", "import os\nfrom memcache_hybrid import DistributedObjectStore\n"
             "s = DistributedObjectStore()\nprint('@@', s.init(0, False), s.batch_is_exist(['k']), flush=True)\n"
             "os._exit(0)"],
            env={**os.environ, "MMC_LOCAL_CONFIG_PATH": str(local_conf)}, capture_output=True, text=True, timeout=60)
        got = [ln for ln in client.stdout.splitlines() if ln.startswith("@@")]
        assert got == ["@@ 0 [0]"], client.stdout[-2000:] + client.stderr[-2000:]
    finally:
        os.killpg(meta.pid, signal.SIGKILL)
        meta.wait(10)


def test_data_path_without_the_driver_fails_at_start_naming_the_service(meta: MemcacheMeta) -> None:
    """``backend: memcache`` built from its config reaches the real client; without the
    Ascend driver its data path refuses to start, a StoreError (engine start fails with
    it), not a crash or a hang."""
    import importlib.util

    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("an Ascend stack is present: tests/npu runs the data path")
    script = textwrap.dedent("""
        import os, sys
        from ascend_offload.config import StoreConnectorConfig, parse
        from ascend_offload.bench.stores import shared_store_from_config
        from ascend_offload.store.base import StoreError
        cfg = parse(StoreConnectorConfig, {"backend": "memcache", "memcache": {
            "meta_service_url": sys.argv[1], "config_store_url": sys.argv[2], "protocol": "host_tcp"}}, where="x")
        try:
            shared_store_from_config(cfg, 4096)
            print("@@ started", flush=True)
        except StoreError as exc:
            print("@@ StoreError", exc, flush=True)
        os._exit(0)
    """)
    out = subprocess.run([sys.executable, "-c", script, meta.meta_service_url, meta.config_store_url],
                         capture_output=True, text=True, timeout=120)
    got = [ln for ln in out.stdout.splitlines() if ln.startswith("@@")]
    assert len(got) == 1 and got[0].startswith("@@ StoreError"), out.stdout[-2000:] + out.stderr[-2000:]
    assert meta.meta_service_url in got[0] and "Ascend driver" in got[0]
