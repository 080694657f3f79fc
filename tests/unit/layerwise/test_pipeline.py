"""The per-layer pipeline over aliased slot buffers: a simulated model checks, at every
layer's "attention", that each context block holds exactly that layer's KV."""

from __future__ import annotations

import threading
import zlib

import pytest
import torch

from ascend_offload import native
from ascend_offload.layerwise.gate import GateTimeout, ReuseGate
from ascend_offload.layerwise.layer_io import JobLayerIO
from ascend_offload.layerwise.pipeline import LayerwisePipeline
from ascend_offload.layerwise.plan import LayerSpec, plan_layers, plan_uniform
from ascend_offload.layerwise.steps import BlockRef, LoadTimeout, PipelineError, StepBuilder, StepIO
from ascend_offload.store.local import LocalStore
from tests.unit.layerwise.dict_store import DictStore

PAGE = (2, 4, 8)  # per-block page of one layer: (kv, tokens, dims)
NUM_BLOCKS = 16
PAGE_BYTES = 2 * 4 * 8 * 4

# "dict": a Python store, so every copy runs on the Python copy queue; "local": the
# page-pool store, whose rows the native copy queue moves (the CPU product path).
STORES = ["dict", "local"]


def make_store(kind: str):
    if kind == "dict":
        return DictStore()
    if not native.available():
        pytest.fail("the native library must build here (g++ comes with make bootstrap)")
    return LocalStore(capacity_bytes=4096 * PAGE_BYTES, page_bytes=PAGE_BYTES)


def evict(store, key: str) -> None:
    if isinstance(store, DictStore):
        store.evict(key)
    else:
        assert store.discard([key]) == 1


def assert_queue(sim: Sim, kind: str) -> None:
    """The path under test really ran: native jobs exactly when the store has rows."""
    st = sim.pipe.stats()
    assert (st.native_jobs > 0) if kind == "local" else (st.native_jobs == 0)


class StagedIO(JobLayerIO):
    """The Python copy path with host staging forced on CPU tensors (as for accelerator KV)."""

    def direct(self, kv: torch.Tensor) -> bool:
        return False


def value(key: str, layer: str) -> float:
    """The KV a layer computes for a block: distinct per (block key, layer)."""
    return float(zlib.crc32(f"{key}/{layer}".encode()) % 100_000)


class Sim:
    """N layers aliased onto the plan's physical buffers, like the layout hook makes them."""

    def __init__(self, plan, store, **kw) -> None:
        self.plan = plan
        self.phys = torch.zeros(plan.num_physical, NUM_BLOCKS, *PAGE)
        self.kv = {n: self.phys[plan.slot_of[n]] for n in (*plan.layers, *plan.followers)}
        self.pipe = LayerwisePipeline(plan, store, **kw)
        self.pipe.register_kv_caches(self.kv)
        self.mismatches: list[str] = []

    def step(self, io: StepIO, context: list[BlockRef], new: list[BlockRef],
             wait_saves: bool = True) -> None:
        """One forward in vLLM's order: a layer's new KV is written (unified_kv_cache_update)
        *before* wait_for_layer_load, then attention reads the context, then save_kv_layer."""
        self.pipe.start_step(io)
        for layer in self.plan.layers:
            members = [layer, *[f for f in self.plan.followers if self.plan.main_of[f] == layer]]
            for m in members:
                for r in new:
                    self.kv[m][r.block_id].fill_(value(r.key, m))
                self.pipe.wait_for_layer_load(m)
            for m in members:
                for r in (*context, *new):
                    got = self.kv[m][r.block_id]
                    if not torch.all(got == value(r.key, m)):
                        self.mismatches.append(f"{m} block {r.block_id} ({r.key}): {got.flatten()[0]}")
            for m in members:
                self.pipe.save_layer(m)
        self.pipe.finish_step(wait_saves=wait_saves)


def chunked_prefill(sim: Sim, keys: list[str], blocks: list[int], chunk: int,
                    hits: int = 0, wait_saves: bool = True) -> None:
    """Run one request block-chunk by chunk; ``hits`` leading blocks come from the store."""
    refs = [BlockRef(b, k) for b, k in zip(blocks, keys, strict=True)]
    done = hits
    first = True
    while done < len(refs):
        new = refs[done : done + chunk]
        io = StepIO(
            load=tuple(refs[:hits]) if first else (),
            load_shared=tuple(refs[hits if first else 0 : done]),
            save=tuple(new),
        )
        sim.step(io, refs[:done], new, wait_saves)
        done += len(new)
        first = False


