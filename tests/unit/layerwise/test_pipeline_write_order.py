"""When vLLM may write a layer's new KV into its slot, relative to the layer's load.

vLLM writes a layer's new KV before ``wait_for_layer_load``. With one shared buffer
the load of layer L+1 starts only after layer L is done with the slot; when the step
writes no block it loads, the pipeline lets the write go ahead once the slot's earlier
saves read it and waits for the load in ``wait_for_layer_load``. A block the step both
loads and writes (a partial block the chunk continues) keeps the write behind the load.
"""

from __future__ import annotations

import threading

import pytest
import torch

from ascend_offload.layerwise.plan import plan_uniform
from ascend_offload.layerwise.steps import BlockRef, StepBuilder, StepIO, default_key
from ascend_offload.store.base import Pin
from tests.unit.layerwise.dict_store import DictStore
from tests.unit.layerwise.test_pipeline import PAGE, STORES, Sim, make_store, value

TOKENS = PAGE[1]  # token rows per block


class HeldReads(DictStore):
    """Store reads wait for ``release`` (bounded), so a test sees a load still running."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.release.set()

    def read(self, pin: Pin, key: str, offset: int, dst: torch.Tensor) -> None:
        assert self.release.wait(10.0), "test never released the store reads"
        super().read(pin, key, offset, dst)


def _sim(store, layers: int = 3, **kw) -> Sim:
    """Layer 0 on its own buffer, the others sharing one (B = 1)."""
    return Sim(plan_uniform(layers, 1, [0]), store, **kw)


def _save_step(sim: Sim, refs: list[BlockRef]) -> None:
    """A step that computes and saves ``refs`` in every layer."""
    sim.step(StepIO(save=tuple(refs)), [], refs)
    assert sim.mismatches == []


def test_kv_write_goes_ahead_of_a_load_of_other_blocks() -> None:
    store = HeldReads()
    sim = _sim(store, load_timeout_s=5.0)
    pipe, kv = sim.pipe, sim.kv
    ctx = [BlockRef(0, "a"), BlockRef(1, "b")]
    _save_step(sim, ctx)
    new = BlockRef(2, "c")
    store.release.clear()  # every load of the next step is held
    pipe.start_step(StepIO(load_shared=tuple(ctx), save=(new,)))
    layers = list(kv)
    for i, layer in enumerate(layers):
        kv[layer][new.block_id].fill_(value(new.key, layer))  # vLLM's KV write
        if i:  # the write went ahead while this shared layer's load is still held
            assert not torch.all(kv[layer][0] == value("a", layer))
            store.release.set()
        pipe.wait_for_layer_load(layer)
        for r in (*ctx, new):
            assert torch.all(kv[layer][r.block_id] == value(r.key, layer)), (layer, r.key)
        store.release.clear()
        pipe.save_layer(layer)  # returns with the next layer's load held
    store.release.set()
    pipe.finish_step()
    pin = store.pin([default_key(new.key, n) for n in layers])
    assert pin is not None
    for n in layers:  # each save read its own layer's KV, not the next layer's write
        got = torch.empty(PAGE)
        store.read(pin, default_key(new.key, n), 0, got)
        assert torch.all(got == value(new.key, n)), n
    store.unpin(pin)
    pipe.close()


def test_kv_write_into_a_loaded_partial_block_waits_for_the_load() -> None:
    store = HeldReads()
    sim = _sim(store, load_timeout_s=5.0)
    pipe, kv = sim.pipe, sim.kv
    part = BlockRef(0, "p/2")  # two token rows computed by the previous chunk
    _save_step(sim, [part])
    cont = BlockRef(0, "p/4")  # this chunk fills rows 2 and 3 of the same block
    pipe.start_step(StepIO(load_shared=(part,), save=(cont,)))
    layers = list(kv)
    for i, layer in enumerate(layers):
        if i:  # the previous save_layer returned only after this layer's load landed
            assert store.release.is_set()
        kv[layer][0, :, 2:].fill_(value(cont.key, layer))  # vLLM writes the new token rows
        pipe.wait_for_layer_load(layer)
        assert torch.all(kv[layer][0, :, :2] == value(part.key, layer)), layer
        assert torch.all(kv[layer][0, :, 2:] == value(cont.key, layer)), layer
        store.release.clear()
        timer = threading.Timer(0.2, store.release.set)
        timer.start()
        pipe.save_layer(layer)
        timer.join()
    pipe.finish_step()
    pipe.close()


@pytest.mark.parametrize("kind", STORES)
@pytest.mark.parametrize("chunks", [(3, 2, 3, 1, 1), (4, 4, 1, 1)])
def test_chunks_across_block_boundaries_see_exact_kv(kind: str, chunks: tuple[int, ...]) -> None:
    """Chunked prefill then decode at token granularity through the step builder:
    chunks that end mid-block (a block loaded and written in one step) and chunks that
    end on a block boundary; attention sees every token row's own KV in every layer."""
    store = make_store(kind)
    sim = _sim(store, layers=4)
    pipe, kv = sim.pipe, sim.kv
    sb = StepBuilder(block_size=TOKENS)
    sb.begin("r", list(range(4)))
    rows: dict[int, str] = {}  # token -> the key its block had when the token was computed
    done = 0
    for n in chunks:
        sb.schedule("r", done, n, lambda i: f"full{i}")
        io = sb.build()
        key_of = {r.block_id: r.key for r in io.save}
        pipe.start_step(io)
        for layer in kv:
            for t in range(done, done + n):
                kv[layer][t // TOKENS, :, t % TOKENS].fill_(value(key_of[t // TOKENS], layer))
            pipe.wait_for_layer_load(layer)
            for t in range(done + n):
                want = value(key_of[t // TOKENS] if t >= done else rows[t], layer)
                assert torch.all(kv[layer][t // TOKENS, :, t % TOKENS] == want), (layer, t)
            pipe.save_layer(layer)
        pipe.finish_step()
        for t in range(done, done + n):
            rows[t] = key_of[t // TOKENS]
        done += n
    pipe.close()
