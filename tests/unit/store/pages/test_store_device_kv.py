"""The store connector's worker copies with KV on an accelerator (the fake device: CPU
memory that ``device.is_host`` calls device memory and whose bytes only ``device.py``
may touch). Saves and loads must produce the host path's bytes exactly."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ascend_offload import device, native
from ascend_offload.store.local import LocalStore
from ascend_offload.store.pages.worker_pool import WorkerPagePool
from ascend_offload.transfer.copy_queue import NativeRowQueue
from tests.support.fake_device import FakeDeviceAccess, installed

NUM_BLOCKS, NUM_PAGES = 10, 6


def _caches() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "l0": torch.randn(NUM_BLOCKS, 2, 16, 8, generator=g),  # block-first (device.move_rows)
        "l1": torch.randn(2, NUM_BLOCKS, 16, 8, generator=g),  # K/V stack (blocks_to/from_host)
        "l2": torch.randn(NUM_BLOCKS, 16, 8, generator=g).to(torch.bfloat16),
    }


def _round_trip(on_device: bool) -> tuple[dict[str, torch.Tensor], list[torch.Tensor], int]:
    """Save blocks to pages, load pages into other blocks; (KV after, page planes, accesses)."""
    kv = _caches()
    with installed() as fake:
        caches = {n: fake.place(t) for n, t in kv.items()} if on_device else kv
        pool = WorkerPagePool(caches, num_blocks=NUM_BLOCKS, num_pages=NUM_PAGES)
        pool.save([3, 7, 8, 0], [2, 0, 5, 1])
        pool.load([2, 0, 5], [9, 4, 5])
        return kv, [layer.plane.clone() for layer in pool._layers], fake.accesses


def test_prefix_worker_pages_on_device_kv_match_the_host_path() -> None:
    host_kv, host_pages, host_access = _round_trip(on_device=False)
    dev_kv, dev_pages, dev_access = _round_trip(on_device=True)
    for a, b in zip(host_pages, dev_pages, strict=True):
        assert torch.equal(a, b)
    for n in host_kv:
        assert torch.equal(host_kv[n], dev_kv[n])
    before = _caches()
    assert torch.equal(dev_kv["l1"][:, 9], before["l1"][:, 3])  # page 2 held block 3
    assert torch.equal(dev_kv["l0"][4], before["l0"][7])
    assert dev_access > host_access  # the device run copied through device.py (else: FakeDeviceAccess)


def test_prefix_worker_jobs_on_device_kv() -> None:
    """The connector's worker role (``PrefixWorker``) over device KV: jobs report done."""
    pytest.importorskip("vllm")
    from ascend_offload.connectors.store.metadata import CopyJob, StoreConnectorMetadata
    from ascend_offload.connectors.store.worker import PrefixWorker

    kv = _caches()
    before = {n: t.clone() for n, t in kv.items()}
    with installed() as fake:
        settings = SimpleNamespace(num_pages=NUM_PAGES, page_bytes=None, shared_tier=False, ssd_tier=False)
        worker = PrefixWorker(settings, None, SimpleNamespace(num_blocks=NUM_BLOCKS, kv_cache_groups=[]))  # type: ignore[arg-type]
        worker.register_kv_caches({n: fake.place(t) for n, t in kv.items()})
        worker.wait_for_save(StoreConnectorMetadata(saves=[CopyJob(1, (6, 2), (0, 3))]))
        worker.start_load_kv(StoreConnectorMetadata(loads=[CopyJob(2, (1, 8), (3, 0))]))
        meta = worker.build_worker_meta()
        assert meta is not None and meta.done == {1: 1, 2: 1} and not meta.failed
        assert worker.take_load_errors() == set()
    for n, t in kv.items():
        for src, dst in ((2, 1), (6, 8)):
            sel = (slice(None), dst) if n == "l1" else (dst,)
            want = (slice(None), src) if n == "l1" else (src,)
            assert torch.equal(t[sel], before[n][want])


def test_host_only_paths_refuse_device_tensors() -> None:
    """Native copies, the native copy queue and the store's row path never address device
    memory: each answers "not host" instead of copying from it."""
    with installed() as fake:
        host = torch.zeros(4, 16)
        dev = fake.place(torch.ones(4, 16))
        plan = device.plan_rows([0, 1], [2, 3])
        assert not device.copy_host_rows(dev, plan.src32, host, plan.dst32)
        if native.available():
            with pytest.raises(ValueError, match="host tensors"):
                native.copy_rows(dev, torch.tensor([0], dtype=torch.int32), host,
                                 torch.tensor([1], dtype=torch.int32))
        if NativeRowQueue.available():
            q = NativeRowQueue()
            import array

            with pytest.raises(ValueError, match="host tensors"):
                q.prepare_rows(dev, array.array("i", [0]), host, array.array("i", [1]))
            q.close()
        store = LocalStore(capacity_bytes=4 * 64, page_bytes=64)
        assert store._row_words(dev) is None and store._row_words(host) is not None
        device.move_rows(dev, host, plan)  # device.py's own copy: allowed, and right
        assert torch.equal(host[2:], torch.ones(2, 16)) and not host[:2].any()
        with pytest.raises(FakeDeviceAccess):
            torch.index_select(dev, 0, torch.tensor([0]))