@pytest.mark.parametrize("b", [1, 2, 3])
@pytest.mark.parametrize("prefetch", [0, 1, 3])
@pytest.mark.parametrize("wait_saves", [True, False])
@pytest.mark.parametrize("kind", STORES)
def test_chunked_prefill_and_prefix_reuse_see_exact_kv(
    b: int, prefetch: int, wait_saves: bool, kind: str
) -> None:
    store = make_store(kind)
    sim = Sim(plan_uniform(8, b, [0]), store, prefetch_layers=prefetch, save_delay_s=0.001)
    keys = [f"p{i}" for i in range(6)]
    chunked_prefill(sim, keys, blocks=[0, 1, 2, 3, 4, 5], chunk=2, wait_saves=wait_saves)
    # A second request sharing 4 blocks of prefix: loaded from the store into other blocks.
    keys2 = [*keys[:4], "q4", "q5", "q6"]
    sim.pipe.drain()  # the scheduler only sees committed objects as prefix hits
    chunked_prefill(sim, keys2, blocks=[8, 9, 10, 11, 12, 13, 14], chunk=2, hits=4,
                    wait_saves=wait_saves)
    sim.pipe.drain()
    assert sim.mismatches == []
    st = sim.pipe.stats()
    assert st.load_errors == 0 and st.save_errors == 0
    assert st.blocks_saved == 8 * (6 + 3)
    # prefix hits go to all 8 layers; own chunks only to the 7 shared layers
    own_reloads = 7 * (2 + 4) + 7 * 6
    assert st.blocks_loaded == 8 * 4 + own_reloads
    if prefetch:
        assert st.prefetched_loads > 0
    assert_queue(sim, kind)
    sim.pipe.close()


def test_all_independent_never_reloads_own_chunks() -> None:
    store = DictStore()
    sim = Sim(plan_uniform(4, 1, "all"), store)
    chunked_prefill(sim, [f"k{i}" for i in range(4)], blocks=[0, 1, 2, 3], chunk=1)
    sim.pipe.close()
    assert sim.mismatches == []
    assert sim.pipe.stats().blocks_loaded == 0
    assert sim.pipe.stats().blocks_saved == 16


class _NoGate(ReuseGate):
    """A broken gate that never makes a writer wait (negative control)."""

    @staticmethod
    def _busy(s, behind_queued=False) -> bool:  # type: ignore[override]
        return False


@pytest.mark.parametrize("broken", [False, True])
@pytest.mark.parametrize("kind", STORES)
def test_slow_save_gate_holds(broken: bool, kind: str) -> None:
    """With a slow store save the next layer of the slot must wait; without the gate
    the save reads bytes that the next layer already overwrote."""
    store = make_store(kind)
    plan = plan_uniform(4, 1, [0])
    gate = (_NoGate if broken else ReuseGate)(plan.num_physical, default_timeout_s=10.0)
    sim = Sim(plan, store, save_delay_s=0.03, gate=gate, prefetch_layers=1)
    keys = [f"s{i}" for i in range(4)]
    chunked_prefill(sim, keys, blocks=[0, 1, 2, 3], chunk=2)
    chunked_prefill(sim, [*keys, "t4"], blocks=[5, 6, 7, 8, 9], chunk=2, hits=4)
    sim.pipe.close()
    if broken:
        assert sim.mismatches, "a gate that never waits must corrupt the reloaded KV"
    else:
        assert sim.mismatches == []
        assert gate.stats().waits > 0 and gate.stats().wait_s > 0
        assert gate.stats().timeouts == 0
        # the second request's loads went into slots still being saved: behind the saves
        assert gate.stats().queued_waits > 0
        assert_queue(sim, kind)


@pytest.mark.parametrize("kind", STORES)
def test_missing_object_is_load_error_for_exactly_its_blocks(kind: str) -> None:
    store = make_store(kind)
    sim = Sim(plan_uniform(3, 1, [0]), store)
    keys = ["a", "b", "c"]
    chunked_prefill(sim, keys, blocks=[0, 1, 2], chunk=3)
    sim.pipe.drain()
    evict(store, "b|layers.2")
    io = StepIO(load=tuple(BlockRef(b, k) for b, k in zip([4, 5, 6], keys, strict=True)))
    sim.step(io, [BlockRef(4, "a"), BlockRef(6, "c")], [])
    assert sim.pipe.take_load_errors() == {5}
    assert sim.pipe.take_load_errors() == set()
    assert sim.mismatches == []
    assert sim.pipe.stats().load_errors == 1
    sim.pipe.close()


