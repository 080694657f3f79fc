"""The sparse-attention math of the sparse-MLA model against float64 references
on plain tensors: the indexer formula, top-k = exactly the k best eligible
scores, attention over a paged (shuffled) row store = attention over the chosen
positions of a contiguous history, and top-k >= context = dense attention."""

from __future__ import annotations

import torch

from ascend_offload.models.sparse_attention import (
    causal_positions,
    gather_rows,
    indexer_scores,
    positions_to_slots,
    select_topk,
    sparse_attention,
)

H, D, R = 3, 12, 8  # heads, row width (latent + rope), latent (value) width
SCALE = D**-0.5


def _request(seq: int, q_len: int, seed: int = 0, num_rows: int = 512):
    """One request's history in a shuffled row store: (kv history [seq, D], store
    [num_rows, D], slots [seq], queries [q_len, H, D], q_pos [q_len])."""
    g = torch.Generator().manual_seed(seed)
    hist = torch.randn(seq, D, generator=g)
    slots = torch.randperm(num_rows, generator=g)[:seq]
    store = torch.randn(num_rows, D, generator=g)  # other requests' rows
    store[slots] = hist
    q = torch.randn(q_len, H, D, generator=g)
    q_pos = torch.arange(seq - q_len, seq)
    return hist, store, slots, q, q_pos


def _reference(q: torch.Tensor, hist: torch.Tensor, chosen: list[list[int]]) -> torch.Tensor:
    """Per query: softmax attention over exactly the history positions ``chosen[t]`` (float64)."""
    out = torch.zeros(q.shape[0], H, R, dtype=torch.float64)
    for t, pos in enumerate(chosen):
        kv = hist[pos].double()
        p = (q[t].double() @ kv.T * SCALE).softmax(-1)
        out[t] = p @ kv[:, :R]
    return out


def test_indexer_scores_formula() -> None:
    g = torch.Generator().manual_seed(1)
    q, w, k = torch.randn(5, 4, 6, generator=g), torch.randn(5, 4, generator=g), torch.randn(9, 6, generator=g)
    got = indexer_scores(q, w, k)
    want = torch.zeros(5, 9, dtype=torch.float64)
    for t in range(5):
        for s in range(9):
            want[t, s] = sum(w[t, h].item() * max(0.0, (q[t, h] @ k[s]).item()) for h in range(4))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_topk_is_exactly_the_best_eligible_positions() -> None:
    g = torch.Generator().manual_seed(2)
    seq, q_len, k = 200, 40, 32
    scores = torch.randn(q_len, seq, generator=g)
    q_pos = torch.arange(seq - q_len, seq)
    # include short contexts too: queries at positions 0..9 have fewer than k candidates
    q_pos[:10] = torch.arange(10)
    sel = select_topk(scores, q_pos, k)
    assert sel.shape == (q_len, k) and sel.dtype == torch.int64
    for t in range(q_len):
        p = int(q_pos[t])
        eligible = list(range(p + 1))
        best = sorted(sorted(eligible, key=lambda s: -scores[t, s].item())[:k])
        row = sel[t].tolist()
        assert row == best + [-1] * (k - len(best)), t  # ascending, -1 padding last
        assert all(s <= p for s in best)


def test_topk_covering_context_is_causal_dense() -> None:
    scores = torch.randn(7, 20)
    q_pos = torch.arange(13, 20)
    dense = causal_positions(q_pos, 20)
    assert torch.equal(select_topk(scores, q_pos, 20), dense)
    assert torch.equal(select_topk(scores, q_pos, 4096), dense)
    assert dense[0].tolist() == [*range(14), *([-1] * 6)]


def test_sparse_attention_matches_reference_on_topk_rows() -> None:
    seq, q_len, k = 300, 17, 32
    hist, store, slots, q, q_pos = _request(seq, q_len, seed=3)
    scores = torch.randn(q_len, seq, generator=torch.Generator().manual_seed(4))
    positions = select_topk(scores, q_pos, k)
    out = sparse_attention(q, store, positions_to_slots(positions, slots), scale=SCALE, v_dim=R)
    chosen = [[s for s in row if s >= 0] for row in positions.tolist()]
    assert all(len(c) == k for c in chosen)
    torch.testing.assert_close(out.double(), _reference(q, hist, chosen), rtol=1e-5, atol=1e-5)
    # and it really is sparse: attending to every position gives a different answer
    full = _reference(q, hist, [list(range(int(p) + 1)) for p in q_pos])
    assert not torch.allclose(out.double(), full, atol=1e-3)


def test_topk_at_least_context_equals_full_attention() -> None:
    seq, q_len = 40, 40  # a whole prefill
    hist, store, slots, q, q_pos = _request(seq, q_len, seed=5)
    scores = torch.randn(q_len, seq)
    sparse = sparse_attention(q, store, positions_to_slots(select_topk(scores, q_pos, 64), slots),
                              scale=SCALE, v_dim=R)
    dense = sparse_attention(q, store, positions_to_slots(causal_positions(q_pos, seq), slots),
                             scale=SCALE, v_dim=R)
    assert torch.equal(sparse, dense)  # same rows in the same order: bit-identical
    full = _reference(q, hist, [list(range(int(p) + 1)) for p in q_pos])
    torch.testing.assert_close(dense.double(), full, rtol=1e-5, atol=1e-5)


def test_padding_rows_do_not_contribute() -> None:
    _hist, store, slots, q, _q_pos = _request(20, 4, seed=6)
    positions = select_topk(torch.randn(4, 20), torch.tensor([1, 2, 3, 19]), 8)
    assert (positions[:3] == -1).any()
    rows = positions_to_slots(positions, slots)
    before = sparse_attention(q, store, rows, scale=SCALE, v_dim=R)
    free = torch.ones(store.shape[0], dtype=torch.bool)
    free[slots] = False
    store[free] = 1e4  # rows nobody selected, row 0 (what padding reads) included
    assert torch.equal(sparse_attention(q, store, rows, scale=SCALE, v_dim=R), before)


def test_gather_and_attention_are_deterministic() -> None:
    _hist, store, slots, q, q_pos = _request(120, 9, seed=7)
    rows = positions_to_slots(select_topk(torch.randn(9, 120), q_pos, 16), slots)
    assert torch.equal(gather_rows(store, rows)[rows >= 0], store[rows[rows >= 0]])
    a = sparse_attention(q, store, rows, scale=SCALE, v_dim=R)
    b = sparse_attention(q.clone(), store.clone(), rows.clone(), scale=SCALE, v_dim=R)
    assert torch.equal(a, b)


def test_ties_go_to_the_earlier_position_whatever_the_other_scores() -> None:
    """ReLU makes exact ties (often at 0) common; the choice among them must not
    move when other scores change in their last bits (batch-shape rounding)."""
    g = torch.Generator().manual_seed(8)
    seq, k = 100, 16
    scores = torch.randn(1, seq, generator=g).clamp(max=0.0)  # ~half the positions tie at 0
    scores[0, 90:] = 1.0  # 10 clear winners, 6 picks left among the ties
    q_pos = torch.tensor([seq - 1])
    tied = [s for s in range(90) if scores[0, s] == 0.0]
    want = sorted(tied[:6] + list(range(90, 100)))
    assert select_topk(scores, q_pos, k)[0].tolist() == want
    noisy = scores.clone()
    noisy[scores < 0] *= 1 + 1e-6 * torch.rand(int((scores < 0).sum()), generator=g)
    assert select_topk(noisy, q_pos, k)[0].tolist() == want
