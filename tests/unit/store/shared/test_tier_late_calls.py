"""Shared-tier calls that outlive their deadline (Memcache: ``call_timeout_s``) keep
running inside the library and keep reading (put) or writing (get) the rank's pages:

* a publish past its deadline holds the saved pages: the save's objects stay pending in
  the scheduler's index (never evicted, never handed to another block) until the put
  really ended, with no extra copy; otherwise the late put would store another block's
  bytes under this key for every engine;
* every object carries a checksum trailer (key and payload): a fetched object whose
  bytes are not its block's is a miss, never an answer, and is removed;
* a get past its deadline quarantines its pages only until it really ended: then they
  return to the pool (repeated outages must not shrink it for good).

Driven with the Memcache fakes (tests/support/fake_ascend.py, the real
``memcache_hybrid`` signatures), the connector's ``PrefixWorker`` and ``PrefixScheduler``."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import torch

from ascend_offload.store.local import LocalStore
from ascend_offload.store.shared.memcache import RemotePages
from ascend_offload.store.shared.remote_fetch import RemoteFetches
from tests.support.fake_ascend import FakeDistributedObjectStore, FakeMemcacheCluster

BS = 4
LAYER_SHAPE = (2, BS, 8)  # per block of one layer: (kv, tokens, dims), float32
PAGE = 2 * BS * 8 * 4  # one block of the one layer, bytes
CFG = SimpleNamespace(meta_service_url="tcp://127.0.0.1:1", config_store_url="tcp://127.0.0.1:2",
                      call_timeout_s=0.2, retry_interval_s=0.01, replica_num=1)


class SlowPuts(FakeDistributedObjectStore):
    """A client whose puts block until ``go`` is set, then read the buffers: the real
    library's put that outlived our deadline and runs on."""

    def __init__(self, cluster: FakeMemcacheCluster) -> None:
        super().__init__(cluster)
        self.go = threading.Event()
        self.init(0, True)

    def batch_put_from_layers(self, *args: Any, **kw: Any) -> list[int]:
        assert self.go.wait(10.0), "the test never released the put"
        return super().batch_put_from_layers(*args, **kw)


def wait_for(what: Callable[[], Any], timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (got := what()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
    return got


def _stack(num_pages: int = 4) -> tuple[Any, dict[str, list[int]], Any, dict[str, torch.Tensor]]:
    from ascend_offload.config import parse_extra_config
    from ascend_offload.connectors.store.scheduler import PrefixScheduler
    from ascend_offload.connectors.store.settings import NAME, StoreSettings
    from ascend_offload.connectors.store.worker import PrefixWorker

    cfg = parse_extra_config(NAME, {"local": {"capacity_bytes": num_pages * PAGE}})
    settings = StoreSettings(cfg=cfg, block_size=BS, hash_ratio=1, object_bytes=PAGE, page_bytes=PAGE,
                             num_pages=num_pages, world_size=1, fingerprint="fp", engine_id="e")
    tables: dict[str, list[int]] = {}
    sched = PrefixScheduler(settings, lambda rid: tables[rid])
    kv = {"model.layers.0.attn": torch.randn(8, *LAYER_SHAPE)}
    worker = PrefixWorker(settings, None, SimpleNamespace(num_blocks=8, kv_cache_groups=[]))  # type: ignore[arg-type]
    worker.register_kv_caches(kv)
    return sched, tables, worker, kv


def _request(rid: str, n_tokens: int) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, num_tokens=n_tokens, num_preemptions=0, num_computed_tokens=0,
                           block_hashes=[f"{rid}-h{i}" for i in range(n_tokens // BS)])


def _step(new: Sequence[tuple[str, int, int]]) -> SimpleNamespace:
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c) for r, c, _ in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[], resumed_req_ids=set()),
        num_scheduled_tokens={r: n for r, _, n in new}, preempted_req_ids=None)


def _deliver(sched: Any, wm: Any) -> None:
    from vllm.v1.outputs import KVConnectorOutput

    sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=wm))