@pytest.mark.parametrize("kind", STORES)
def test_injected_load_failure_fails_exactly_one_layer_load(kind: str) -> None:
    """``fail_loads`` (the store's ``debug.fail_layer_loads`` test hook): the first layer
    load fails whole, its blocks become load errors; later loads read exact KV."""
    store = make_store(kind)
    sim = Sim(plan_uniform(3, 1, [0]), store, fail_loads=1)
    keys = ["a", "b"]
    chunked_prefill(sim, keys, blocks=[0, 1], chunk=2)
    sim.pipe.drain()
    io = StepIO(load=tuple(BlockRef(b, k) for b, k in zip([4, 5], keys, strict=True)))
    sim.step(io, [], [])
    assert sim.pipe.take_load_errors() == {4, 5}
    assert sim.pipe.stats().load_errors == 2
    sim.step(io, [BlockRef(4, "a"), BlockRef(5, "b")], [])
    assert sim.pipe.take_load_errors() == set()
    assert sim.mismatches == []
    sim.pipe.close()


@pytest.mark.parametrize("kind", STORES)
def test_a_failed_load_drops_the_rest_of_its_steps_saves(kind: str) -> None:
    """After a load of a step fails, the step's later layers computed over a buffer the
    load never filled: their saves must not be committed (a recompute's saves of the same
    keys would be duplicates and every later load would read the wrong KV)."""
    store = make_store(kind)
    plan = plan_uniform(4, 1, [0])  # layer 0 independent, layers 1-3 share one buffer
    sim = Sim(plan, store, fail_loads=1)
    a, b, c = BlockRef(0, "a"), BlockRef(1, "b"), BlockRef(2, "c")
    sim.step(StepIO(save=(a, b)), [], [a, b])  # first chunk: nothing to load
    sim.step(StepIO(load_shared=(a, b), save=(c,)), [a, b], [c])  # layer 1's load fails
    sim.pipe.drain()
    first, *shared = plan.layers
    assert sim.pipe.take_load_errors() == {0, 1}
    assert store.contains(f"c|{first}")  # computed before the failed load: kept
    assert not any(store.contains(f"c|{layer}") for layer in shared)
    assert sim.pipe.stats().save_dropped == len(shared)
    sim.mismatches.clear()  # that step's later layers read garbage, as vLLM is told
    sim.step(StepIO(load_shared=(a, b), save=(c,)), [a, b], [c])  # the recompute
    sim.pipe.drain()
    assert sim.pipe.take_load_errors() == set() and sim.mismatches == []
    assert all(store.contains(f"c|{layer}") for layer in shared)
    sim.step(StepIO(load_shared=(a, b, c)), [a, b, c], [])  # a later step reads exact KV
    assert sim.mismatches == [] and sim.pipe.stats().save_dropped == len(shared)
    sim.pipe.close()


@pytest.mark.parametrize("kind", STORES)
def test_a_failed_load_drops_only_its_owners_saves(kind: str) -> None:
    """Two requests in one step: A reloads its earlier chunk and that load fails; B (a
    first chunk) read only its own blocks, so its KV is right: B's saves are committed at
    every layer, A's from the failed layer on are not, and B's next chunk reads its own
    blocks back with no load error (it is not recomputed)."""
    store = make_store(kind)
    plan = plan_uniform(4, 1, [0])  # layer 0 independent, layers 1-3 share one buffer
    sim = Sim(plan, store, fail_loads=1)  # the first layer load with blocks fails whole
    a0, a1 = BlockRef(0, "a0", "A"), BlockRef(1, "a1", "A")
    b0, b1 = BlockRef(2, "b0", "B"), BlockRef(3, "b1", "B")
    sim.step(StepIO(save=(a0,)), [], [a0])  # A's first chunk
    sim.pipe.drain()
    sim.step(StepIO(load_shared=(a0,), save=(a1, b0)), [a0], [a1, b0])  # A's load of layer 1 fails
    sim.pipe.drain()
    first, *shared = plan.layers
    assert sim.pipe.take_load_errors() == {0}  # A's block only: vLLM recomputes A
    assert all(store.contains(f"b0|{layer}") for layer in plan.layers)
    assert store.contains(f"a1|{first}") and not any(store.contains(f"a1|{layer}") for layer in shared)
    assert sim.pipe.stats().save_dropped == len(shared)  # A's one block, from the failed layer on
    sim.mismatches.clear()  # A's later layers read garbage in that step, as vLLM is told
    sim.step(StepIO(load_shared=(b0,), save=(b1,)), [b0], [b1])  # B's next chunk
    sim.pipe.drain()
    assert sim.pipe.take_load_errors() == set() and sim.mismatches == []
    sim.pipe.close()


