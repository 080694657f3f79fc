"""The adapter interface between a sparse-attention layer and sparse decode offload.

Why a Protocol: the attention (our sparse-MLA model here, vllm-ascend's SFA
backend later) knows its batch, the step's new main-KV rows and the indexer's
top-k; the offload side (our ``AscendSparseDecodeConnector``, or a backend's own
adapter) knows which request each batch row is, the host pool and the hot
buffers. Neither imports the other: the attention only calls these methods,
found on vLLM's active KV connector (``get_kv_transfer_group()``), and the
offload side only sees tensors and positions. No vLLM import here.

Per layer and step the attention calls, in this order::

    plan = adapter.plan_step(rows)                 # same rows for every layer of a step
    adapter.offload_new_kv(layer, kv, positions)   # rows plan.offload_from..num_tokens
    slots = adapter.onload_topk(layer, topk)       # [B, T*K] logical positions -> hot rows
    ... sparse attention over adapter.hot_buffer(layer)[slots] for plan.decode rows ...
    store, rows = adapter.context_rows(layer, b, positions)  # other (multi-token) rows

A step whose entries are all resident (hybrid residency: their main KV in device rows
borrowed from the engine's KV blocks) comes with :attr:`SparseStepPlan.resident`, and
the layer runs it as a plain paged step over those rows instead: it writes the new rows
to ``resident.views[layer][resident.new_rows]`` and gathers entry ``b``'s positions
through ``resident.tables[b]``, with no adapter call per layer (what a step of the
engine without offload costs).

``B`` is :attr:`SparseStepPlan.num_entries` (the offloaded requests of the
step, in the order of :attr:`SparseStepPlan.batch_index`), ``K`` the model's
``index_topk``, ``T`` :attr:`SparseStepPlan.query_tokens` (1, or 1 + the draft tokens
of speculative decoding: a verification row's top-k sets resolve in one call, so the
hot buffer holds their union); ``-1`` pads both the top-k and the returned slots.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch


@dataclasses.dataclass(frozen=True)
class BatchRow:
    """One request of the step as the attention sees it (its batch order)."""

    # How the engine names the request without a request id: the KV block id that holds
    # the request's newest position (num_tokens - 1). Unique within a step: that block
    # is written this step, so no other running request (prefix caching shares only
    # full, already computed blocks) can hold it.
    key: int
    num_tokens: int  # context length after this step (positions 0..num_tokens-1 have KV)
    num_new: int  # tokens computed this step (query tokens)


@dataclasses.dataclass(frozen=True)
class ResidentStep:
    """A step whose entries are all resident: where their main-KV rows live on the device.
    Built once per step; the layers use it with tensor ops only (static per step, no host
    synchronization, nothing counted per layer)."""

    # per pool layer: the ``[rows, row]`` device view the rows below index
    views: Sequence[torch.Tensor]
    # ``[N]`` int64: the row of every new token of the step, in the order of the step's
    # new main-KV rows (batch rows in order, each row's positions in order)
    new_rows: torch.Tensor
    # per step entry: the row of every position, then ``-1`` (a ``-1`` padded position
    # gathers ``-1``): ``table[positions]`` are the rows to attend over
    tables: Sequence[torch.Tensor]


@dataclasses.dataclass(frozen=True)
class SparseStepPlan:
    """What the attention does with each of its batch rows this step."""

    # per batch row: index into the manager's step batch (the row of top-k to fill),
    # -1 = not offloaded (the engine has no main KV for it on the device: an error)
    batch_index: tuple[int, ...]
    # per batch row: first position whose main-KV row goes to the host pool this step
    # (the pool lacks it: new tokens, prefix-cache hits not yet pooled, recomputation)
    offload_from: tuple[int, ...]
    # per batch row: attend over the hot buffer (1..query_tokens query tokens: a decode
    # or speculative verification row, offloaded)
    decode: tuple[bool, ...]
    num_entries: int  # rows of the top-k the layer passes to onload_topk
    # the most query tokens of a decode row: the top-k passed to onload_topk is
    # [num_entries, query_tokens * K], query token t of a row in columns t*K..(t+1)*K-1
    # (one resolve of the union of the row's top-k sets; -1 padded, static width)
    query_tokens: int = 1
    # every entry resident (hybrid residency): the layers write and read their device rows
    # directly, with no offload_new_kv or context_rows call; None otherwise
    resident: ResidentStep | None = None

    @property
    def any_decode(self) -> bool:
        return any(self.decode)


@runtime_checkable
class SparseDecodeAdapter(Protocol):
    """Implemented by the offload side; called by a sparse-attention layer."""

    def sparse_layer_index(self, layer_name: str) -> int | None:
        """The pool layer of a main-KV cache layer; ``None``: this layer is not
        offloaded (offload off, or not a sparse layer) and attends as without offload."""
        ...

    def plan_step(self, rows: Sequence[BatchRow]) -> SparseStepPlan:
        """Bind this step's batch (first call of a step; later layers get the same plan)."""
        ...

    def offload_new_kv(self, layer: int, new_kv: torch.Tensor, positions: torch.Tensor) -> None:
        """Main-KV rows ``[N, row]`` to the host pool; ``positions`` ``[N, 2]`` holds
        (step batch index, logical position)."""
        ...

    def onload_topk(self, layer: int, topk: torch.Tensor) -> torch.Tensor:
        """Logical top-k ``[B, T*K]`` (int32, ``-1`` padded) -> rows of
        :meth:`hot_buffer` ``[B, T*K]``; only the misses are copied."""
        ...

    def hot_buffer(self, layer: int) -> torch.Tensor:
        """The layer's device hot buffer ``[rows, row]`` the slots index."""
        ...

    def context_rows(self, layer: int, batch_index: int, positions: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """For a multi-token row (prefill chunk, recomputation): a row store and the rows
        ``[T, K]`` in it of the logical ``positions`` ``[T, K]`` (``-1`` padded) of step
        entry ``batch_index``, after this step's :meth:`offload_new_kv` of the layer."""
        ...


__all__: Sequence[str] = ["BatchRow", "ResidentStep", "SparseDecodeAdapter", "SparseStepPlan"]
