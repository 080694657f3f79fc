"""MemcacheStore over the fake Memcache client (same API as memcache_hybrid's, asserted
in test_memcache_fake_api.py): round trips, sharing, eviction as a miss, outages."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
import torch

from ascend_offload.bench.stores import shared_store_from_config
from ascend_offload.bench.stores.memcache import MemcacheStore, memcache_store_from_config
from ascend_offload.config import ConfigError, MemcacheStoreConfig, StoreConnectorConfig, parse
from ascend_offload.store.base import StoreError
from tests.support.fake_ascend import FakeDistributedObjectStore, FakeMemcacheCluster

PAGE = 256


def payload(seed: int, n: int, size: int = PAGE) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, size), dtype=torch.uint8, generator=g)


def make(cluster: FakeMemcacheCluster, **kw) -> MemcacheStore:
    args = dict(page_bytes=PAGE, staging_bytes=64 * PAGE, retry_interval_s=3600.0, call_timeout_s=30.0)
    args.update(kw)
    client = FakeDistributedObjectStore(cluster)
    client.init(0, True)
    return MemcacheStore(client, **args)


def put(store: MemcacheStore, keys: list[str], data: torch.Tensor) -> None:
    hs = store.allocate(keys, [data[0].numel()] * len(keys))
    assert hs is not None and all(h is not None for h in hs)
    store.write_batch(hs, data)  # type: ignore[arg-type]
    store.commit(hs)  # type: ignore[arg-type]


@pytest.fixture
def cluster() -> FakeMemcacheCluster:
    return FakeMemcacheCluster()


def test_round_trip_between_two_clients_is_byte_equal(cluster: FakeMemcacheCluster) -> None:
    a, b = make(cluster), make(cluster)
    data = payload(1, 4)
    keys = [f"k{i}" for i in range(4)]
    put(a, keys, data)
    assert b.lookup_prefix([*keys, "absent"]) == 4
    pin = b.pin(keys)
    assert pin is not None
    out = torch.zeros_like(data)
    b.read_batch(pin, keys, out)
    assert torch.equal(out, data)
    rows = torch.zeros(6, PAGE, dtype=torch.uint8)
    b.read_rows(pin, keys, rows, [5, 0, 2, 3])
    assert torch.equal(rows[[5, 0, 2, 3]], data)
    plane, prow = b.pinned_rows(pin, keys) or (None, [])
    assert plane is not None and torch.equal(plane[prow], data)
    b.unpin(pin)
    st = a.stats()
    assert st.committed_objects == 4 and st.bytes_written == 4 * PAGE
    assert b.stats().reads == 4 and b.stats().pinned_objects == 0
    assert a.stats().free_pages == a.stats().total_pages  # staging freed after the put


def test_object_larger_than_a_page_spans_pages(cluster: FakeMemcacheCluster) -> None:
    a, b = make(cluster), make(cluster)
    big = payload(2, 1, 3 * PAGE + 17)[0]
    (h,) = a.allocate(["big"], [big.numel()]) or [None]
    assert h is not None
    a.write(h, 0, big[:100])
    a.write(h, 100, big[100:])
    a.commit([h])
    assert "batch_put_from_layers" in cluster.calls
    pin = b.pin(["big"])
    assert pin is not None
    out = torch.zeros_like(big)
    b.read(pin, "big", 0, out)
    assert torch.equal(out, big)
    part = torch.zeros(50, dtype=torch.uint8)
    b.read(pin, "big", 2 * PAGE + 200, part)  # across a page boundary
    assert torch.equal(part, big[2 * PAGE + 200:2 * PAGE + 250])
    with pytest.raises(StoreError, match="outside object"):
        b.read(pin, "big", 3 * PAGE, torch.zeros(18, dtype=torch.uint8))
    b.unpin(pin)


def test_pending_is_invisible_and_abort_frees(cluster: FakeMemcacheCluster) -> None:
    a, b = make(cluster), make(cluster)
    hs = a.allocate(["p"], [PAGE])
    assert hs is not None and hs[0] is not None
    a.write_batch(hs, payload(3, 1))  # type: ignore[arg-type]
    assert b.lookup_prefix(["p"]) == 0 and b.pin(["p"]) is None
    assert a.allocate(["p"], [PAGE]) == [None]  # pending here already: not written twice
    a.abort(hs)  # type: ignore[arg-type]
    assert a.stats().aborted_objects == 1 and a.stats().pending_objects == 0
    assert b.lookup_prefix(["p"]) == 0
    with pytest.raises(StoreError, match="not a pending allocation"):
        a.commit(hs)  # type: ignore[arg-type]


def test_present_keys_are_not_stored_again(cluster: FakeMemcacheCluster) -> None:
    a, b = make(cluster), make(cluster)
    put(a, ["x"], payload(4, 1))
    hs = b.allocate(["x", "y", "y"], [PAGE] * 3)
    assert hs is not None and hs[0] is None and hs[1] is not None and hs[2] is None
    assert b.stats().duplicate_stores == 2


def test_duplicate_put_from_a_race_counts_as_duplicate(cluster: FakeMemcacheCluster) -> None:
    a, b = make(cluster), make(cluster)
    ha, hb = a.allocate(["r"], [PAGE]), b.allocate(["r"], [PAGE])  # both see it absent
    assert ha and hb and ha[0] and hb[0]
    a.write_batch(ha, payload(5, 1))  # type: ignore[arg-type]
    b.write_batch(hb, payload(6, 1))  # type: ignore[arg-type]
    a.commit(ha)  # type: ignore[arg-type]
    b.commit(hb)  # type: ignore[arg-type]
    assert a.stats().committed_objects == 1 and b.stats().duplicate_stores == 1
    pin = b.pin(["r"])
    assert pin is not None
    out = torch.zeros(1, PAGE, dtype=torch.uint8)
    b.read_batch(pin, ["r"], out)
    assert torch.equal(out, payload(5, 1))  # the first complete put wins


def test_eviction_is_a_miss_never_an_error(cluster: FakeMemcacheCluster) -> None:
    small = FakeMemcacheCluster(capacity_bytes=4 * PAGE)
    a = make(small)
    put(a, [f"e{i}" for i in range(6)], payload(7, 6))  # the first two are evicted
    assert small.evicted == 2
    assert a.lookup_prefix(["e0", "e1", "e2"]) == 0
    assert a.pin(["e0", "e5"]) is None
    assert a.lookup_prefix(["e2", "e3", "e4", "e5"]) == 4
    # evicted between the lookup and the pin
    small.evict(["e3"])
    assert a.pin(["e2", "e3"]) is None
    pin = a.pin(["e4"])
    assert pin is not None
    a.unpin(pin)
    assert a.stats().free_pages == a.stats().total_pages  # failed pins left no pages behind


def test_outage_is_misses_and_skipped_saves_logged_once(cluster: FakeMemcacheCluster,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    a = make(cluster, retry_interval_s=0.0)
    put(a, ["o"], payload(8, 1))
    cluster.down = True
    with caplog.at_level(logging.WARNING, logger="ascend_offload.bench.stores.memcache"):
        assert a.lookup_prefix(["o"]) == 0
        assert a.pin(["o"]) is None
        assert a.allocate(["n"], [PAGE]) is None
        assert a.lookup_prefix(["o"]) == 0
        assert a.down and a.outages == 1
        cluster.down = False
        assert a.lookup_prefix(["o"]) == 1
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("unreachable" in m for m in msgs) == 1, msgs
    assert sum("resumed" in m for m in msgs) == 1, msgs
    assert not a.down and a.stats().skipped_stores == 1


def test_outage_commit_is_a_skipped_save(cluster: FakeMemcacheCluster) -> None:
    a = make(cluster, retry_interval_s=0.0)
    hs = a.allocate(["c"], [PAGE])
    assert hs and hs[0]
    a.write_batch(hs, payload(9, 1))  # type: ignore[arg-type]
    cluster.down = True
    a.commit(hs)  # type: ignore[arg-type]
    assert a.stats().skipped_stores == 1 and a.stats().committed_objects == 0
    assert a.stats().free_pages == a.stats().total_pages
    cluster.down = False
    assert a.lookup_prefix(["c"]) == 0


def test_while_down_calls_do_not_reach_the_service(cluster: FakeMemcacheCluster) -> None:
    a = make(cluster, retry_interval_s=3600.0)
    cluster.down = True
    assert a.lookup_prefix(["z"]) == 0
    n = len(cluster.calls)
    assert a.lookup_prefix(["z"]) == 0 and a.pin(["z"]) is None and a.allocate(["z"], [PAGE]) is None
    assert len(cluster.calls) == n  # answered from the outage state for retry_interval_s


def test_a_service_that_stops_answering_is_bounded(cluster: FakeMemcacheCluster,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A call that does not come back within call_timeout_s is an outage; a put that
    overran quarantines its staging pages (the library may still read them), a put
    never sent (no call thread free) frees them."""
    # Calls that answer get a deadline no loaded machine overruns; only the hung ones
    # below get the short one, so the outage is the hang and nothing else.
    a = make(cluster, call_timeout_s=30.0, retry_interval_s=0.0, call_threads=1)
    put(a, ["h0"], payload(10, 1))
    h1, h2 = a.allocate(["h1"], [PAGE]), a.allocate(["h2"], [PAGE])
    assert h1 and h1[0] and h2 and h2[0]
    a.write_batch(h1, payload(11, 1))  # type: ignore[arg-type]
    a.write_batch(h2, payload(12, 1))  # type: ignore[arg-type]
    a._calls.timeout_s = 0.05
    cluster.hang()
    try:
        with caplog.at_level(logging.WARNING, logger="ascend_offload.bench.stores.memcache"):
            a.commit(h1)  # type: ignore[arg-type]
            assert a.stats().skipped_stores == 1 and a.quarantined_pages == 1
            # the only call thread is held: calls fail at once, not after a deadline
            assert a.lookup_prefix(["h0"]) == 0 and a.pin(["h0"]) is None
            a.commit(h2)  # type: ignore[arg-type]
            st = a.stats()
            assert st.skipped_stores == 2 and a.quarantined_pages == 1
            assert st.free_pages == st.total_pages - 1  # only the overrun put's page is held
        assert sum("unreachable" in r.getMessage() for r in caplog.records) == 1
    finally:
        cluster.unhang()
    a._calls.timeout_s = 30.0
    done = threading.Event()
    a._calls._pool.submit(done.set)  # the overrun call returned: its thread is free again
    assert done.wait(10)
    assert a.lookup_prefix(["h0"]) == 1 and not a.down
    a.close()