@pytest.mark.parametrize("kind", STORES)
def test_store_full_is_counted_not_fatal(kind: str) -> None:
    store = (DictStore(capacity_objects=3) if kind == "dict"
             else LocalStore(capacity_bytes=3 * PAGE_BYTES, page_bytes=PAGE_BYTES))
    sim = Sim(plan_uniform(2, 1, [0]), store)
    chunked_prefill(sim, ["a", "b"], blocks=[0, 1], chunk=2)
    sim.pipe.close()
    st = sim.pipe.stats()
    if kind == "dict":  # no eviction: the second layer's objects do not fit
        assert st.save_skipped == 2 and st.blocks_saved == 2 and st.save_errors == 0
    else:  # the joint allocation does not fit; per layer, LRU eviction may make room
        # (only once layer 0's save is committed, which races with layer 1's allocation)
        assert st.save_skipped + st.blocks_saved == 4 and st.save_errors == 0
        assert st.blocks_saved >= 2
        assert store.stats().evicted_objects == max(0, st.blocks_saved - 3)  # 3 pages


@pytest.mark.parametrize("kind", STORES)
def test_stuck_save_turns_into_a_bounded_load_timeout(kind: str) -> None:
    """A load queued behind a save that does not finish fails at load_timeout_s, naming
    the layer, instead of hanging; the pipeline then drains and closes cleanly."""
    store = make_store(kind)
    plan = plan_uniform(4, 1, [0])
    sim = Sim(plan, store, load_timeout_s=0.05)
    refs = [BlockRef(0, "a"), BlockRef(1, "b")]
    sim.step(StepIO(save=tuple(refs)), [], refs)
    saved = sim.pipe.stats().blocks_saved
    sim.pipe.save_delay_s = 2.0  # every save of the next step is stuck, 40x the load deadline
    with pytest.raises(LoadTimeout, match=r"layers\.2"):
        sim.step(StepIO(load_shared=tuple(refs), save=(BlockRef(2, "c"),)), refs,
                 [BlockRef(2, "c")])
    # the load gave up while the save it was queued behind had not finished: bounded by
    # its own deadline, not by the save
    assert sim.pipe.stats().blocks_saved == saved
    sim.pipe.save_delay_s = 0.0
    sim.pipe.close()
    assert sim.pipe.stats().save_errors == 0


@pytest.mark.parametrize("ready_before_hook", [True, False])
@pytest.mark.parametrize("kind", STORES)
def test_gate_deadline_is_an_explicit_error(ready_before_hook: bool, kind: str) -> None:
    store = make_store(kind)
    plan = plan_uniform(3, 1, [0])
    sim = Sim(plan, store, save_timeout_s=0.05, ready_before_hook=ready_before_hook)
    io = StepIO(save=(BlockRef(0, "x"),))
    sim.pipe.start_step(io)
    sim.pipe.wait_for_layer_load("layers.0")
    sim.pipe.save_layer("layers.0")
    sim.pipe.wait_for_layer_load("layers.1")
    if ready_before_hook:
        # layer 2 must own its slot before vLLM writes its KV: that happens in layer 1's save
        with pytest.raises(GateTimeout) as err:
            sim.pipe.save_layer("layers.1", extra_consumers=["decode-read rank0"])
        tokens = [c for c in sim.pipe.gate._slots[1].consumers.values() if "decode" in c.name]
    else:
        tokens = sim.pipe.save_layer("layers.1", extra_consumers=["decode-read rank0"])
        with pytest.raises(GateTimeout) as err:
            sim.pipe.wait_for_layer_load("layers.2")
    assert err.value.slot == plan.slot_of["layers.2"] and "decode-read rank0" in str(err.value)
    sim.pipe.gate.release_consumer(tokens[0])
    sim.pipe.wait_for_layer_load("layers.2")
    sim.pipe.save_layer("layers.2")
    sim.pipe.close()


