"""How a paged KV-cache tensor is laid out: which dimension indexes blocks, per-block
views, and a layer's index from its name.

Why one module: the store's worker pool, the P/D connector and the layerwise
layout hook all read vLLM's KV tensors; each used to guess the block dimension
on its own, and two guesses disagreed for a ``(2, 2, ...)`` tensor (K/V stack
with two blocks). Everything here is plain torch: no vLLM import.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

_INT = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def block_dim(t: torch.Tensor, num_blocks: int) -> int:
    """The dimension of a paged KV tensor that indexes blocks.

    A leading dimension of 2 followed by ``num_blocks`` is vLLM's K/V stack
    (``(2, num_blocks, ...)``), so dim 1 wins there even when ``num_blocks == 2``;
    otherwise the first dimension of size ``num_blocks``.
    """
    if t.dim() >= 2 and t.shape[0] == 2 and t.shape[1] == num_blocks:
        return 1
    for i, n in enumerate(t.shape):
        if n == num_blocks:
            return i
    raise ValueError(f"no dimension of size num_blocks={num_blocks} in KV tensor {tuple(t.shape)}")


def block_views(t: torch.Tensor, dim: int) -> list[torch.Tensor]:
    """Split a paged KV tensor into tensors indexed by block on dim 0, each block contiguous.

    ``(2, num_blocks, ...)`` (K and V halves) gives two views; ``(num_blocks, ...)``
    one. Dimensions before the block dimension, and after it while a block is
    not contiguous, are unrolled.
    """
    if dim > 0:
        return [v for i in range(t.shape[0]) for v in block_views(t[i], dim - 1)]
    if t.shape[0] == 0 or t[0].is_contiguous():
        return [t]
    if t.dim() < 2:
        raise ValueError(f"KV tensor shape={tuple(t.shape)} stride={t.stride()}: blocks not contiguous")
    return [v for j in range(t.shape[1]) for v in block_views(t[:, j], 0)]


def layer_index(name: str) -> int:
    """The layer number in a module name (``model.layers.7.self_attn.attn`` -> 7); -1 if none."""
    m = _INT.search(name)
    return int(m.group(1)) if m else -1


def layer_order(names: Iterable[str]) -> list[str]:
    """Layer names in model order (prefill and decode must agree on layer indices)."""
    return sorted(names, key=lambda n: (layer_index(n), n))
