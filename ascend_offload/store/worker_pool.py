"""A worker rank's host page pool mirroring its paged KV cache.

One page holds one block of every cache-bearing layer of this rank
(``[layer][bytes of that layer's block]``). The worker only moves bytes between
page numbers and block ids that the scheduler chose, so it needs no knowledge of
requests, and a batch moves with one indexed copy per layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ascend_offload import device


def block_dim(t: torch.Tensor, num_blocks: int) -> int:
    """The dimension of a paged KV tensor that indexes blocks."""
    dims = [i for i, n in enumerate(t.shape) if n == num_blocks]
    if not dims:
        raise ValueError(f"no dimension of size num_blocks={num_blocks} in KV tensor {tuple(t.shape)}")
    return dims[0]


class WorkerPagePool:
    """Host pages for one rank; ``save``/``load`` copy whole blocks of all layers."""

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        *,
        num_blocks: int,
        num_pages: int,
        expected_page_bytes: int | None = None,
    ) -> None:
        if not kv_caches:
            raise ValueError("no KV cache tensors registered")
        self.layers = list(kv_caches)
        self._kv: list[torch.Tensor] = []
        self._dims: list[int] = []
        self._spans: list[tuple[int, int]] = []
        offset = 0
        for name in self.layers:
            t = kv_caches[name]
            d = block_dim(t, num_blocks)
            nbytes = t.numel() // num_blocks * t.element_size()
            self._kv.append(t)
            self._dims.append(d)
            self._spans.append((offset, offset + nbytes))
            offset += nbytes
        self.page_bytes = offset
        if expected_page_bytes is not None and expected_page_bytes != offset:
            raise ValueError(
                f"KV block bytes across layers = {offset} on this rank, but the scheduler "
                f"sized store pages at {expected_page_bytes}"
            )
        self.num_pages = num_pages
        self.pages = device.empty_host((num_pages, offset), torch.uint8)

    def _index(self, ids: Sequence[int], like: torch.Tensor) -> torch.Tensor:
        return torch.tensor(list(ids), dtype=torch.long, device=like.device)

    def save(self, block_ids: Sequence[int], pages: Sequence[int]) -> None:
        """``pages[i] <- block block_ids[i]`` for every layer."""
        if len(block_ids) != len(pages):
            raise ValueError(f"{len(block_ids)} blocks but {len(pages)} pages")
        page_idx = self._index(pages, self.pages)
        for kv, d, (a, b) in zip(self._kv, self._dims, self._spans, strict=True):
            rows = kv.index_select(d, self._index(block_ids, kv)).movedim(d, 0)
            data = rows.contiguous().view(len(block_ids), -1).view(torch.uint8)
            if data.device != self.pages.device:
                data = data.to(self.pages.device)
            self.pages[:, a:b].index_copy_(0, page_idx, data)

    def load(self, pages: Sequence[int], block_ids: Sequence[int]) -> None:
        """``block block_ids[i] <- pages[i]`` for every layer."""
        if len(block_ids) != len(pages):
            raise ValueError(f"{len(block_ids)} blocks but {len(pages)} pages")
        page_idx = self._index(pages, self.pages)
        for kv, d, (a, b) in zip(self._kv, self._dims, self._spans, strict=True):
            data = self.pages[:, a:b].index_select(0, page_idx)
            shape = list(kv.shape)
            shape.pop(d)
            rows = data.view(kv.dtype).view(len(block_ids), *shape)
            if rows.device != kv.device:
                rows = rows.to(kv.device, non_blocking=True)
            kv.index_copy_(d, self._index(block_ids, kv), rows.movedim(0, d))