@pytest.mark.parametrize("kind", STORES)
def test_slot_not_ready_before_kv_write_corrupts_negative_control(kind: str) -> None:
    """vLLM writes a layer's KV before wait_for_layer_load: without ready_before_hook a slow
    save of the previous layer in the slot reads the new layer's bytes."""
    store = make_store(kind)
    sim = Sim(plan_uniform(4, 1, [0]), store, save_delay_s=0.03, ready_before_hook=False)
    keys = [f"s{i}" for i in range(4)]
    chunked_prefill(sim, keys, blocks=[0, 1, 2, 3], chunk=2)
    sim.pipe.close()
    assert sim.mismatches


def test_hooks_outside_a_step_are_refused() -> None:
    store = DictStore()
    sim = Sim(plan_uniform(2, 1, [0]), store)
    with pytest.raises(PipelineError, match="has_sync_kv_loads"):
        sim.pipe.wait_for_layer_load("layers.0")
    sim.pipe.close()


def test_protocol_errors() -> None:
    store = DictStore()
    plan = plan_uniform(3, 1, [0])
    pipe = LayerwisePipeline(plan, store)
    with pytest.raises(PipelineError, match="register_kv_caches"):
        pipe.start_step(StepIO())
    with pytest.raises(PipelineError, match="no KV cache registered"):
        pipe.register_kv_caches({"layers.0": torch.zeros(2, 2)})
    pipe.register_kv_caches({n: torch.zeros(4, 8) for n in plan.layers})
    assert not pipe.aliased
    pipe.start_step(StepIO())
    with pytest.raises(PipelineError, match="without a preceding wait_for_layer_load"):
        pipe.save_layer("layers.2")
    pipe.wait_for_layer_load("not.a.layer")  # non-cache layers are ignored
    pipe.finish_step()
    with pytest.raises(PipelineError, match="loaded twice"):
        StepIO(load=(BlockRef(1, "a"),), load_shared=(BlockRef(1, "b"),))
    pipe.close()
    with pytest.raises(PipelineError, match="closed"):
        pipe.start_step(StepIO())


@pytest.mark.parametrize("kind", STORES)
def test_unrun_layers_release_their_lease_at_step_end(kind: str) -> None:
    store = make_store(kind)
    plan = plan_uniform(3, 1, [0], mtp_layers=1)
    sim = Sim(plan, store, prefetch_layers=4)
    chunked_prefill(sim, ["a", "b"], blocks=[0, 1], chunk=1)
    # A step where the MTP layer does not run: its slot must not stay owned.
    io = StepIO(load_shared=(BlockRef(0, "a"), BlockRef(1, "b")), save=())
    sim.pipe.start_step(io)
    for layer in plan.layers[:-1]:
        sim.pipe.wait_for_layer_load(layer)
        sim.pipe.save_layer(layer)
    sim.pipe.finish_step()
    sim.pipe.drain()
    assert all(sim.pipe.gate.is_free(s) for s in range(plan.num_physical))
    sim.pipe.close()


@pytest.mark.parametrize("kind", STORES)
def test_indexer_followers_move_with_their_main_layer(kind: str) -> None:
    specs = []
    for i in range(4):
        specs.append(LayerSpec(f"l{i}", compat="mla"))
        specs.append(LayerSpec(f"l{i}.idx", compat="idx", follows=f"l{i}"))
    plan = plan_layers(specs, num_shared_buffers=1, independent=[0])
    store = make_store(kind)
    sim = Sim(plan, store, prefetch_layers=1)
    keys = ["a", "b", "c"]
    chunked_prefill(sim, keys, blocks=[0, 1, 2], chunk=1)
    chunked_prefill(sim, [*keys, "d"], blocks=[4, 5, 6, 7], chunk=1, hits=3)
    sim.pipe.close()
    assert sim.mismatches == []
    assert store.contains("a|l2.idx")
    assert sim.pipe.stats().save_errors == 0
    assert_queue(sim, kind)


