"""Layerwise save/load with the slot buffers on an accelerator (the fake device: CPU
memory that ``device.is_host`` calls device memory and whose bytes only ``device.py``
may touch). The pipeline must pick the staging path on its own and move exactly the
bytes the host path moves."""

from __future__ import annotations

import pytest
import torch

from ascend_offload.layerwise.layer_io import JobLayerIO
from ascend_offload.layerwise.plan import plan_uniform
from ascend_offload.store.local import LocalStore
from tests.support.fake_device import installed
from tests.unit.layerwise.dict_store import DictStore
from tests.unit.layerwise.test_pipeline import PAGE_BYTES, Sim, chunked_prefill


class DeviceSim(Sim):
    """The simulated model computes into the buffers (host views of them); the pipeline
    is handed the same memory as device tensors."""

    def __init__(self, plan, store, place, **kw) -> None:
        self.place = place
        super().__init__(plan, store, **kw)

    def __setattr__(self, name: str, value) -> None:
        if name == "pipe":  # register the placed views, keep self.kv as the model's views
            value.register_kv_caches = _placed(value.register_kv_caches, self.place)
        super().__setattr__(name, value)


def _placed(register, place):
    def wrapped(kv):
        return register({n: place(t) for n, t in kv.items()})
    return wrapped


def _make_store(kind: str):
    return DictStore() if kind == "dict" else LocalStore(capacity_bytes=4096 * PAGE_BYTES, page_bytes=PAGE_BYTES)


def _store_bytes(store) -> dict[str, torch.Tensor]:
    if isinstance(store, DictStore):
        return {k: v.clone() for k, v in store._data.items() if k in store._committed}
    return {k: store._pool[o.pages].clone() for k, o in store._objects.items() if o.committed}


def _run(kind: str, b: int, on_device: bool) -> dict:
    with installed() as fake:
        store = _make_store(kind)
        place = fake.place if on_device else (lambda t: t)
        sim = DeviceSim(plan_uniform(5, b, [0]), store, place, prefetch_layers=1)
        keys = [f"x{i}" for i in range(5)]
        chunked_prefill(sim, keys, blocks=[0, 2, 4, 6, 8], chunk=2)
        sim.pipe.drain()
        chunked_prefill(sim, [*keys[:3], "y3"], blocks=[9, 7, 5, 3], chunk=1, hits=3)
        sim.pipe.drain()
        st = sim.pipe.stats()
        out = {"mismatches": sim.mismatches, "phys": sim.phys.clone(), "store": _store_bytes(store),
               "stats": (st.blocks_saved, st.blocks_loaded, st.load_errors, st.save_errors),
               "native": st.native_jobs, "job_io": isinstance(sim.pipe._io(), JobLayerIO),
               "accesses": fake.accesses}
        sim.pipe.close()
        return out


@pytest.mark.parametrize("b", [1, 2])
@pytest.mark.parametrize("kind", ["dict", "local"])
def test_device_kv_saves_and_loads_the_host_paths_bytes(kind: str, b: int) -> None:
    host = _run(kind, b, on_device=False)
    dev = _run(kind, b, on_device=True)
    assert host["mismatches"] == [] and dev["mismatches"] == []
    assert dev["stats"] == host["stats"] and dev["stats"][2:] == (0, 0) and dev["stats"][1] > 0
    assert torch.equal(dev["phys"], host["phys"])
    assert dev["store"].keys() == host["store"].keys() and dev["store"]
    for k, v in host["store"].items():
        assert torch.equal(dev["store"][k], v), k
    assert dev["job_io"] and dev["native"] == 0  # device KV: staged Python jobs, never the native queue
    assert dev["accesses"] > host["accesses"]
    if kind == "local":
        assert host["native"] > 0  # the host path of the same store is the native row queue
