"""MooncakeStore against a real ``mooncake_master`` on 127.0.0.1 (TCP transport)."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("mooncake.store", reason="needs mooncake-transfer-engine-non-cuda and libibverbs")

from ascend_offload.bench.stores.mooncake import MooncakeStore
from ascend_offload.store.base import StoreError
from ascend_offload.store.services.mooncake_master import MooncakeMaster, master_binary

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(120),
    pytest.mark.skipif(master_binary() is None, reason="mooncake_master not installed"),
]

PAGE = 64 << 10
SEG = 16 << 20  # Mooncake's minimum segment


def payload(seed: int, n: int, size: int = PAGE) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, size), dtype=torch.uint8, generator=g)


def make_store(master: MooncakeMaster, **kw) -> MooncakeStore:
    args = dict(master_address=master.address, page_bytes=PAGE, staging_bytes=64 * PAGE,
                global_segment_bytes=64 << 20, local_buffer_bytes=SEG, retry_interval_s=0.2)
    args.update(kw)
    return MooncakeStore(**args)


@pytest.fixture
def master(tmp_path: Path) -> Iterator[MooncakeMaster]:
    with MooncakeMaster(tmp_path / "master.log") as m:
        yield m


@pytest.fixture
def stores(master: MooncakeMaster) -> Iterator[list[MooncakeStore]]:
    made = [make_store(master), make_store(master)]
    yield made
    for s in made:
        s.close()


def put(store: MooncakeStore, keys: list[str], data: torch.Tensor) -> None:
    hs = store.allocate(keys, [data[0].numel()] * len(keys))
    assert hs is not None and all(h is not None for h in hs)
    store.write_batch(hs, data)
    store.commit(hs)


def test_round_trip_bytes_and_shared_between_clients(stores: list[MooncakeStore]) -> None:
    a, b = stores
    keys = [f"rt:{i}" for i in range(8)]
    data = payload(1, 8)
    put(a, keys, data)
    assert a.stats().committed_objects == 8 and a.stats().bytes_written == 8 * PAGE
    assert a.stats().pending_objects == 0 and a.stats().free_pages == a.stats().total_pages
    # the other client sees the committed objects (the master is the index)
    assert b.lookup_prefix([*keys, "rt:none"]) == 8
    pin = b.pin(keys)
    assert pin is not None
    out = torch.zeros_like(data)
    b.read_batch(pin, keys, out)
    assert torch.equal(out, data)
    # scattered rows and the row-plane view give the same bytes
    dst = torch.zeros(20, PAGE, dtype=torch.uint8)
    rows = [19, 3, 7, 0, 11, 5, 2, 16]
    b.read_rows(pin, keys, dst, rows)
    assert torch.equal(dst[rows], data)
    plane, prow = b.pinned_rows(pin, keys)
    assert torch.equal(plane[prow], data)
    part = torch.zeros(100, dtype=torch.uint8)
    b.read(pin, keys[3], 500, part)
    assert torch.equal(part, data[3, 500:600])
    with pytest.raises(StoreError, match="outside object"):
        b.read(pin, keys[3], PAGE - 10, part)
    b.unpin(pin)
    b.unpin(pin)  # idempotent
    with pytest.raises(StoreError, match="active pin"):
        b.read(pin, keys[0], 0, part)
    assert b.stats().pinned_objects == 0 and b.stats().free_pages == b.stats().total_pages
    # a key the master already has is not stored again, by either client
    again = a.allocate([keys[0], "rt:new"], [PAGE, PAGE])
    assert again is not None and again[0] is None and again[1] is not None
    a.abort([again[1]])
    assert b.allocate(keys[:1], [PAGE]) == [None]


def test_objects_larger_and_smaller_than_a_page(stores: list[MooncakeStore]) -> None:
    a, b = stores
    big = payload(2, 1, 3 * PAGE + 123)[0]
    small = payload(3, 1, 1000)[0]
    hs = a.allocate(["big", "small"], [big.numel(), small.numel()])
    assert hs is not None
    a.write(hs[0], 0, big[: PAGE + 5])  # two segments, any offsets
    a.write(hs[0], PAGE + 5, big[PAGE + 5 :])
    a.write(hs[1], 0, small)
    a.commit(hs)
    pin = b.pin(["small", "big"])
    assert pin is not None
    out_big, out_small = torch.empty_like(big), torch.empty_like(small)
    b.read(pin, "big", 0, out_big)
    b.read(pin, "small", 0, out_small)
    assert torch.equal(out_big, big) and torch.equal(out_small, small)
    assert b.pinned_rows(pin, ["small"]) is None  # not whole pages: no row view
    b.unpin(pin)
    assert b.stats().free_pages == b.stats().total_pages


def test_pending_invisible_until_commit_and_abort(stores: list[MooncakeStore]) -> None:
    a, b = stores
    data = payload(4, 2)
    hs = a.allocate(["p:0", "p:1"], [PAGE, PAGE])
    assert hs is not None
    a.write_batch(hs, data)
    assert b.lookup_prefix(["p:0"]) == 0 and b.pin(["p:0"]) is None
    assert a.lookup_prefix(["p:0"]) == 0  # not even to the writer
    assert a.allocate(["p:0"], [PAGE]) == [None]  # pending here: not allocated twice
    a.abort(hs[1:])
    a.commit(hs[:1])
    with pytest.raises(StoreError, match="not a pending allocation"):
        a.commit(hs[1:])
    assert b.lookup_prefix(["p:0", "p:1"]) == 1
    assert a.stats().aborted_objects == 1 and a.stats().pending_objects == 0


def test_reader_never_sees_a_half_written_object(stores: list[MooncakeStore]) -> None:
    """A writer commits 4-page objects whose every byte is the object's number while a
    reader in another client pins them as fast as it can: every pin it gets holds the
    whole object, never a prefix of it."""
    a, b = stores
    n, size = 40, 4 * PAGE
    done = threading.Event()
    seen: list[int] = []
    errors: list[str] = []

    def reader() -> None:
        out = torch.empty(size, dtype=torch.uint8)
        pending = set(range(n))
        while pending and not done.is_set():
            for i in list(pending):
                pin = b.pin([f"hw:{i}"])
                if pin is None:
                    continue
                b.read(pin, f"hw:{i}", 0, out)
                b.unpin(pin)
                if not bool((out == i).all()):
                    errors.append(f"object {i} read with foreign bytes")
                seen.append(i)
                pending.discard(i)

    t = threading.Thread(target=reader)
    t.start()
    for i in range(n):
        hs = a.allocate([f"hw:{i}"], [size])
        assert hs is not None and hs[0] is not None
        a.write(hs[0], 0, torch.full((size,), i, dtype=torch.uint8))
        a.commit(hs)
    done.set()
    t.join(60)
    assert not t.is_alive()
    assert not errors
    # whatever the race left unseen is there and whole now
    for i in set(range(n)) - set(seen):
        pin = b.pin([f"hw:{i}"])
        assert pin is not None
        out = torch.empty(size, dtype=torch.uint8)
        b.read(pin, f"hw:{i}", 0, out)
        b.unpin(pin)
        assert bool((out == i).all())


def test_pinned_object_survives_removal_by_the_master(stores: list[MooncakeStore]) -> None:
    a, b = stores
    data = payload(5, 1)
    put(a, ["pin:0"], data)
    pin = b.pin(["pin:0"])
    assert pin is not None
    assert a.client.remove("pin:0", True) == 0  # gone from the store
    assert b.lookup_prefix(["pin:0"]) == 0 and b.pin(["pin:0"]) is None  # a miss ...
    out = torch.empty_like(data[0])
    b.read(pin, "pin:0", 0, out)  # ... but the pinned copy still reads whole
    assert torch.equal(out, data[0])
    b.unpin(pin)


def test_eviction_by_the_master_is_a_miss(master: MooncakeMaster) -> None:
    """One client with a 16 MiB segment stores 40 MiB: the master evicts old objects;
    those become misses (lookup 0, pin None), never errors; puts refused while the
    master is full are skipped saves."""
    s = make_store(master, global_segment_bytes=SEG)
    try:
        data = payload(6, 4)
        committed: list[str] = []
        # The master evicts in the background once the segment is nearly full; until it
        # has, puts are refused for space (skipped saves). Keep storing until more than
        # fits was stored, bounded by a deadline, not by a round count.
        deadline = time.monotonic() + 60
        r = 0
        while len(committed) * PAGE <= SEG:
            assert time.monotonic() < deadline, f"only {len(committed)} objects stored: the master never evicted"
            keys = [f"ev:{r}:{j}" for j in range(4)]
            r += 1
            before = s.stats().committed_objects
            hs = s.allocate(keys, [PAGE] * 4)
            assert hs is not None
            s.write_batch(hs, data)
            s.commit(hs)
            if s.stats().committed_objects - before == 4:
                committed += keys
            else:
                time.sleep(0.05)  # full: give the master's eviction a moment
        evicted = [k for k in committed if not s.contains(k)]
        assert evicted, "the master evicted nothing"
        assert s.pin(evicted[:1]) is None
        assert s.lookup_prefix([evicted[0], committed[-1]]) == 0
        # The master evicts in the background: a key seen live may go before it is pinned.
        # A pin holds it; the newest key that can still be pinned must read back exactly.
        pin, live = None, ""
        for live in reversed(committed):
            pin = s.pin([live])
            if pin is not None:
                break
        assert pin is not None, "no committed object could be pinned"
        out = torch.empty(PAGE, dtype=torch.uint8)
        s.read(pin, live, 0, out)
        assert torch.equal(out, data[int(live.rsplit(":", 1)[1])])
        s.unpin(pin)
        st = s.stats()
        assert st.miss_objects >= 1 and st.free_pages == st.total_pages
    finally:
        s.close()


def test_master_outage_is_misses_logged_once_then_resumes(
    master: MooncakeMaster, stores: list[MooncakeStore], caplog: pytest.LogCaptureFixture
) -> None:
    a, b = stores
    caplog.set_level(logging.WARNING, logger="ascend_offload.store")
    data = payload(7, 2)
    put(a, ["out:0", "out:1"], data)
    hs = a.allocate(["out:late"], [PAGE])  # a save in flight when the master dies
    assert hs is not None
    master.stop()
    a.write(hs[0], 0, data[0])
    a.commit(hs)  # skipped, not raised
    assert a.stats().skipped_stores == 1 and a.stats().pending_objects == 0
    for _ in range(50):  # many calls, one log line
        assert b.lookup_prefix(["out:0", "out:1"]) == 0
        assert b.pin(["out:0"]) is None
        assert a.allocate(["out:2"], [PAGE]) is None
    time.sleep(0.3)  # past retry_interval_s: the background probes ask again, the data path does not
    assert b.lookup_prefix(["out:0"]) == 0 and a.allocate(["out:2"], [PAGE]) is None
    assert a.is_down() and b.is_down()
    down = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(down) == 2 and a.outages == 1 and b.outages == 1  # one line per client
    assert a.stats().free_pages == a.stats().total_pages

    master.start()  # the index restarts empty; clients remount their segments
    deadline = time.monotonic() + 30
    while True:
        assert time.monotonic() < deadline, "service did not resume"
        hs = a.allocate(["out:after"], [PAGE])
        if hs is not None:
            if hs[0] is not None:  # None: an earlier round stored it while b still probed
                a.write_batch(hs, data[:1])
                a.commit(hs)
            if b.lookup_prefix(["out:after"]) == 1:
                break
        time.sleep(0.2)
    pin = b.pin(["out:after"])
    assert pin is not None
    out = torch.empty(PAGE, dtype=torch.uint8)
    b.read(pin, "out:after", 0, out)
    b.unpin(pin)
    assert torch.equal(out, data[0])
    up = [r for r in caplog.records if "service resumed" in r.getMessage()]
    assert len(up) == 2
    assert not a.is_down() and not b.is_down()


WRITER = textwrap.dedent("""
    import sys, torch
    from ascend_offload.bench.stores.mooncake import MooncakeStore
    s = MooncakeStore(master_address=sys.argv[1], page_bytes=65536, staging_bytes=16 * 65536,
                      global_segment_bytes=64 << 20, local_buffer_bytes=16 << 20)
    data = torch.arange(8 * 65536, dtype=torch.int64).remainder(251).to(torch.uint8).view(8, 65536)
    hs = s.allocate([f"proc:{i}" for i in range(8)], [65536] * 8)
    s.write_batch(hs, data)
    s.commit(hs)
    print("stored", s.stats().committed_objects, flush=True)
    sys.stdin.readline()  # keep the segment (holding the bytes) mounted until told
    s.close()
