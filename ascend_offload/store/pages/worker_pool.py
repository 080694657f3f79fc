"""A worker rank's host page pool mirroring its paged KV cache.

Page ``p`` holds one block of every cache-bearing layer of this rank, stored
layer-major (one contiguous ``[num_pages, layer_block_bytes]`` plane per layer)
so that every copy is one indexed op between two contiguous 2-D word views. The
worker only moves bytes between page numbers and block ids the scheduler chose,
so it needs no knowledge of requests.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence

import torch

from ascend_offload import device, native
from ascend_offload.kv_layout import block_dim

_PLANE_ALIGN = 4096


def _host_planes(block_bytes: list[int], num_pages: int) -> list[torch.Tensor]:
    """The ``[num_pages, block_bytes[i]]`` host planes. Without an accelerator they are
    views of one buffer (each plane 4 KiB aligned), so that the pool, not each plane,
    decides whether the buffer gets transparent huge pages (``device.empty_host``: 32 MiB
    and up): a rank's planes are often smaller one by one (61 layers x 256 pages x 16 KiB
    = 4 MiB each). Measured (bench store's worker rows, same rounds, 2-vCPU VM): saves of
    144 KiB layer blocks into 8 MiB planes took 1.09x as long with 4 KiB-paged planes, of
    16 KiB blocks 0.98-1.02x. Pinned memory (an accelerator) keeps one allocation per
    plane: a caching host allocator may round each request up."""
    if device.platform() != "cpu":
        return [device.empty_host((num_pages, b), torch.uint8) for b in block_bytes]
    sizes = [num_pages * b for b in block_bytes]
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + -(-size // _PLANE_ALIGN) * _PLANE_ALIGN)
    buf = device.empty_host((offsets[-1] + _PLANE_ALIGN,), torch.uint8)
    start = -buf.data_ptr() % _PLANE_ALIGN
    return [buf[start + o : start + o + size].view(num_pages, b)
            for o, size, b in zip(offsets, sizes, block_bytes, strict=False)]


class _Layer:
    """One layer's KV tensor and its host page plane."""

    def __init__(self, kv: torch.Tensor, num_blocks: int, plane: torch.Tensor) -> None:
        self.kv = kv
        self.dim = block_dim(kv, num_blocks)
        self.block_bytes = kv.numel() // num_blocks * kv.element_size()
        self.plane = plane
        self.plane_words = device.as_words(self.plane)
        # Device KV: block-first moves run through device.move_rows (gather on the device,
        # one copy across), other layouts through device.blocks_to_host / blocks_from_host.
        self.on_device = device.is_accelerator(kv)
        self.stream = device.new_stream() if self.on_device else None
        # Block-first with contiguous blocks (vLLM's CPU layout): copy without temporaries.
        self.kv_words = None
        if self.dim == 0 and kv.is_contiguous():
            words = device.as_words(kv)
            if words.dtype == self.plane_words.dtype:
                self.kv_words = words

    def save(self, block_ids: Sequence[int], pages: Sequence[int], plan: device.RowPlan) -> None:
        if self.kv_words is not None:
            device.move_rows(self.kv_words, self.plane_words, plan)
            return
        if self.on_device:  # one gather + one D2H copy, then pages from host rows
            rows = device.blocks_to_host(self.kv, self.dim, block_ids, self.stream)
            device.scatter_rows(device.as_words(rows.view(len(block_ids), -1)), list(pages), self.plane_words)
            return
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.kv.device)
        rows = self.kv.index_select(self.dim, ids).movedim(self.dim, 0).contiguous()
        device.scatter_rows(device.as_words(rows), list(pages), self.plane_words)

    def load(self, pages: Sequence[int], block_ids: Sequence[int], plan: device.RowPlan) -> None:
        if self.kv_words is not None:
            device.move_rows(self.plane_words, self.kv_words, plan)
            return
        data = device.gather_rows(self.plane, list(pages))
        shape = list(self.kv.shape)
        shape.pop(self.dim)
        rows = data.view(self.kv.dtype).view(len(pages), *shape)
        if self.on_device:  # one H2D copy + one scatter
            device.blocks_from_host(rows, self.kv, self.dim, block_ids, self.stream)
            return
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.kv.device)
        self.kv.index_copy_(self.dim, ids, rows.movedim(0, self.dim))


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
        self.layer_names = list(kv_caches)
        kvs = list(kv_caches.values())
        planes = _host_planes([t.numel() // num_blocks * t.element_size() for t in kvs], num_pages)
        self._layers = [_Layer(t, num_blocks, plane) for t, plane in zip(kvs, planes, strict=True)]
        self.page_bytes = sum(layer.block_bytes for layer in self._layers)
        self._on_device = any(layer.on_device for layer in self._layers)
        if expected_page_bytes is not None and expected_page_bytes != self.page_bytes:
            raise ValueError(
                f"KV block bytes across layers = {self.page_bytes} on this rank, but the "
                f"scheduler sized store pages at {expected_page_bytes}"
            )
        self.num_pages = num_pages
        # Every layer block-first and contiguous on the host (vLLM's CPU layout): a save or
        # load is one native call over all layers and no row plan. Measured (2-vCPU VM): the
        # plan of 1024 rows 0.4-0.7 ms of a ~7 ms 64 MiB save, a native call per layer
        # ~6 us (a one-row save of 32 layers: 0.20 ms, against 7 us in one call).
        self._tables: tuple[ctypes.Array, ctypes.Array] | None = None
        if all(layer.kv_words is not None for layer in self._layers) and native.has_layer_copy():
            self._tables = (
                native.layer_table([(layer.kv, layer.plane) for layer in self._layers]),
                native.layer_table([(layer.plane, layer.kv) for layer in self._layers]),
            )

    @property
    def planes(self) -> dict[str, torch.Tensor]:
        """Layer name -> its ``[num_pages, layer_block_bytes]`` host plane (a shared store
        tier registers them and moves pages in and out of them)."""
        return {name: layer.plane for name, layer in zip(self.layer_names, self._layers, strict=True)}

    @staticmethod
    def _check(block_ids: Sequence[int], pages: Sequence[int]) -> None:
        if len(block_ids) != len(pages):
            raise ValueError(f"{len(block_ids)} blocks but {len(pages)} pages")

    def _copy_native(self, table: ctypes.Array, src_rows: Sequence[int], dst_rows: Sequence[int]) -> None:
        """Every layer's rows in one native call (``self._tables``); raises ``IndexError``
        naming the first out-of-range pair (nothing is copied then)."""
        n = len(src_rows)
        if n == 0:
            return
        sidx, didx = native.int32_rows(src_rows), native.int32_rows(dst_rows)
        rc = native.copy_layer_rows(table, len(self._layers), native.buffer_address(sidx),
                                    native.buffer_address(didx), n)
        if rc < 0:
            i = -rc - 1
            raise IndexError(f"row pair {i} out of range: {int(src_rows[i])} -> {int(dst_rows[i])}")

    def save(self, block_ids: Sequence[int], pages: Sequence[int]) -> None:
        """``pages[i] <- block block_ids[i]`` for every layer."""
        self._check(block_ids, pages)
        if self._tables is not None:
            self._copy_native(self._tables[0], block_ids, pages)
            return
        plan = device.plan_rows(block_ids, pages)
        for layer in self._layers:
            layer.save(block_ids, pages, plan)
        if self._on_device:
            device.synchronize()  # device -> host copies are asynchronous: the pages are read next

    def load(self, pages: Sequence[int], block_ids: Sequence[int]) -> None:
        """``block block_ids[i] <- pages[i]`` for every layer."""
        self._check(block_ids, pages)
        if self._tables is not None:
            self._copy_native(self._tables[1], pages, block_ids)
            return
        plan = device.plan_rows(pages, block_ids)
        for layer in self._layers:
            layer.load(pages, block_ids, plan)
        if self._on_device:
            device.synchronize()  # the pages may be reused once the job is reported done