def test_a_late_put_holds_its_pages_until_it_ends_and_stores_the_blocks_own_bytes() -> None:
    sched, tables, worker, kv = _stack(num_pages=4)
    cluster = FakeMemcacheCluster()
    slow = SlowPuts(cluster)
    worker.remote = RemotePages(CFG, worker.pool.planes, 0, client=slow)
    try:
        r = _request("r", 9)  # 2 full blocks
        sched.get_num_new_matched_tokens(r, 0)
        tables["r"] = [1, 2, 3]
        sched.update_state_after_alloc(r, SimpleNamespace(get_block_ids=lambda: (tables["r"],)), 0)
        meta = sched.build_connector_meta(_step([("r", 0, 8)]))
        (job,) = meta.saves
        meta.publish = True  # the scheduler saw the service up
        worker.start_load_kv(meta)
        worker.wait_for_save(meta)  # the put outlives its deadline and runs on
        wm = worker.build_worker_meta()
        assert wm is not None and wm.done == {job.job_id: 1} and wm.save_held == {job.job_id: 1}
        _deliver(sched, wm)
        keys = sched._keys(r, 2)
        # the saved pages stay out of use: not committed (not evictable), not reallocated
        assert not any(sched.index.is_committed(k) for k in keys)
        assert sched.index.allocate(["x0", "x1", "x2"], [PAGE] * 3) is None
        # the late put runs now and reads the pages: they still hold the saved blocks
        slow.go.set()
        wm = wait_for(lambda: worker.build_worker_meta())
        assert wm.save_released == {job.job_id: 1}
        _deliver(sched, wm)
        assert all(sched.index.is_committed(k) for k in keys)
        for i, key in enumerate(keys):
            obj = cluster.objects[f"{key}@r0"]
            assert obj[:PAGE] == bytes(kv["model.layers.0.attn"][tables["r"][i]].numpy().tobytes())
    finally:
        slow.go.set()
        worker.close()


def test_a_reset_keeps_held_saves_pending_then_aborts_them() -> None:
    from ascend_offload.store.book.prefix_jobs import PrefixJobs

    index = LocalStore(4 * PAGE, PAGE, with_data=False)
    book = PrefixJobs(index, block_size=BS, page_bytes=PAGE, world_size=1, min_load_blocks=1)
    job = book.plan_save("r", ["a", "b"], [1, 2])
    assert job is not None
    book.hold({job.job_id: 1})
    book.report({job.job_id: 1}, {})
    assert index.stats().pending_objects == 2
    book.reset()  # the late put still reads the pages: they stay pending across the reset
    assert index.stats().pending_objects == 2 and index.allocate(["c", "d", "e"], [PAGE] * 3) is None
    book.release({job.job_id: 1})
    st = index.stats()
    assert (st.pending_objects, st.stored_objects, st.free_pages) == (0, 0, 4)  # aborted, never served


def _ranks(cluster: FakeMemcacheCluster, seed: int | None) -> RemotePages:
    g = torch.Generator().manual_seed(seed or 0)
    planes = {"model.layers.0.attn": torch.randint(0, 256, (8, 64), dtype=torch.uint8, generator=g)
              if seed is not None else torch.zeros(8, 64, dtype=torch.uint8)}
    client = FakeDistributedObjectStore(cluster)
    client.init(0, True)
    return RemotePages(CFG, planes, 0, client=client)


def test_a_poisoned_object_is_a_miss_never_an_answer() -> None:
    cluster = FakeMemcacheCluster()
    w, r = _ranks(cluster, 1), _ranks(cluster, None)
    try:
        w.publish(["b0", "b1"], [0, 1])
        # a late put that read a reused page: b1's key now holds b0's bytes (and trailer)
        cluster.objects["b1@r0"] = cluster.objects["b0@r0"]
        assert r.fetch(["b1"], [5]) == (False, True)
        # a flipped payload byte
        data = bytearray(cluster.objects["b0@r0"])
        data[3] ^= 0x40
        cluster.objects["b0@r0"] = bytes(data)
        assert r.fetch(["b0"], [6]) == (False, True)
        assert r.counts.fetch_corrupt_blocks == 2 and r.counts.fetched_blocks == 0
        assert "b0@r0" not in cluster.objects and "b1@r0" not in cluster.objects  # removed
        w.publish(["b0"], [0])
        assert r.fetch(["b0"], [6]) == (True, True)  # published again
        assert torch.equal(r._planes[0][6], w._planes[0][0])
    finally:
        w.close()
        r.close()


