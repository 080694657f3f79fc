"""AscendStoreConnector with backend ``mooncake`` on real vLLM CPU engines sharing one
Mooncake Store (a real ``mooncake_master`` on 127.0.0.1, started and stopped here).

Engines run one after another: A (whole-prefix) computes and publishes PROMPTS; C
(layerwise) loads them from the store and publishes PROMPTS_L; B (whole-prefix, a
small local pool) loads both sets, then its master is killed mid-run and restarted.
Every answer is compared with an engine without a connector (float32, greedy). The
store's memory is a segment of this test process (engines contribute none), so
objects outlive the engine that published them.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("mooncake.store", reason="needs mooncake-transfer-engine-non-cuda and libibverbs")

import torch

from ascend_offload.harness.tiny_model import random_prompts
from ascend_offload.store.services.mooncake_master import MooncakeMaster, master_binary
from ascend_offload.store.shared.mooncake import RemotePages
from tests.e2e.harness import BLOCK_SIZE, generate, make_engine, store_transfer_config, tokens

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(master_binary() is None, reason="mooncake_master not installed"),
]

ENGINE_ARGS: dict[str, Any] = dict(max_num_batched_tokens=128, max_num_seqs=4, max_model_len=1024)
PROMPTS = random_prompts(3, [200, 333, 97], seed=11)
PROMPTS_L = random_prompts(3, [260, 150, 300], seed=12)
OUTAGE = random_prompts(4, [180, 240, 120, 300], seed=13)  # B's batch when the master is killed
DOWN = random_prompts(2, [230, 170], seed=14)  # B, master down
RESUME = random_prompts(3, [210, 190, 250], seed=15)  # B, after the restart: published, fetched back
FILLER = random_prompts(3, [400, 400, 400], seed=16)  # pushes a RESUME prompt out of B's local pool
ALL = PROMPTS + PROMPTS_L + OUTAGE + DOWN + RESUME + FILLER
OBJECT_BYTES = 4 * 2 * BLOCK_SIZE * 64 * 4  # one block of the 4-layer tiny model
B_LOCAL_PAGES = 32


def blocks(p: list[int]) -> int:
    """Blocks a store hit can cover: vLLM computes at least the last prompt token."""
    return (len(p) - 1) // BLOCK_SIZE


def st(out: Any) -> dict[str, Any]:
    assert out.kv_transfer_params is not None, "connector returned no stats"
    return out.kv_transfer_params["ascend_store"]


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """The master, and this process's client holding the store's memory."""
    os.environ.setdefault("GLOG_minloglevel", "3")  # Mooncake's own per-RPC error lines
    d = tmp_path_factory.mktemp("mooncake")
    with MooncakeMaster(d / "master.log") as m:
        cfg = SimpleNamespace(master_address=m.address, local_hostname="127.0.0.1",
                              metadata_server="P2PHANDSHAKE", protocol="tcp", device_name="",
                              global_segment_bytes=256 << 20, retry_interval_s=0.5)
        holder = RemotePages(cfg, {"probe": torch.zeros((1, 4096), dtype=torch.uint8)}, rank=0)
        try:
            yield SimpleNamespace(master=m, holder=holder, dir=d)
        finally:
            holder.close()


def mooncake_config(master: SimpleNamespace, local_bytes: int = 256 << 20, **extra: Any) -> dict[str, Any]:
    return store_transfer_config({
        "backend": "mooncake",
        "local": {"capacity_bytes": local_bytes},
        "mooncake": {"master_address": master.master.address, "global_segment_bytes": 0,
                     "retry_interval_s": 0.5},
        **extra,
    })


@pytest.fixture(scope="module")
def baseline() -> dict[tuple[int, ...], list[int]]:
    """Tokens of an engine without a connector (in-process: it starts in seconds)."""
    with make_engine(core=0, **ENGINE_ARGS) as llm:
        return {tuple(p): t for p, t in zip(ALL, tokens(generate(llm, ALL)), strict=True)}


def run(llm: Any, prompts: list[list[int]], baseline: dict[tuple[int, ...], list[int]]) -> list[Any]:
    """Generate, and check every answer against the plain engine."""
    outs = generate(llm, prompts)
    for p, o in zip(prompts, outs, strict=True):
        assert list(o.outputs[0].token_ids) == baseline[tuple(p)], f"tokens differ for a {len(p)}-token prompt"
    return outs


def one_by_one(llm: Any, prompts: list[list[int]], baseline: dict[tuple[int, ...], list[int]]) -> list[Any]:
    return [run(llm, [p], baseline)[0] for p in prompts]


@pytest.fixture(scope="module")
def engine_a(master: SimpleNamespace, baseline: dict) -> dict[str, Any]:
    """A: whole-prefix mode; computes PROMPTS and publishes their blocks, then exits."""
    before = master.master.key_count()
    with make_engine(core=1, in_process=False, kv_transfer_config=mooncake_config(master), **ENGINE_ARGS) as llm:
        outs = one_by_one(llm, PROMPTS, baseline)
    return {"outs": outs, "published": master.master.key_count() - before}


@pytest.fixture(scope="module")
def engine_c(master: SimpleNamespace, baseline: dict, engine_a: dict) -> dict[str, Any]:
    """C: layerwise mode; loads PROMPTS from the store, computes and publishes PROMPTS_L."""
    cfg = mooncake_config(master, use_layerwise=True, layerwise_num_shared_buffers=2,
                          layerwise_independent_layers=[0], layerwise_prefetch_layers=1)
    with make_engine(core=1, in_process=False, kv_transfer_config=cfg, **ENGINE_ARGS) as llm:
        loads = one_by_one(llm, PROMPTS, baseline)
        before = master.master.key_count()
        saves = run(llm, PROMPTS_L, baseline)
        published = master.master.key_count() - before
    return {"loads": loads, "saves": saves, "published": published}


@contextlib.contextmanager
def output_to(path: Path) -> Iterator[None]:
    """fds 1 and 2 go to ``path`` while an engine starts: its processes inherit them, so
    their log lines land there for the engine's lifetime."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with path.open("ab") as fh:
        os.dup2(fh.fileno(), 1)
        os.dup2(fh.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)