@pytest.mark.parametrize("kind", STORES)
def test_concurrent_saves_release_in_background(kind: str) -> None:
    """finish_step(wait_saves=False) leaves saves running; drain waits, the gate ends idle."""
    store = make_store(kind)
    plan = plan_uniform(4, 2, [0])
    sim = Sim(plan, store, save_delay_s=0.01)
    chunked_prefill(sim, ["a", "b"], blocks=[0, 1], chunk=2, wait_saves=False)
    busy = [s for s in range(plan.num_physical) if not sim.pipe.gate.is_free(s)]
    sim.pipe.drain()
    assert busy  # saves were still in flight right after the step
    assert all(sim.pipe.gate.is_free(s) for s in range(plan.num_physical))
    gate = sim.pipe.gate.stats()
    assert gate.consumers_added > 0 and gate.consumers_released == gate.consumers_added
    assert gate.consumers_failed == 0 and sim.pipe.stats().save_errors == 0
    assert all(store.contains(f"{k}|{layer}") for k in ("a", "b") for layer in plan.layers)
    sim.pipe.close()


@pytest.mark.parametrize("kind", STORES)
def test_save_listener_registers_consumers_before_the_slot_moves_on(kind: str) -> None:
    """A sibling (P/D producer) adds its reads as consumers from the listener; the next layer
    of the slot waits for them exactly like for the store save."""
    store = make_store(kind)
    plan = plan_uniform(3, 1, [0])
    sim = Sim(plan, store, save_timeout_s=5.0)
    gate = sim.pipe.gate
    tokens = []

    def listener(layer: str, slot: int, generation: int) -> None:
        tok = gate.add_consumer(slot, generation, f"rd2h {layer}")
        tokens.append(tok)
        threading.Timer(0.03, gate.release_consumer, args=(tok,)).start()

    sim.pipe.add_save_listener(listener)
    chunked_prefill(sim, ["a", "b", "c"], blocks=[0, 1, 2], chunk=3)
    sim.pipe.close()
    gate.wait_consumers(timeout_s=5.0)  # the last remote read is answered after the step
    assert sim.mismatches == []
    assert len(tokens) == 3
    assert gate.stats().waits > 0  # layer 2 waited for layer 1's remote read
    assert gate.stats().consumers_released == gate.stats().consumers_added


# ---------------------------------------------------------------- StepBuilder + pipeline


@pytest.mark.parametrize("kind", STORES)
def test_step_builder_drives_the_pipeline_to_exact_kv(kind: str) -> None:
    store = make_store(kind)
    sim = Sim(plan_uniform(6, 2, [0]), store)
    sb = StepBuilder(block_size=1)  # one "token" per block in the simulation
    sb.begin("r", list(range(7)))
    keys = {i: f"k{i}" for i in range(5)}
    done = 0
    for n in (2, 2, 1, 1, 1):  # chunked prefill then decode
        sb.schedule("r", done, n, lambda i: keys.get(i))
        io = sb.build()
        ctx = list(io.load_shared)  # everything computed so far, under its latest key
        sim.step(io, ctx, list(io.save))
        done += n
    sim.pipe.close()
    assert sim.mismatches == []


@pytest.mark.parametrize("b", [1, 2])
def test_staging_path_moves_exact_kv(b: int) -> None:
    """The accelerator path (host staging buffer, one scatter / gather per layer) run on CPU."""
    store = DictStore()
    sim = Sim(plan_uniform(5, b, [0]), store, prefetch_layers=1, layer_io=StagedIO)
    keys = [f"x{i}" for i in range(5)]
    chunked_prefill(sim, keys, blocks=[0, 2, 4, 6, 8], chunk=2)
    chunked_prefill(sim, [*keys[:3], "y3"], blocks=[9, 7, 5, 3], chunk=1, hits=3)
    sim.pipe.close()
    assert sim.mismatches == []
    assert sim.pipe.stats().load_errors == 0 and sim.pipe.stats().blocks_loaded > 0


def test_failed_save_aborts_every_pending_object() -> None:
    class Failing(DictStore):
        def write(self, handle, offset, src):  # type: ignore[override]
            raise RuntimeError("disk on fire")

    store = Failing()
    sim = Sim(plan_uniform(2, 1, [0]), store)
    chunked_prefill(sim, ["a", "b"], blocks=[0, 1], chunk=2)
    sim.pipe.close()
    st = store.stats()
    assert st.allocated_objects == 4 and st.aborted_objects == 4 and st.committed_objects == 0
    assert sim.pipe.stats().save_errors == 2
    assert all(sim.pipe.gate.is_free(s) for s in range(sim.plan.num_physical))
