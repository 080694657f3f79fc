"""The shared tier on Memcache (store/shared/memcache.py) over the fake Memcache client
(same API as memcache_hybrid's, asserted in test_memcache_fake_api.py): ranks publish
from registered pages and fetch into reserved pages, the scheduler's metadata-only
client sees whole blocks only, eviction is a safe miss, an unreachable or hung meta
service is an outage logged once with the background probe bringing it back. The real
meta service answering these lookups: tests/integration/test_memcache_meta.py."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest
import torch

from ascend_offload.store.base import StoreError
from ascend_offload.store.book.prefix_jobs import PrefixJobs
from ascend_offload.store.local import LocalStore
from ascend_offload.store.shared.memcache import MAX_BATCH, RemoteIndex, RemotePages
from ascend_offload.store.shared.remote_fetch import RemoteFetches
from tests.support.fake_ascend import FakeDistributedObjectStore, FakeMemcacheCluster

PAGES = 8
ROWS = (48, 80)  # bytes of one block's row in each layer plane
CFG = SimpleNamespace(meta_service_url="tcp://127.0.0.1:1", config_store_url="tcp://127.0.0.1:2",
                      call_timeout_s=30.0, retry_interval_s=0.01, replica_num=1)


def client(cluster: FakeMemcacheCluster, *, data_path: bool = True) -> FakeDistributedObjectStore:
    c = FakeDistributedObjectStore(cluster)
    c.init(0, data_path)
    return c


def planes(seed: int | None, rows: tuple[int, ...] = ROWS) -> dict[str, torch.Tensor]:
    """A rank's page planes; ``seed`` None: zeros (a reader)."""
    g = torch.Generator().manual_seed(seed or 0)
    return {f"model.layers.{i}.attn": (torch.randint(0, 256, (PAGES, n), dtype=torch.uint8, generator=g)
                                       if seed is not None else torch.zeros(PAGES, n, dtype=torch.uint8))
            for i, n in enumerate(rows)}


def ranks(cluster: FakeMemcacheCluster, seed: int | None, world: int = 2, cfg: SimpleNamespace = CFG,
          rows: tuple[int, ...] = ROWS) -> list[RemotePages]:
    return [RemotePages(cfg, planes(None if seed is None else seed + r, rows), r, client=client(cluster))
            for r in range(world)]


def block(pages: RemotePages, page: int) -> list[torch.Tensor]:
    return [p[page] for p in pages._planes]


def test_ranks_publish_and_another_engine_fetches_whole_blocks() -> None:
    cluster = FakeMemcacheCluster()
    writers, readers = ranks(cluster, 10), ranks(cluster, None)
    index = RemoteIndex(CFG, world_size=2, client=client(cluster, data_path=False))
    keys = ["b0", "b1", "b2"]
    try:
        assert index.lookup_prefix(keys) == 0
        writers[0].publish(keys, [0, 1, 2])
        writers[1].publish(keys[:2], [0, 1])  # rank 1 lacks b2: b2 is not a whole block
        assert writers[0].counts.published_blocks == 3 and writers[1].counts.published_blocks == 2
        assert index.lookup_prefix(keys) == 2
        assert index.counters() == {"remote_lookups": 2, "remote_hit_blocks": 2, "remote_outages": 0,
                                    "remote_retries": 0}
        # one object per block and rank: its rows of every layer, in layer order
        assert set(cluster.objects) == {"b0@r0", "b1@r0", "b2@r0", "b0@r1", "b1@r1"}
        # (then the 16-byte trailer a fetch verifies: key and payload checksums)
        assert cluster.objects["b1@r1"][:-16] == b"".join(bytes(t.numpy()) for t in block(writers[1], 1))
        assert "batch_put_from_layers" in cluster.calls  # two layer planes: one buffer per row
        writers[0].publish(["b0"], [5])
        assert writers[0].counts.publish_duplicates == 1
        for w, r in zip(writers, readers, strict=True):
            assert r.fetch(["b1", "b0"], [6, 3]) == (True, True)
            for got, want in zip(block(r, 6) + block(r, 3), block(w, 1) + block(w, 0), strict=True):
                assert torch.equal(got, want)
            assert r.counts.fetched_blocks == 2
    finally:
        for p in [*writers, *readers]:
            p.close()
        index.close()


