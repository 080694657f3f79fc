"""Describe host KV tensors as wire layouts, and check two layouts are compatible.

The producer advertises its layout in ``mf_meta``; the consumer checks every
layer it reads against its own layout *before* touching memory, so a prefill
with another model, dtype or block size fails the read instead of scribbling.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ascend_offload.pd.protocol import LayerDesc, TensorDesc

if TYPE_CHECKING:  # torch stays out of the import path: rank processes start in 0.5 s without it
    import torch


def tensor_desc(t: torch.Tensor) -> TensorDesc:
    """Wire description of a KV tensor whose dim 0 is the block index.

    Each block must be contiguous (the read copies it as one byte run); blocks
    may be strided, e.g. the K half of vLLM's ``(2, num_blocks, ...)`` cache. The
    addresses are the tensor's own, host or device: whether the transfer engine can
    reach them is the caller's decision (``connectors/remote_d2h/kv_region.py``).
    """
    if t.dim() < 1:
        raise ValueError("KV tensor needs a block dimension")
    inner = t[0] if t.shape[0] else t.new_empty(t.shape[1:])
    if not inner.is_contiguous():
        raise ValueError(f"KV tensor shape={tuple(t.shape)} stride={t.stride()}: each block must be contiguous")
    block_bytes = inner.numel() * t.element_size()
    stride = t.stride(0) * t.element_size()
    return TensorDesc(
        base_addr=t.data_ptr(),
        block_bytes=block_bytes,
        block_stride=max(stride, block_bytes),
        num_blocks=t.shape[0],
    )


def array_desc(a: Any) -> TensorDesc:
    """Wire description of a numpy array whose axis 0 is the block index (same rules as tensors)."""
    if a.ndim < 1:
        raise ValueError("KV array needs a block dimension")
    block_bytes = a.itemsize
    for n in a.shape[1:]:
        block_bytes *= n
    expect = a.itemsize
    for n, st in zip(reversed(a.shape[1:]), reversed(a.strides[1:]), strict=True):
        if n > 1 and st != expect:
            raise ValueError(f"KV array shape={a.shape} strides={a.strides}: each block must be contiguous")
        expect *= n
    return TensorDesc(base_addr=a.ctypes.data, block_bytes=block_bytes,
                      block_stride=max(a.strides[0], block_bytes), num_blocks=a.shape[0])


def layer_desc(main: Sequence[Any], indexer: Any | None = None) -> LayerDesc:
    """LayerDesc from torch tensors or numpy arrays (block index on dim 0)."""
    def one(t: Any) -> TensorDesc:
        return tensor_desc(t) if hasattr(t, "data_ptr") else array_desc(t)

    return LayerDesc(main=[one(t) for t in main], indexer=one(indexer) if indexer is not None else None)


def pool_layer_descs(kv: torch.Tensor, block_size: int, indexers: Sequence[Any | None] | None = None, *,
                     kv_row_bytes: int | None = None) -> list[LayerDesc]:
    """Decode layout whose main KV is a layer-first host pool ``kv[layer, row, *row_shape]``.

    Why no new code path: viewed as ``[num_blocks, block_size, *row_shape]`` a
    pool layer *is* a block-major KV tensor (each block contiguous), so the
    ordinary ``LayerDesc`` / block-id machinery reads prefill blocks straight
    into pool blocks; a request's destination blocks are its pool blocks.
    ``indexers`` (one per layer, or None) stay device-side tensors: only the
    main KV lives in the pool. ``kv_row_bytes`` (the model's main-KV bytes per
    token and layer) is checked against the pool's row bytes at startup.
    """
    if kv.dim() < 2 or kv.shape[1] % block_size or not kv.is_contiguous():
        raise ValueError(f"host pool shape={tuple(kv.shape)}: needs contiguous [layers, rows, ...] with "
                         f"rows a multiple of block_size={block_size}")
    row_bytes = kv[0, 0].numel() * kv.element_size() if kv.shape[1] else 0
    if kv_row_bytes is not None and kv_row_bytes != row_bytes:
        raise ValueError(f"host pool row_bytes={row_bytes} != model main-KV row_bytes={kv_row_bytes} "
                         "(bytes per token and layer): the pool was built for another model or dtype")
    num_layers = kv.shape[0]
    idx = list(indexers) if indexers is not None else [None] * num_layers
    if len(idx) != num_layers:
        raise ValueError(f"{len(idx)} indexer tensors for {num_layers} pool layers")
    blocks = kv.shape[1] // block_size
    return [layer_desc([kv[i].view(blocks, block_size, *kv.shape[2:])], idx[i]) for i in range(num_layers)]


def extents(layers: Iterable[LayerDesc]) -> list[tuple[int, int]]:
    """Merged ``(addr, length)`` ranges covering every tensor: what to register.

    Layers that alias one physical buffer (layerwise offload) yield one range.
    """
    spans = []
    for layer in layers:
        for t in (*layer.main, *([layer.indexer] if layer.indexer else [])):
            if t.num_blocks:
                spans.append((t.base_addr, t.base_addr + (t.num_blocks - 1) * t.block_stride + t.block_bytes))
    spans.sort()
    merged: list[list[int]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi - lo) for lo, hi in merged]


@dataclasses.dataclass(frozen=True)
class RowArea:
    """One layer's per-token destination rows: row ``r`` is ``row_bytes`` at
    ``base_addr + r * row_bytes`` (hybrid residency's resident main-KV rows, which lie
    inside the layer's indexer cache: memory the layout already registers)."""

    base_addr: int
    row_bytes: int
    num_rows: int

    @property
    def end(self) -> int:
        return self.base_addr + self.num_rows * self.row_bytes


def row_area_error(area: RowArea, layers: Iterable[LayerDesc], *, block_size: int,
                   main_block_bytes: int) -> str | None:
    """Why ``area`` cannot take a layer's main KV (None if it can): its rows must hold
    exactly one token of a main-KV block of ``main_block_bytes`` at ``block_size`` tokens,
    and lie wholly inside the registered extents of ``layers`` (the transfer engine only
    writes registered memory)."""
    if area.row_bytes * block_size != main_block_bytes:
        return (f"rows of {area.row_bytes} B, but a main-KV block of {main_block_bytes} B holds "
                f"{block_size} tokens")
    if area.num_rows <= 0 or area.base_addr < 0:
        return f"no rows ({area.num_rows} at {area.base_addr:#x})"
    if not any(lo <= area.base_addr and area.end <= lo + n for lo, n in extents(layers)):
        return (f"rows [{area.base_addr:#x}, {area.end:#x}) are not inside the registered KV "
                "regions")
    return None


def row_runs(rows: Sequence[int], block_size: int) -> list[tuple[int, int, int, int]]:
    """A row table (destination row of each wire position) as read runs: ``(wire block,
    first token in that block, first row, rows)``, consecutive rows within one source block
    merged (the transfer engine's coalescing merges runs that also continue across blocks)."""
    out: list[tuple[int, int, int, int]] = []
    for k in range(0, len(rows), block_size):
        seg = rows[k:k + block_size]
        j = 0
        while j < len(seg):
            e = j + 1
            while e < len(seg) and seg[e] == seg[e - 1] + 1:
                e += 1
            out.append((k // block_size, j, int(seg[j]), e - j))
            j = e
    return out


def incompatibility(src: LayerDesc, dst: LayerDesc, *, pool_block_size: int | None = None) -> str | None:
    """Why prefill layer ``src`` cannot be copied into decode layer ``dst`` (None if it can).

    ``pool_block_size`` says decode's main KV is a host pool with that many
    rows per block: a size mismatch is then reported as row bytes, the unit
    the pool is configured in.
    """
    if len(src.main) != len(dst.main):
        why = f"main tensor count {len(src.main)} (prefill) != {len(dst.main)} (decode)"
        if pool_block_size:
            why += " (the decode host pool holds one main-KV row per token: an MLA-style single KV tensor)"
        return why
    for i, (s, d) in enumerate(zip(src.main, dst.main, strict=True)):
        if s.block_bytes != d.block_bytes:
            if pool_block_size:
                return (f"main KV row_bytes {s.block_bytes / pool_block_size:g} (prefill, block of "
                        f"{s.block_bytes} B at block_size {pool_block_size}) != host pool row_bytes "
                        f"{d.block_bytes // pool_block_size} (decode, block_size {pool_block_size})")
            return f"main tensor {i}: block_bytes {s.block_bytes} (prefill) != {d.block_bytes} (decode)"
    if (src.indexer is None) != (dst.indexer is None):
        have = "prefill" if src.indexer is not None else "decode"
        return f"indexer present only on {have}"
    if src.indexer is not None and dst.indexer is not None and src.indexer.block_bytes != dst.indexer.block_bytes:
        return (f"indexer block_bytes {src.indexer.block_bytes} (prefill) != "
                f"{dst.indexer.block_bytes} (decode)")
    return None


def block_capacity(layers: Iterable[LayerDesc], *, part: str = "all") -> int:
    """The smallest block count of any tensor: valid block ids are below it.

    ``part`` is ``"all"``, ``"main"`` or ``"indexer"``: with a host-pool
    destination main and indexer blocks are numbered independently.
    """
    counts = [t.num_blocks for layer in layers
              for t in ((*layer.main,) if part != "indexer" else ())
              + ((layer.indexer,) if layer.indexer and part != "main" else ())]
    return min(counts) if counts else 0


def out_of_range(blocks: Sequence[int], capacity: int) -> list[int]:
    """Block ids outside ``0..capacity-1`` (O(n) once, not per tensor)."""
    if not blocks or (min(blocks) >= 0 and max(blocks) < capacity):
        return []
    return [b for b in blocks if not 0 <= b < capacity]