""")


def test_second_process_reads_what_the_first_committed(master: MooncakeMaster) -> None:
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", WRITER, master.address], cwd=root,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "stored 8"
        s = make_store(master)
        try:
            keys = [f"proc:{i}" for i in range(8)]
            assert s.lookup_prefix(keys) == 8
            pin = s.pin(keys)
            assert pin is not None
            out = torch.empty(8, PAGE, dtype=torch.uint8)
            s.read_batch(pin, keys, out)
            s.unpin(pin)
            want = torch.arange(8 * PAGE, dtype=torch.int64).remainder(251).to(torch.uint8).view(8, PAGE)
            assert torch.equal(out, want)
        finally:
            s.close()
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_built_from_config(master: MooncakeMaster) -> None:
    from ascend_offload.bench.stores.mooncake import mooncake_store_from_config
    from ascend_offload.config import StoreConnectorConfig, parse

    cfg = parse(StoreConnectorConfig, {"backend": "mooncake", "mooncake": {
        "master_address": master.address, "global_segment_bytes": SEG}}, where="store config")
    s = mooncake_store_from_config(cfg.mooncake, object_bytes=PAGE, staging_bytes=8 * PAGE, local_buffer_bytes=SEG)
    try:
        assert s.page_bytes == PAGE and s.stats().total_pages == 8
        data = payload(8, 2)
        put(s, ["cfg:0", "cfg:1"], data)
        pin = s.pin(["cfg:0", "cfg:1"])
        assert pin is not None
        out = torch.empty_like(data)
        s.read_batch(pin, ["cfg:0", "cfg:1"], out)
        s.unpin(pin)
        assert torch.equal(out, data)
    finally:
        s.close()


def test_layerwise_pipeline_on_mooncake_shares_a_prefix_between_clients(master: MooncakeMaster) -> None:
    """The per-layer pipeline (aliased slot buffers, native row copies) over two
    Mooncake clients: a prefix instance 1 computed and saved layer by layer is loaded
    by instance 2, and every layer's attention sees exactly that layer's KV."""
    from ascend_offload.layerwise.plan import plan_uniform
    from ascend_offload.layerwise.steps import default_key
    from tests.unit.layerwise.test_pipeline import PAGE_BYTES, Sim, chunked_prefill

    one = make_store(master, page_bytes=PAGE_BYTES, staging_bytes=4096 * PAGE_BYTES)
    two = make_store(master, page_bytes=PAGE_BYTES, staging_bytes=4096 * PAGE_BYTES)
    try:
        sim1 = Sim(plan_uniform(8, 2, [0]), one, prefetch_layers=2)
        keys = [f"lw{i}" for i in range(6)]
        chunked_prefill(sim1, keys, blocks=[0, 1, 2, 3, 4, 5], chunk=2)
        sim1.pipe.drain()
        assert sim1.pipe.stats().blocks_saved == 8 * 6
        sim2 = Sim(plan_uniform(8, 2, [0]), two, prefetch_layers=2)
        obj = [default_key(k, layer) for k in keys[:4] for layer in sim2.plan.layers]
        assert two.lookup_prefix(obj) == len(obj)  # instance 1's saves, seen by instance 2
        keys2 = [*keys[:4], "lw-b4", "lw-b5"]
        chunked_prefill(sim2, keys2, blocks=[8, 9, 10, 11, 12, 13], chunk=2, hits=4)
        sim2.pipe.drain()
        assert sim1.mismatches == [] and sim2.mismatches == []
        st = sim2.pipe.stats()
        assert st.load_errors == 0 and st.save_errors == 0
        assert st.blocks_loaded >= 8 * 4  # the 4-block prefix, every layer
        assert st.native_jobs > 0  # rows moved by the native copy queue
        sim1.pipe.close()
        sim2.pipe.close()
    finally:
        one.close()
        two.close()


def test_bench_row_measures_both_baselines(master: MooncakeMaster) -> None:
    from ascend_offload.bench.store import bench_mooncake

    row = bench_mooncake(master.address, PAGE, 16, repeats=2)  # raises if bytes changed
    for k in ("save_ratio", "load_ratio", "zero_copy_save_ratio", "zero_copy_load_ratio",
              "raw_save_GBps", "zero_copy_load_GBps"):
        assert row[k] > 0, k
    assert row["path"] == "mooncake" and row["total_bytes"] == 16 * PAGE


def test_staging_bookkeeping_stays_bounded(stores: list[MooncakeStore]) -> None:
    """Many save/load rounds leave nothing behind in the staging pool."""
    a, b = stores
    data = payload(9, 4)
    for r in range(30):
        keys = [f"bd{r}:{j}" for j in range(4)]
        put(a, keys, data)
        pin = b.pin(keys)
        assert pin is not None
        b.unpin(pin)
    for s in (a, b):
        assert s._staging.take_freed() == []  # drained as it goes
        st = s.stats()
        assert st.free_pages == st.total_pages and st.pending_objects == 0 and st.pinned_objects == 0
        assert s._staging.stats().stored_objects == 0 and s._staging.stats().pending_objects == 0