def test_one_layer_plane_uses_the_plain_batch_calls() -> None:
    cluster = FakeMemcacheCluster()
    (w,), (r,) = ranks(cluster, 3, world=1, rows=(64,)), ranks(cluster, None, world=1, rows=(64,))
    w.publish(["x"], [2])
    assert r.fetch(["x"], [7]) == (True, True)
    assert torch.equal(block(r, 7)[0], block(w, 2)[0])
    # the row and its checksum trailer are two spans: the _layers calls even for one plane
    assert "batch_put_from_layers" in cluster.calls and "batch_get_into_layers" in cluster.calls
    w.close()
    r.close()


def test_evicted_block_is_a_safe_miss() -> None:
    cluster = FakeMemcacheCluster()
    (w,), (r,) = ranks(cluster, 1, world=1), ranks(cluster, None, world=1)
    w.publish(["a", "b"], [0, 1])
    cluster.evict(["b@r0"])
    assert r.fetch(["a", "b"], [0, 1]) == (False, True)  # a miss; nothing can still write the pages
    assert r.counts.fetched_blocks == 1 and r.counts.fetch_failed_blocks == 1
    assert r.health.up()
    w.close()
    r.close()


def test_long_lookups_are_split_into_client_sized_batches() -> None:
    cluster = FakeMemcacheCluster()
    index = RemoteIndex(CFG, world_size=2, client=client(cluster, data_path=False))
    keys = [f"k{i}" for i in range(MAX_BATCH)]  # 2 * MAX_BATCH shards
    with cluster.lock:
        for k in keys[:-1]:
            cluster.objects[f"{k}@r0"] = cluster.objects[f"{k}@r1"] = b"x"
    assert index.lookup_prefix(keys) == MAX_BATCH - 1
    assert cluster.calls.count("batch_is_exist") == 2
    index.close()


def wait_up(up: object) -> None:
    for _ in range(2000):
        if up():  # type: ignore[operator]
            return
        threading.Event().wait(0.01)
    raise AssertionError("the probe never brought the tier back")


def test_unreachable_meta_service_is_a_miss_logged_once_then_probed_back(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="ascend_offload.store.shared.tier")
    cluster = FakeMemcacheCluster()
    (w,) = ranks(cluster, 4, world=1)
    index = RemoteIndex(CFG, world_size=1, client=client(cluster, data_path=False))
    try:
        w.publish(["a"], [0])
        assert index.lookup_prefix(["a"]) == 1
        cluster.down = True
        assert index.lookup_prefix(["a"]) == 0
        w.publish(["b"], [1])
        assert w.fetch(["a"], [2]) == (False, True)
        before = len(cluster.calls)
        for _ in range(10):
            assert index.lookup_prefix(["a"]) == 0
            w.publish(["c"], [3])
        data_calls = [c for c in cluster.calls[before:] if c != "batch_is_exist"]  # the probes ask
        assert data_calls == [] and w.counts.publish_skipped == 11
        lines = [r.getMessage() for r in caplog.records if "unreachable from" in r.getMessage()]
        assert len(lines) == 2 and "Memcache meta service tcp://127.0.0.1:1" in lines[0]
        assert index.health.outages == 1 and w.health.outages == 1
        cluster.down = False
        wait_up(lambda: index.available() and w.health.up())
        assert index.lookup_prefix(["a"]) == 1
        w.publish(["b"], [1])
        assert w.counts.published_blocks == 2
        assert sum("store service resumed" in r.getMessage() for r in caplog.records) == 2
    finally:
        w.close()
        index.close()
        cluster.down = False


