"""DeepSeek-V3.2-style sparse attention on plain tensors (no vLLM import).

Three steps per query token, each its own function so the offload can swap
exactly one of them:

1. :func:`indexer_scores` — the lightning indexer scores every past position:
   ``sum_h w[t, h] * relu(q[t, h] . k[s])``.
2. :func:`select_topk` — the ``index_topk`` best *logical positions* ``<=`` the
   query's own position (ties to the earlier one), ascending, ``-1`` padded
   (everything when the context is not longer than ``index_topk``).
3. :func:`sparse_attention` — **the seam**: gather the selected rows of a
   main-KV row store (``cache``, one row per token) by row index and attend over
   them. Without offload ``cache`` is the paged main-KV cache viewed as rows and
   the indices are the positions' slots (:func:`positions_to_slots`); with
   sparse decode offload ``cache`` becomes the layer's device hot buffer and the
   indices the hot-buffer slots the residency manager resolved for the same
   positions. The function does not care which.

Selected positions are kept in ascending order with padding last: a top-k that
covers the whole context then produces exactly the dense row list, so sparse
with ``index_topk >= context`` is bit-identical to dense attention.
"""

from __future__ import annotations

import torch


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Lightning-indexer logits ``[T, S]`` of ``T`` query tokens over ``S`` keys.

    ``q`` is ``[T, H_idx, D_idx]``, ``weights`` ``[T, H_idx]`` (per-head gates, any
    scaling already applied), ``keys`` ``[S, D_idx]``. ReLU before the weighted
    head sum, as in DeepSeek-V3.2.
    """
    logits = torch.einsum("thd,sd->ths", q, keys).relu_()
    return torch.einsum("ths,th->ts", logits, weights)


def causal_positions(q_pos: torch.Tensor, num_positions: int) -> torch.Tensor:
    """Every position ``<= q_pos`` of a ``num_positions`` context: ``[T, num_positions]``
    (int64, ascending, ``-1`` padded) — dense attention's selection."""
    pos = torch.arange(num_positions, device=q_pos.device).expand(q_pos.shape[0], num_positions)
    return torch.where(pos <= q_pos[:, None], pos, -1)


def select_topk(scores: torch.Tensor, q_pos: torch.Tensor, topk: int) -> torch.Tensor:
    """The ``topk`` best-scored positions ``<= q_pos`` per query: ``[T, min(topk, S)]``
    (int64, ascending, ``-1`` padded).

    ``scores`` ``[T, S]`` scores the positions ``0..S-1`` of one request,
    ``q_pos`` ``[T]`` is each query's own position (causal). Equal scores go to
    the earlier position. A context of at most ``topk`` positions selects
    everything, exactly as :func:`causal_positions`.
    """
    s = scores.shape[1]
    if topk >= s:
        return causal_positions(q_pos, s)
    eligible = torch.arange(s, device=scores.device)[None, :] <= q_pos[:, None]
    masked = scores.masked_fill(~eligible, float("-inf"))
    # a stable sort, not topk: ReLU makes exact ties common (often at 0), and topk
    # breaks ties differently as the other scores move by rounding noise
    chosen = masked.sort(dim=-1, descending=True, stable=True).indices[:, :topk]
    # ascending positions; ineligible picks (queries with fewer than topk positions) last
    chosen = torch.where(chosen <= q_pos[:, None], chosen, s).sort(dim=-1).values
    return torch.where(chosen < s, chosen, -1)


def positions_to_slots(positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Map logical positions (``-1`` padded) to rows of a row store: ``slots[p]``.

    ``slots`` ``[S]`` holds the row of each position of the request (for vLLM's
    paged cache ``block_table[p // block] * block + p % block``).
    """
    return torch.where(positions >= 0, slots[positions.clamp(min=0)], -1)


def gather_rows(cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``cache[rows]`` as ``[T, K, D]``; padding (``-1``) reads row 0 (masked later)."""
    return cache.index_select(0, rows.clamp(min=0).flatten()).view(*rows.shape, cache.shape[-1])


def attend(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, scale: float, v_dim: int
           ) -> torch.Tensor:
    """MQA over gathered rows: ``q`` ``[T, H, D]``, ``kv`` ``[T, K, D]`` (keys are the
    whole row, values its first ``v_dim`` entries), ``valid`` ``[T, K]``.
    Returns ``[T, H, v_dim]``."""
    logits = torch.einsum("thd,tkd->thk", q, kv) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.einsum("thk,tkc->thc", probs, kv[..., :v_dim])


def sparse_attention(q: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor, *, scale: float,
                     v_dim: int) -> torch.Tensor:
    """The seam: attention of ``q`` ``[T, H, D]`` over the rows ``rows`` ``[T, K]``
    (``-1`` padded) of the row store ``cache`` ``[N, D]``; ``[T, H, v_dim]``.

    Sparse decode offload replaces ``cache`` by a hot buffer and ``rows`` by the
    hot-buffer slots of the same selected positions; nothing else changes.
    Every query must have at least one valid row.
    """
    return attend(q, gather_rows(cache, rows), rows >= 0, scale, v_dim)
