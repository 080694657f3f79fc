"""Shared scenario: a prefill publishes reference-model prompt KV, decode pulls it into a HostKVPool.

Used by the in-process loopback tests (``test_pool_destination.py``) and the
Mooncake TCP integration test (``tests/integration/test_pd_pool_mooncake.py``),
whose prefill runs in a spawned process (:func:`prefill_process`).
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass

import torch

from ascend_offload.config import SparseOffloadConfig
from ascend_offload.pd.consumer import Consumer
from ascend_offload.pd.layout import layer_desc, pool_layer_descs
from ascend_offload.pd.producer import DecodeTarget, Producer
from ascend_offload.pd.topology import Topology
from ascend_offload.sparse.manager import SparseOffloadManager
from ascend_offload.sparse.pools import HostKVPool
from ascend_offload.transfer.base import TransferEngine
from tests.support.sparse_reference import (
    FullKV,
    PulledKV,
    RefConfig,
    RefDecoder,
    RefWeights,
    prefill_kv,
)

BLOCK = 16
CFG = RefConfig(num_layers=3, latent=16, topk=32, seed=3)
# Different lengths, partial last blocks; the longest is far above the hot buffer (2 x top-k).
PROMPT_LENS = {"a": 150, "b": 37, "c": 96}
MAX_NEW = 20
PREFILL_BLOCKS = 48
WAIT_S = 20.0


def prompts(lens: dict[str, int] = PROMPT_LENS, seed: int = 7) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {r: [rng.randrange(CFG.vocab) for _ in range(n)] for r, n in lens.items()}


@dataclass
class PrefillKV:
    """Prefill node state: paged main KV per layer ``[blocks, BLOCK, latent]`` + block lists."""

    kv: list[torch.Tensor]
    indexer: list[torch.Tensor] | None
    blocks: dict[str, list[int]]
    rows: dict[str, list[torch.Tensor]]  # per request, per layer: the prompt rows [len, latent]
    index_rows: dict[str, list[torch.Tensor]]


def build_prefill(reqs: dict[str, list[int]], *, latent: int = CFG.latent, with_indexer: bool = False,
                  dtype: torch.dtype = torch.float32) -> PrefillKV:
    """Reference prefill of every prompt, scattered into non-contiguous prefill blocks.

    Unused blocks and the tail of each last block hold noise, so a read of the
    wrong block (or a write past the prompt) is visible.
    """
    cfg = dataclasses.replace(CFG, latent=latent)
    w = RefWeights(cfg)
    g = torch.Generator().manual_seed(11)
    kv = [torch.randn(PREFILL_BLOCKS, BLOCK, latent, generator=g).to(dtype) for _ in range(cfg.num_layers)]
    idx = ([torch.randn(PREFILL_BLOCKS, BLOCK, cfg.index_dim, generator=g) for _ in range(cfg.num_layers)]
           if with_indexer else None)
    free = list(range(PREFILL_BLOCKS - 1, -1, -1))[::2] + list(range(PREFILL_BLOCKS - 1, -1, -1))[1::2]
    blocks, rows, index_rows = {}, {}, {}
    for rid, prompt in reqs.items():
        n = -(-len(prompt) // BLOCK)
        blocks[rid], free = free[:n], free[n:]
        main, keys, _first = prefill_kv(cfg, w, prompt)
        rows[rid] = [m.to(dtype) for m in main]
        index_rows[rid] = keys
        pos = torch.arange(len(prompt))
        bt = torch.tensor(blocks[rid])
        for layer in range(cfg.num_layers):
            kv[layer][bt[pos // BLOCK], pos % BLOCK] = rows[rid][layer]
            if idx is not None:
                idx[layer][bt[pos // BLOCK], pos % BLOCK] = keys[layer]
    return PrefillKV(kv, idx, blocks, rows, index_rows)


def producer_for(pre: PrefillKV, transfer: TransferEngine, *, ack_timeout_s: float = 5.0) -> Producer:
    descs = [layer_desc([k], pre.indexer[i] if pre.indexer is not None else None)
             for i, k in enumerate(pre.kv)]
    return Producer(engine_id="P", p_rank=0, topology=Topology(1, 1), transfer=transfer, layers=descs,
                    ack_timeout_s=ack_timeout_s)


def make_pool(num_blocks: int, *, latent: int = CFG.latent) -> HostKVPool:
    pool = HostKVPool(CFG.num_layers, num_blocks * BLOCK, (latent,), torch.float32, BLOCK)
    pool.kv.zero_()
    return pool


def fragment(pool: HostKVPool) -> None:
    """Leave holes at the low end so pulled requests get non-contiguous pool blocks."""
    pool.admit("_hole1", 2 * BLOCK)
    pool.admit("_keep", 1 * BLOCK)
    pool.admit("_hole2", 3 * BLOCK)
    pool.release("_hole1")
    pool.release("_hole2")


def consumer_for(pool: HostKVPool, transfer: TransferEngine, port: int, *,
                 indexer: list[torch.Tensor] | None = None) -> Consumer:
    return Consumer(engine_id="D", d_rank=0, topology=Topology(1, 1), transfer=transfer,
                    layers=pool_layer_descs(pool.kv, BLOCK, indexer), port=port,
                    request_timeout_s=WAIT_S, pool_block_size=BLOCK)


def wait_sent(prod: Producer, n: int, timeout_s: float = WAIT_S) -> list:
    end, out = time.monotonic() + timeout_s, []
    while len(out) < n and time.monotonic() < end:
        out += prod.finished()
        time.sleep(0.01)
    return out


def assert_pool_matches(pool: HostKVPool, pre: PrefillKV, rids: list[str]) -> None:
    """Pool rows of every pulled request equal the prefill rows byte for byte, every layer;
    pool blocks no request owns are untouched (zero)."""
    for rid in rids:
        n = pre.rows[rid][0].shape[0]
        host = pool.rows_for(rid, torch.arange(n))
        for layer in range(pool.num_layers):
            got = pool.layer(layer)[host].contiguous().view(torch.uint8)
            want = pre.rows[rid][layer].contiguous().view(torch.uint8)
            assert torch.equal(got, want), f"request {rid!r} layer {layer}: pool rows differ"
    owned = {b for r in pool.admitted() for b in pool.block_table(r).tolist()}
    for b in sorted(set(range(pool.num_blocks)) - owned):
        assert not pool.kv[:, b * BLOCK:(b + 1) * BLOCK].any(), f"unowned pool block {b} was written"


def decode_parity(pool: HostKVPool, reqs: dict[str, list[int]], steps: int) -> SparseOffloadManager:
    """Decode ``steps`` steps from the pulled pool and from full local KV: logits bit-identical."""
    scfg = SparseOffloadConfig(enabled=True, topk_buffer_size=2 * CFG.topk, index_topk=CFG.topk,
                               dram_size_per_dp_GB=0.01, use_native="off")
    mgr = SparseOffloadManager(scfg, num_layers=CFG.num_layers, row_shape=(CFG.latent,),
                               dtype=torch.float32, block_size=BLOCK, max_requests=4, pool=pool)
    w = RefWeights(CFG)
    pulled = RefDecoder(CFG, w, PulledKV(mgr))
    full = RefDecoder(CFG, w, FullKV(CFG.num_layers, CFG.latent))
    for rid, prompt in reqs.items():
        pulled.add_request(rid, prompt, MAX_NEW)
        full.add_request(rid, prompt, MAX_NEW)
    ids = list(reqs)
    for step in range(steps):
        a, b = full.step(ids), pulled.step(ids)
        assert a.dtype == b.dtype == torch.float32
        assert torch.equal(a, b), f"logits differ at step {step}"
    for rid in ids:
        assert pulled.finish(rid) == full.finish(rid)
    assert mgr.stats.miss_rows > 0 and 0.0 < mgr.stats.hit_rate < 1.0  # the hot buffer really worked
    return mgr


def prefill_process(conn, reqs: dict[str, list[int]], host: str, kv_port: int) -> None:
    """Spawned prefill rank over Mooncake TCP: publish every layer of every request, report outcomes."""
    from ascend_offload.transfer.mooncake import MooncakeEngine

    eng = MooncakeEngine(host=host, timeout_s=10)
    pre = build_prefill(reqs)
    prod = producer_for(pre, eng, ack_timeout_s=15.0)
    try:
        for rid in reqs:
            prod.add_request(rid, pre.blocks[rid], DecodeTarget(host, kv_port, 1))
        conn.send("ready")
        if conn.poll(WAIT_S) and conn.recv() == "go":
            for layer in range(CFG.num_layers):
                prod.publish_layer(layer)
            sent = wait_sent(prod, len(reqs))
            conn.send([(s.request_id, s.ok, s.failed_layers) for s in sent])
        conn.poll(WAIT_S)
    finally:
        prod.close()
        eng.close()
