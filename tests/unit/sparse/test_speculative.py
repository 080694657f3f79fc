"""Speculative decoding with sparse decode offload, below the engine: the startup checks
(method, hot-buffer size for k drafts, reservations), the plan of verification rows,
the union resolve of a verification row's top-k sets and the rollback of rejected
drafts (the stable-length rule), through the real manager and both residency backends."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ascend_offload.config import ConfigError, SparseOffloadConfig
from ascend_offload.connectors.sparse_decode.settings import (
    SparseDecodeSettings,
    speculative_tokens,
)
from ascend_offload.sparse.adapter import BatchRow
from ascend_offload.sparse.colocated import ColocatedSparseDecode
from ascend_offload.sparse.manager import SparseOffloadManager

ROW = 3
TOPK = 4
BS = 4


def _vllm(spec: Any, block: int = 32) -> Any:
    return SimpleNamespace(speculative_config=spec, cache_config=SimpleNamespace(block_size=block))


def _cfg(hot: int, topk: int = 32) -> SparseOffloadConfig:
    return SparseOffloadConfig(enabled=True, topk_buffer_size=hot, index_topk=topk)


def test_speculation_needs_a_method_without_draft_layers_and_a_hot_buffer_for_the_union() -> None:
    assert speculative_tokens(_vllm(None), _cfg(64), 32) == 0
    ngram = SimpleNamespace(method="ngram", num_speculative_tokens=3)
    assert speculative_tokens(_vllm(ngram), _cfg(128), 32) == 3
    with pytest.raises(ConfigError, match=r"'speculative_config\.method'='eagle'.*accepted: 'ngram'"):
        speculative_tokens(_vllm(SimpleNamespace(method="eagle", num_speculative_tokens=1)),
                           _cfg(128), 32)
    # 4 query tokens x top-k 32 = 128 rows; the message names both keys and the size
    with pytest.raises(ConfigError, match=r"'sparse_offload\.topk_buffer_size'=96 with "
                       r"'speculative_config\.num_speculative_tokens'=3.*smallest size that "
                       r"works is 128"):
        speculative_tokens(_vllm(ngram), _cfg(96), 32)
    # rounded up to whole blocks: 3 x 20 = 60 -> 64
    two = SimpleNamespace(method="ngram", num_speculative_tokens=2)
    with pytest.raises(ConfigError, match="smallest size that works is 64"):
        speculative_tokens(_vllm(two), _cfg(32, 20), 20)
    assert speculative_tokens(_vllm(two), _cfg(64, 20), 20) == 2


def test_reservations_cover_the_drafts_of_the_last_step() -> None:
    """vLLM bounds drafts by max_model_len, not max_tokens: the last step of a request
    may write k positions past prompt + max_tokens."""
    base = dict(cfg=_cfg(128), index_topk=32, block_size=32, max_model_len=1000, max_num_seqs=4,
                layers=("l0",), group=0, row_bytes=4, pool_blocks=100)
    assert SparseDecodeSettings(**base).reservation(500, 20) == 520
    spec = SparseDecodeSettings(**base, spec_tokens=3)
    assert spec.query_tokens == 4
    assert spec.reservation(500, 20) == 523
    assert spec.reservation(990, 20) == 1000  # capped
    assert spec.reservation(None, 20) == 1000


def _decode(query_tokens: int, hot: int = 16, backend: str = "host", use_native: str = "auto"
            ) -> ColocatedSparseDecode:
    cfg = SparseOffloadConfig(enabled=True, topk_buffer_size=hot, index_topk=TOPK,
                              residency_backend=backend, use_native=use_native)
    mgr = SparseOffloadManager(cfg, num_layers=2, row_shape=(ROW,), dtype=torch.float32,
                               block_size=BS, max_requests=2, index_topk=TOPK, pool_rows=128)
    return ColocatedSparseDecode(mgr, ["l.0.attn", "l.1.attn"], query_tokens=query_tokens)


def test_a_hot_buffer_too_small_for_the_union_is_refused() -> None:
    with pytest.raises(ValueError, match=r"query_tokens=5: .* hot buffer of 16 rows"):
        _decode(5)
    assert _decode(4).query_tokens == 4


def test_verification_rows_decode_from_the_hot_buffer_and_longer_rows_from_the_pool() -> None:
    d = _decode(4)
    assert d.admit("a", 40) and d.admit("b", 40)
    d.begin(1, {0: "a", 1: "b"})
    plan = d.plan_step([BatchRow(0, 10, 10), BatchRow(1, 3, 3)])  # prefill chunks
    assert plan.decode == (False, True) and plan.query_tokens == 4  # 3 tokens: hot buffer too
    assert d.verify_rows == 0  # no drafts this step
    d.end_step()
    d.begin(2, {2: "a", 3: "b"}, {"a": 3, "b": 3})
    plan = d.plan_step([BatchRow(2, 14, 4), BatchRow(3, 7, 4)])  # 1 + 3 drafts each
    assert plan.decode == (True, True) and plan.offload_from == (10, 3)
    assert d.verify_rows == 2
    d.end_step()
    d.begin(3, {4: "a"})
    assert d.plan_step([BatchRow(4, 19, 5)]).decode == (False,)  # beyond 1 + k: the pool


def test_rejected_drafts_are_rewritten_not_recomputed() -> None:
    d = _decode(4)
    assert d.admit("a", 40)
    d.begin(1, {0: "a"})
    d.plan_step([BatchRow(0, 10, 10)])
    d.end_step()
    d.begin(2, {1: "a"}, {"a": 3})
    d.plan_step([BatchRow(1, 14, 4)])  # positions 10..13: 11..13 are drafts
    d.end_step()
    d.begin(3, {2: "a"}, {"a": 3})
    plan = d.plan_step([BatchRow(2, 16, 4)])  # one draft accepted: 12..15 written again
    assert plan.offload_from == (12,)
    assert d.recomputed_tokens == 0
    d.end_step()
    d.begin(4, {3: "a"})
    d.plan_step([BatchRow(3, 14, 14)])  # a real recomputation of positions 0..13
    # positions 0..12 were certain (12 was accepted; 13 a draft of step 3)
    assert d.recomputed_tokens == 13


@pytest.mark.parametrize(("backend", "use_native"),
                         [("host", "auto"), ("host", "off"), ("device", "auto"), ("device", "off")])
def test_a_verification_row_reads_its_own_positions_and_drafts_roll_back(
        backend: str, use_native: str) -> None:
    """Query token t of a verification row finds its positions in columns t*K..t*K+K-1 of
    one resolve (duplicates across tokens share a slot); after a rejection the rewritten
    draft positions are served fresh, never from the stale hot rows."""
    d = _decode(4, backend=backend, use_native=use_native)
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(40, ROW, generator=g)
    assert d.admit("a", 40)
    d.begin(1, {0: "a"})
    d.plan_step([BatchRow(0, 10, 10)])
    for layer in range(2):
        d.offload_new_kv(layer, kv[:10] + layer, torch.tensor([[0, p] for p in range(10)]))
    d.end_step()

    def verify(step: int, num_tokens: int, new: torch.Tensor, sets: list[list[int]]) -> None:
        first = num_tokens - new.shape[0]
        d.begin(step, {step: "a"}, {"a": new.shape[0] - 1})
        plan = d.plan_step([BatchRow(step, num_tokens, new.shape[0])])
        assert plan.decode == (True,)
        topk = torch.full((1, 4, TOPK), -1, dtype=torch.int32)
        for t, s in enumerate(sets):
            topk[0, t, : len(s)] = torch.tensor(s, dtype=torch.int32)
        for layer in range(2):
            d.offload_new_kv(layer, new + layer,
                             torch.tensor([[0, p] for p in range(first, num_tokens)]))
            slots = d.onload_topk(layer, topk.view(1, 4 * TOPK)).view(4, TOPK)
            for t, s in enumerate(sets):
                got = d.hot_buffer(layer)[slots[t, : len(s)].long()]
                want = torch.cat([(kv[p] if p < first else new[p - first]).view(1, ROW)
                                  for p in s]) + layer
                assert torch.equal(got, want), (step, layer, t)
                assert bool((slots[t, len(s):] == -1).all())
        d.end_step()

    # step 2: position 10 + drafts 11..13; each token's top-k includes itself
    drafts = kv[10:14]
    verify(2, 14, drafts, [[1, 4, 9, 10], [4, 9, 10, 11], [9, 10, 11, 12], [10, 11, 12, 13]])
    # one draft accepted (11): step 3 rewrites 12..15 with other values
    kv[12:16] = -kv[12:16] - 5
    verify(3, 16, kv[12:16], [[4, 11, 12], [11, 12, 13], [12, 13, 14], [9, 13, 14, 15]])
    stats = d.manager.stats
    assert stats.pool_query_tokens == 0  # nothing but the prefill went to the pool
