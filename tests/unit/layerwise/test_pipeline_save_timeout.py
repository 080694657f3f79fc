"""A layerwise save slower than ``save_timeout_s`` is not fatal: vLLM treats an exception
from ``wait_for_save`` (``finish_step``) or ``start_load_kv`` (``start_step``) as an
engine failure. The saves still running are abandoned instead: their objects are
aborted when their copies end, never committed (the device blocks they read may be
reused once the step ended), and their slots stay held until then, so the next writer
of a slot waits for the copy in the gate (bounded) and a drain waits again."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from ascend_offload import native
from ascend_offload.layerwise.pipeline import LayerwisePipeline
from ascend_offload.layerwise.plan import plan_uniform
from ascend_offload.layerwise.steps import BlockRef, StepIO
from ascend_offload.store.local import LocalStore
from tests.unit.layerwise.dict_store import DictStore

PAGE = (2, 4, 8)
NUM_BLOCKS = 8
PAGE_BYTES = 2 * 4 * 8 * 4


def make_store(kind: str):
    if kind == "dict":
        return DictStore()
    if not native.available():
        pytest.fail("the native library must build here (g++ comes with make bootstrap)")
    return LocalStore(capacity_bytes=256 * PAGE_BYTES, page_bytes=PAGE_BYTES)


def run_step(pipe: LayerwisePipeline, layers: list[str], io: StepIO) -> None:
    pipe.start_step(io)
    for layer in layers:
        pipe.wait_for_layer_load(layer)
        pipe.save_layer(layer)
    pipe.finish_step()


def committed(store, key: str) -> bool:
    return store.lookup_prefix([key]) == 1


@pytest.mark.parametrize("kind", ["dict", "local"])
def test_a_save_past_its_deadline_is_abandoned_not_fatal_and_never_committed(
        kind: str, caplog: pytest.LogCaptureFixture) -> None:
    store = make_store(kind)
    plan = plan_uniform(2, 1, [0])  # two layers on one physical slot
    kv = torch.zeros(plan.num_physical, NUM_BLOCKS, *PAGE)
    pipe = LayerwisePipeline(plan, store, save_timeout_s=0.1, load_timeout_s=5.0, save_delay_s=0.6)
    pipe.register_kv_caches({n: kv[plan.slot_of[n]] for n in plan.layers})
    refs = (BlockRef(0, "a"), BlockRef(1, "b"))
    with caplog.at_level(logging.ERROR):
        t0 = time.monotonic()
        run_step(pipe, list(plan.layers), StepIO(save=refs))  # wait_for_save: no exception
    waited = time.monotonic() - t0
    assert any("abandoned" in r.getMessage() for r in caplog.records)
    # the second layer's writer waited in the gate for the first layer's save (the slot
    # is shared) and the drain waited save_timeout_s on top: bounded, not the whole copy
    assert waited < 5.0
    # the next step starts while the abandoned copy may still run: no exception either
    pipe.save_delay_s = 0.0
    run_step(pipe, list(plan.layers), StepIO())
    pipe.drain(timeout_s=10.0)  # the copies end; they are reaped as failed
    for layer in plan.layers:
        for r in refs:
            assert not committed(store, f"{r.key}|{layer}")
    assert pipe.stats().save_errors >= 1
    assert pipe.gate.consumers_held() == 0  # every slot free again once the copies ended
    # a later save of the same blocks is committed normally
    run_step(pipe, list(plan.layers), StepIO(save=refs))
    assert all(committed(store, f"{r.key}|{layer}") for layer in plan.layers for r in refs)
    pipe.close()


def test_the_gate_holds_an_abandoned_saves_slot_until_its_copy_ended() -> None:
    store = DictStore()
    plan = plan_uniform(1, 1, [0])
    kv = torch.zeros(plan.num_physical, NUM_BLOCKS, *PAGE)
    pipe = LayerwisePipeline(plan, store, save_timeout_s=0.1, load_timeout_s=5.0, save_delay_s=0.5)
    pipe.register_kv_caches({n: kv[plan.slot_of[n]] for n in plan.layers})
    (layer,) = plan.layers
    run_step(pipe, [layer], StepIO(save=(BlockRef(0, "a"),)))  # abandoned, still copying
    assert pipe.gate.consumers_held() == 1  # the copy still reads the slot
    pipe.save_delay_s = 0.0
    pipe.gate._default_timeout_s = 5.0  # the next writer waits up to this for the copy
    pipe.start_step(StepIO())
    pipe.wait_for_layer_load(layer)  # owns the slot only once the abandoned copy ended
    assert pipe.gate.consumers_held() == 0
    pipe.save_layer(layer)
    pipe.finish_step()
    assert not committed(store, f"a|{layer}")
    pipe.close()