def test_read_without_pin_is_refused(cluster: FakeMemcacheCluster) -> None:
    a = make(cluster)
    put(a, ["k"], payload(12, 1))
    pin = a.pin(["k"])
    assert pin is not None
    a.unpin(pin)
    with pytest.raises(StoreError, match="without an active pin"):
        a.read(pin, "k", 0, torch.zeros(4, dtype=torch.uint8))


def test_config_section_and_factory(cluster: FakeMemcacheCluster) -> None:
    cfg = parse(StoreConnectorConfig, {"backend": "memcache", "memcache": {
        "meta_service_url": "tcp://10.0.0.1:5000", "protocol": "device_rdma", "dram_size": "2GB"}},
        where="store config")
    assert cfg.memcache.protocol == "device_rdma" and cfg.memcache.hbm_size == "0"
    store = memcache_store_from_config(cfg.memcache, PAGE, staging_bytes=16 * PAGE,
                                       client=FakeDistributedObjectStore(cluster))
    assert store.page_bytes == PAGE and store.stats().total_pages == 16
    with pytest.raises(ConfigError, match=r"key 'memcache\.dram_size'"):
        parse(StoreConnectorConfig, {"backend": "memcache", "memcache": {"dram_size": "lots"}}, where="x")
    with pytest.raises(ConfigError, match=r"key 'memcache\.protocol'"):
        parse(StoreConnectorConfig, {"backend": "memcache", "memcache": {"protocol": "udp"}}, where="x")
    with pytest.raises(StoreError, match="meta_service_url"):
        memcache_store_from_config(MemcacheStoreConfig(), PAGE)
    with pytest.raises(StoreError, match="meta_service_url"):
        shared_store_from_config(parse(StoreConnectorConfig, {"backend": "memcache"}, where="x"), PAGE)
    with pytest.raises(StoreError, match="not a shared store"):
        shared_store_from_config(parse(StoreConnectorConfig, {}, where="x"), PAGE)