@pytest.fixture(scope="module")
def engine_b(master: SimpleNamespace, engine_c: dict) -> Iterator[SimpleNamespace]:
    """B: whole-prefix mode with a local pool of B_LOCAL_PAGES blocks; its log in a file."""
    log = master.dir / "engine_b.log"
    cfg = mooncake_config(master, local_bytes=B_LOCAL_PAGES * OBJECT_BYTES)
    with output_to(log):
        ctx = make_engine(core=1, in_process=False, kv_transfer_config=cfg, **ENGINE_ARGS)
        llm = ctx.__enter__()
    try:
        yield SimpleNamespace(llm=llm, log=log)
    finally:
        ctx.__exit__(None, None, None)


def log_lines(path: Path, text: str) -> list[str]:
    return [line for line in path.read_text(errors="replace").splitlines() if text in line]


def test_layerwise_engine_loads_from_and_publishes_to_the_store(engine_a: dict, engine_c: dict) -> None:
    """C (layerwise) loads, layer by layer, the prefixes A (whole-prefix) published, and
    publishes what it computed; every answer identical to the plain engine."""
    assert engine_a["published"] >= sum(len(p) // BLOCK_SIZE for p in PROMPTS)
    for p, o in zip(PROMPTS, engine_c["loads"], strict=True):
        s = st(o)
        assert s["loaded_blocks"] == blocks(p) and s["remote_blocks"] == blocks(p), (len(p), s)
    for p, o in zip(PROMPTS_L, engine_c["saves"], strict=True):
        assert st(o)["saved_blocks"] >= len(p) // BLOCK_SIZE and st(o)["remote_blocks"] == 0
    assert engine_c["published"] >= sum(len(p) // BLOCK_SIZE for p in PROMPTS_L)


def test_second_prefill_engine_loads_what_others_computed(engine_a: dict, engine_b: SimpleNamespace,
                                                         baseline: dict) -> None:
    """B's local pool starts empty: every hit comes from the shared store (A's blocks
    and C's), counted per request, with identical tokens."""
    for p, o in zip(PROMPTS, engine_a["outs"], strict=True):
        assert st(o)["loaded_blocks"] == 0 and st(o)["saved_blocks"] >= len(p) // BLOCK_SIZE
    for p in PROMPTS + PROMPTS_L:
        s = st(run(engine_b.llm, [p], baseline)[0])
        assert s["loaded_blocks"] == blocks(p) and s["remote_blocks"] == blocks(p), (len(p), s)
        assert s["store"]["remote_outages"] == 0
        assert s["store"]["pinned_objects"] == 0 and s["store"]["pending_objects"] == 0


def test_master_killed_mid_run_then_back(master: SimpleNamespace, engine_b: SimpleNamespace,
                                         baseline: dict) -> None:
    """Killed while a batch runs: every request answers identically (misses recompute),
    the scheduler logs the outage once; after the restart a prefix is published and
    loaded back from the store."""
    m, llm = master.master, engine_b.llm
    killer = threading.Timer(0.3, m.stop)
    killer.start()
    try:
        run(llm, OUTAGE, baseline)
    finally:
        killer.join()
    down = one_by_one(llm, DOWN, baseline)  # the outage is seen by now
    for o in down:
        assert st(o)["remote_blocks"] == 0
    assert st(down[-1])["store"]["remote_outages"] == 1

    m.start()  # an empty index; the holder remounts its segment by heartbeat
    deadline = time.monotonic() + 60
    probe = 0
    while master.holder.counts.published_blocks == probe:
        assert time.monotonic() < deadline, "the store's segment was not remounted"
        probe = master.holder.counts.published_blocks
        master.holder.publish([f"probe-{time.monotonic()}"], [0])
        time.sleep(0.2)
    # The scheduler's and the rank's probes (retry_interval_s) see the master back on their
    # own schedule, and a publish can still meet the remount window: try until one
    # prefix round-trips through the store, bounded by a deadline, not by a count.
    deadline = time.monotonic() + 120
    s: dict[str, Any] = {}
    for attempt in itertools.count():
        assert time.monotonic() < deadline, f"no prefix loaded from the store after the restart: {s}"
        p = RESUME[attempt % len(RESUME)]
        one_by_one(llm, [p], baseline)  # computed (or loaded), published
        one_by_one(llm, FILLER, baseline)  # pushes it out of B's local pool
        s = st(run(llm, [p], baseline)[0])
        if s["remote_blocks"] == blocks(p):
            break
    assert s["store"]["remote_outages"] == 1
    llm.llm_engine.engine_core.shutdown()  # flush the engine's log before reading it
    sched = log_lines(engine_b.log, "unreachable from the scheduler")
    ranks = log_lines(engine_b.log, "unreachable from worker rank")
    assert len(sched) == 1, sched
    assert len(ranks) <= 1, ranks
    assert log_lines(engine_b.log, "answers the scheduler again: store service resumed")
