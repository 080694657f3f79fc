"""Decode TP=2 on one shared host pool, as two real worker processes (spawned).

Each process runs the reference sparse decoder (``tests/support/sparse_reference.py``)
over the same schedule with its own :class:`SparseOffloadManager`, like the TP ranks
of one decode engine: rank 0 creates the pool under ``/dev/shm`` and writes every
prompt and new row; rank 1 attaches, writes nothing, and reads only after rank 0's
per-layer publish fence, while rank 0 ends each step only after rank 1 finished its
reads (rows freed at a step boundary are reused by a later request here). Both
ranks' logits must be bit-identical to the full-KV reference, rank 1 must have
written no row, and both ranks must see the same pool bytes at the end.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import random
import uuid
from typing import Any

import torch

from ascend_offload.config import SparseOffloadConfig
from ascend_offload.sparse.manager import SparseOffloadManager
from ascend_offload.sparse.pools import HostKVPool
from tests.support.sparse_reference import (
    FullKV,
    OffloadKV,
    RefConfig,
    RefDecoder,
    RefWeights,
)

# (request, prompt length, join step, leave step); "d" joins after "b" left and takes its rows
SCHEDULE = [("a", 700, 0, 24), ("b", 1100, 0, 10), ("c", 400, 2, 24), ("d", 900, 11, 24)]
STEPS = 24
BLOCK = 32
POOL_ROWS = 96 * BLOCK  # fewer blocks than all requests together: "d" reuses "b"'s blocks
TIMEOUT_S = 120.0


class _ReaderKV(OffloadKV):
    """Rank > 0: admissions are replayed (same block tables), prompt rows are rank 0's."""

    def write_prompt(self, layer: int, req_id: str, kv: torch.Tensor) -> None:
        return None


def _run(cfg: RefConfig, backend: Any) -> tuple[list[torch.Tensor], dict[str, list[int]]]:
    dec = RefDecoder(cfg, RefWeights(cfg), backend)
    rng = random.Random(3)
    prompts = {r: [rng.randrange(cfg.vocab) for _ in range(n)] for r, n, _, _ in SCHEDULE}
    logits, outputs, active = [], {}, []
    for step in range(STEPS):
        for r, _, _join, leave in SCHEDULE:
            if leave == step and r in active:
                outputs[r] = dec.finish(r)
                active.remove(r)
        for r, _, join, leave in SCHEDULE:
            if join == step:
                dec.add_request(r, prompts[r], max_new_tokens=leave - join + 1)
                active.append(r)
        logits.append(dec.step(list(active)))
    for r in list(active):
        outputs[r] = dec.finish(r)
    return logits, outputs


def _rank(rank: int, name: str, created: Any, attached: Any, out: Any) -> None:
    """One TP rank's process; puts (rank, logits, outputs, offload_rows, pool sha256, freed)
    or (rank, error)."""
    try:
        cfg = RefConfig(topk=64)
        shape = dict(num_layers=cfg.num_layers, num_rows=POOL_ROWS, row_shape=(cfg.latent,),
                     dtype=torch.float32, block_size=BLOCK, shared_name=name)
        if rank == 0:
            pool = HostKVPool(**shape, create=True)
            created.set()
        else:
            if not created.wait(TIMEOUT_S):
                raise TimeoutError("rank 0 did not create the pool")
            pool = HostKVPool(**shape, create=False)
        scfg = SparseOffloadConfig(enabled=True, topk_buffer_size=128, index_topk=64)
        mgr = SparseOffloadManager(scfg, num_layers=cfg.num_layers, row_shape=(cfg.latent,),
                                   dtype=torch.float32, block_size=BLOCK, max_requests=4, pool=pool,
                                   tp_rank=rank, fence_timeout_s=TIMEOUT_S)
        if rank == 0:  # in an engine every rank has attached before the first step
            if not attached.wait(TIMEOUT_S):
                raise TimeoutError("rank 1 did not attach")
            pool.unlink()  # both mapped it: the name can go (what the engine's rank 0 does)
        else:
            attached.set()
        logits, outputs = _run(cfg, OffloadKV(mgr) if rank == 0 else _ReaderKV(mgr))
        sha = hashlib.sha256(pool.kv.numpy().tobytes()).hexdigest()
        out.put((rank, [t.numpy() for t in logits], outputs, mgr.stats.offload_rows, sha,
                 mgr.pool.free_blocks == mgr.pool.num_blocks))
    except BaseException as exc:  # reported to the parent, which fails the test
        out.put((rank, repr(exc)))


def test_tp2_ranks_share_one_pool_across_processes() -> None:
    cfg = RefConfig(topk=64)
    full_logits, full_out = _run(cfg, FullKV(cfg.num_layers, cfg.latent))
    ctx = mp.get_context("spawn")
    name = f"tp_{uuid.uuid4().hex[:8]}"
    created, attached, out = ctx.Event(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, name, created, attached, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        results: dict[int, Any] = {}
        for _ in procs:
            item = out.get(timeout=600)
            assert len(item) > 2, f"rank {item[0]} failed: {item[1]}"
            results[item[0]] = item
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        if os.path.exists(f"/dev/shm/ascend_offload_{name}"):
            os.unlink(f"/dev/shm/ascend_offload_{name}")
    for rank in (0, 1):
        _, logits, outputs, _, _, freed = results[rank]
        assert len(logits) == STEPS
        for step, (a, b) in enumerate(zip(full_logits, logits, strict=True)):
            assert torch.equal(a, torch.from_numpy(b)), f"rank {rank}: logits differ at step {step}"
        assert outputs == full_out
        assert freed
    # rank 0 wrote every prompt-free decode row of every layer, rank 1 none
    assert results[1][3] == 0 and results[0][3] == sum(len(x) for x in full_logits) * cfg.num_layers
    assert results[0][4] == results[1][4]  # one pool: both ranks see the same bytes