def test_large_batches_are_split(cluster: FakeMemcacheCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    import ascend_offload.bench.stores.memcache as mc

    monkeypatch.setattr(mc, "MAX_BATCH", 2)
    a, b = make(cluster), make(cluster)
    keys = [f"s{i}" for i in range(5)]
    data = payload(13, 5)
    put(a, keys, data)
    assert cluster.calls.count("batch_put_from") == 3 and cluster.calls.count("batch_is_exist") == 3
    assert b.lookup_prefix(keys) == 5
    pin = b.pin(keys)
    assert pin is not None
    out = torch.zeros_like(data)
    b.read_batch(pin, keys, out)
    assert torch.equal(out, data)
    assert cluster.calls.count("batch_get_key_info") == 3 and cluster.calls.count("batch_get_into") == 3


def test_a_refused_batch_is_an_error_for_its_keys(cluster: FakeMemcacheCluster,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """The real client answers a batch it refuses as a whole with a shorter list (or
    none); that is an error for every key, never an exception or a wrong answer."""

    class Refusing(FakeDistributedObjectStore):
        def batch_is_exist(self, keys) -> list[int]:  # type: ignore[override]
            return [-3000]

        def batch_get_key_info(self, keys, flag=1) -> list[Any]:  # type: ignore[override]
            return []

    client = Refusing(cluster)
    client.init(0, True)
    s = MemcacheStore(client, page_bytes=PAGE, staging_bytes=8 * PAGE)
    with caplog.at_level(logging.WARNING, logger="ascend_offload.bench.stores.memcache"):
        assert s.lookup_prefix(["a", "b"]) == 0
    assert "answered 1 codes for 2 keys" in caplog.text
    assert s.pin(["a"]) is None
    assert not s.down