def test_hung_get_keeps_its_pages_out_of_use_and_the_scheduler_never_waits_past_its_deadline() -> None:
    cfg = SimpleNamespace(**{**vars(CFG), "call_timeout_s": 0.2})
    cluster = FakeMemcacheCluster()
    (w,) = ranks(cluster, 5, world=1, cfg=cfg)
    (r,) = ranks(cluster, None, world=1, cfg=cfg)
    index = RemoteIndex(cfg, world_size=1, client=client(cluster, data_path=False))
    try:
        w.publish(["a"], [0])
        cluster.hang()
        assert r.fetch(["a"], [1]) == (False, False)  # the library may still write page 1
        assert index.lookup_prefix(["a"]) == 0  # a hung lookup is a miss after the deadline
        assert index.health.outages == 1 and r.health.outages == 1
        cluster.unhang()
        wait_up(lambda: index.available() and r.health.up())
        assert r.fetch(["a"], [2]) == (True, True)
        assert torch.equal(block(r, 2)[0], block(w, 0)[0])
    finally:
        cluster.unhang()
        for p in (w, r):
            p.close()
        index.close()


def test_a_refused_registration_closes_the_client() -> None:
    class Refusing(FakeDistributedObjectStore):
        def register_buffer(self, buffer_ptr: int, size: int) -> int:
            return -1

    c = Refusing(FakeMemcacheCluster())
    c.init(0, True)
    with pytest.raises(StoreError, match="registering"):
        RemotePages(CFG, planes(1), 0, client=c)
    assert not c.ready


def test_scheduler_fetch_flow_over_memcache() -> None:
    """store/shared/remote_fetch.py with the Memcache tier: a prefix only the meta service has
    is reserved, fetched by every rank, then offered from the local pages."""
    cluster = FakeMemcacheCluster()
    writers, readers = ranks(cluster, 20), ranks(cluster, None)
    index = RemoteIndex(CFG, world_size=2, client=client(cluster, data_path=False))
    keys = [f"k{i}" for i in range(3)]
    page_bytes = sum(ROWS)
    local = LocalStore(PAGES * page_bytes, page_bytes, with_data=False)
    fetches = RemoteFetches(local, index, page_bytes=page_bytes, world_size=2, timeout_s=30.0)
    book = PrefixJobs(local, block_size=4, page_bytes=page_bytes, world_size=2, min_load_blocks=1,
                      remote=fetches)
    try:
        for w in writers:
            w.publish(keys, [0, 1, 2])
        assert book.lookup("r", 0, 3, lambda n: keys[:n]) is None  # the ranks fetch first
        (job,) = fetches.take_jobs()
        assert job.keys == tuple(keys)
        for r in readers:
            ok, reusable = r.fetch(list(job.keys), list(job.pages))
            assert ok and reusable
            fetches.report({job.job_id: 1}, {}, {})
        assert book.lookup("r", 0, 3, lambda n: keys[:n]) == 12
        for w, r in zip(writers, readers, strict=True):
            for i, page in enumerate(job.pages):
                for got, want in zip(block(r, page), block(w, i), strict=True):
                    assert torch.equal(got, want)
    finally:
        for p in [*writers, *readers]:
            p.close()
        index.close()


def test_store_connector_runs_backend_memcache_as_its_shared_tier() -> None:
    """Backend 'memcache' is accepted at start (the next check is the KV cache config) and
    is a shared tier; without a meta service URL the tier fails naming the key."""
    from ascend_offload.config import ConfigError, StoreConnectorConfig, parse
    from ascend_offload.connectors.store.settings import StoreSettings
    from ascend_offload.store.shared.backends import shared_tier_index, shared_tier_pages

    extra = {"backend": "memcache", "memcache": {"meta_service_url": "tcp://127.0.0.1:1"}}
    vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))
    with pytest.raises(ConfigError, match="needs the KV cache config"):
        StoreSettings.from_vllm(vllm_config, None)  # type: ignore[arg-type]
    cfg = parse(StoreConnectorConfig, extra, where="store config")
    s = StoreSettings(cfg=cfg, block_size=16, hash_ratio=1, object_bytes=128, page_bytes=128, num_pages=4,
                      world_size=1, fingerprint="f", engine_id="e")
    assert s.shared_tier
    bare = parse(StoreConnectorConfig, {"backend": "memcache"}, where="store config")
    with pytest.raises(StoreError, match=r"memcache\.meta_service_url"):
        shared_tier_index(bare, 1)
    with pytest.raises(StoreError, match=r"memcache\.meta_service_url"):
        shared_tier_pages(bare, planes(1), 0)