def test_quarantined_fetch_pages_return_once_the_late_get_ended() -> None:
    _, _, worker, _ = _stack(num_pages=4)
    cluster = FakeMemcacheCluster()
    client = FakeDistributedObjectStore(cluster)
    client.init(0, True)
    worker.remote = RemotePages(CFG, worker.pool.planes, 0, client=client)
    from ascend_offload.connectors.store.metadata import StoreConnectorMetadata
    from ascend_offload.store.shared.remote_fetch import FetchJob

    index = LocalStore(4 * PAGE, PAGE, with_data=False)

    class Tier:
        def available(self) -> bool:
            return True

        def lookup_prefix(self, keys: Sequence[str]) -> int:
            return len(keys)

    fetches = RemoteFetches(index, Tier(), page_bytes=PAGE, world_size=1, timeout_s=5.0)
    try:
        for outage in range(3):  # repeated outages must not shrink the pool
            assert fetches.consult(f"r{outage}", ["k0", "k1"], 0)
            (job,) = fetches.take_jobs()
            cluster.hang()
            meta = StoreConnectorMetadata(fetches=[FetchJob(job.job_id, job.keys, job.pages)])
            worker.start_load_kv(meta)  # the get outlives its deadline: unsafe
            wm = worker.build_worker_meta()
            assert wm is not None and wm.fetch_unsafe == {job.job_id: 1}
            fetches.report(wm.fetched, wm.fetch_failed, wm.fetch_unsafe)
            assert index.stats().pending_objects == 2  # quarantined while it may write
            cluster.unhang()  # the library's call returns
            wm = wait_for(lambda: worker.build_worker_meta())
            assert wm.fetch_released == {job.job_id: 1}
            fetches.release(wm.fetch_released)
            st = index.stats()
            assert st.pending_objects == 0 and st.free_pages == 4
            wait_for(lambda: worker.remote.health.up())
        assert fetches.counters()["remote_released_pages"] == 6
    finally:
        cluster.unhang()
        worker.close()


def test_a_fetch_release_may_come_before_the_job_settles() -> None:
    index = LocalStore(4 * PAGE, PAGE, with_data=False)

    class Tier:
        def available(self) -> bool:
            return True

        def lookup_prefix(self, keys: Sequence[str]) -> int:
            return len(keys)

    fetches = RemoteFetches(index, Tier(), page_bytes=PAGE, world_size=2, timeout_s=5.0)
    assert fetches.consult("r", ["k0"], 0)
    (job,) = fetches.take_jobs()
    fetches.report({}, {job.job_id: 1}, {job.job_id: 1})  # rank 0: late get
    fetches.release(Counter({job.job_id: 1}))  # it ended before rank 1 reported
    fetches.report({job.job_id: 1}, {}, {})
    assert index.stats().pending_objects == 0


def test_layerwise_held_saves_commit_only_once_released() -> None:
    from ascend_offload.store.book.layerwise_saves import LayerwiseSaves

    index = LocalStore(4 * PAGE, PAGE, with_data=False)
    book = LayerwiseSaves(index, block_size=BS, page_bytes=PAGE, world_size=2, min_load_blocks=1,
                          partial_prefix="partial:")
    assert book.place("r", ["K", "L"]) == ["K", "L"]
    book.hold({"K": 1})  # rank 0's publish of K outlived its deadline
    book.report({"K": 2, "L": 2}, {})
    assert not index.is_committed("K") and index.is_committed("L")
    assert index.allocate(["x", "y", "z"], [PAGE] * 3) is None  # K's page is not handed out
    book.release({"K": 1})
    assert index.is_committed("K")
    # held across a reset: pending until released, then aborted (never served)
    assert book.place("r", ["M"]) == ["M"]
    book.hold({"M": 1})
    book.reset()
    assert index.stats().pending_objects == 1
    book.release({"M": 1})
    st = index.stats()
    assert (st.pending_objects, st.stored_objects) == (0, 0)
