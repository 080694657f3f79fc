"""A worker's KV memory as the P/D transfer engine sees it: wire layouts plus registration.

Shared by both worker roles (a ``kv_both`` rank's consumer and producers use
one engine over the same memory), so it is opened once per rank.

Where the KV lives decides what is registered (``device.is_host``): host KV, or
device KV with an engine that reaches device memory (``engine.device_memory``:
Mooncake RDMA with GPUDirect, MemFabric), is registered in place. Device KV with
a host-only engine (Mooncake TCP), or whose device registration the engine
refused, is staged: the layouts describe pinned host twins (``device.HostMirror``),
the prefill copies a layer's blocks out before publishing it (:meth:`KVRegion.stage_out`)
and decode's reads land on the device through ``transfer.staged.StagedEngine``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ascend_offload import device
from ascend_offload.config import ConfigError
from ascend_offload.kv_layout import block_dim, block_views, layer_index, layer_order
from ascend_offload.pd.layout import extents, layer_desc
from ascend_offload.pd.protocol import LayerDesc
from ascend_offload.transfer.base import TransferError

if TYPE_CHECKING:
    import torch

    from ascend_offload.config import RemoteD2HConfig
    from ascend_offload.transfer.base import TransferEngine

log = logging.getLogger(__name__)


@dataclasses.dataclass
class KVRegion:
    """The layers' wire layouts and the engine with every extent of them registered.

    ``staged`` holds, per layer, the (device tensor, host twin) pairs its layout
    describes when the KV is staged through host memory; empty otherwise.
    """

    layers: list[LayerDesc]
    engine: TransferEngine
    registered: list[int]
    mirror: device.HostMirror | None = None
    staged: list[list[tuple[torch.Tensor, torch.Tensor]]] = dataclasses.field(default_factory=list)

    def stage_out(self, layer: int, block_ids: Sequence[int]) -> None:
        """Copy ``block_ids`` of ``layer`` to its host twins before peers may read them
        (prefill, at publish); a no-op when peers read the KV in place."""
        if self.mirror is None or not block_ids:
            return
        for dev, _ in self.staged[layer]:
            self.mirror.to_host(dev, block_ids)

    def close(self) -> None:
        for addr in self.registered:
            self.engine.unregister(addr)
        self.engine.close()


def indexer_layers(kv_cache_config: Any) -> set[str]:
    """Names of the indexer caches (``cache_role`` INDEXER) in a worker's KV cache config."""
    out = set()
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        sub = getattr(spec, "kv_cache_specs", None)
        per_layer = sub if isinstance(sub, Mapping) else {n: spec for n in group.layer_names}
        for name, s in per_layer.items():
            role = getattr(s, "cache_role", None)
            if getattr(role, "value", role) == "indexer":
                out.add(name)
    return out


def pair_layers(names: Sequence[str], indexers: Collection[str]) -> list[tuple[str, str | None]]:
    """Wire layers in model order: each main-KV cache with the indexer cache of its layer.

    Why pairs: an indexer cache has no connector hooks of its own (it is written
    with its main layer), and the wire protocol carries it as the main layer's
    ``indexer`` tensor, so main KV and indexer travel, and can be routed
    (decode pool vs device), together.
    """
    order = layer_order(names)
    idx_of: dict[int, str] = {}
    for n in order:
        if n in indexers:
            li = layer_index(n)
            if li in idx_of:
                raise ConfigError(f"two indexer caches in layer {li}: {idx_of[li]}, {n}")
            idx_of[li] = n
    pairs = [(n, idx_of.pop(layer_index(n), None)) for n in order if n not in indexers]
    if idx_of:
        raise ConfigError(f"indexer caches without a main-KV layer: {sorted(idx_of.values())}")
    return pairs


def paged_views(t: torch.Tensor, num_blocks: int) -> list[torch.Tensor]:
    """One of vLLM's KV tensors as block-major views (block index on dim 0)."""
    return block_views(t, block_dim(t, num_blocks))


def kv_views(kv_caches: Mapping[str, torch.Tensor], pairs: Sequence[tuple[str, str | None]],
             num_blocks: int) -> list[tuple[list[torch.Tensor], torch.Tensor | None]]:
    """Per wire layer (main, indexer pair), vLLM's KV tensors as block-major views: what
    the layer's wire layout lists."""
    out = []
    for main, idx in pairs:
        index = None
        if idx is not None:
            (index,) = paged_views(kv_caches[idx], num_blocks)
        out.append((paged_views(kv_caches[main], num_blocks), index))
    return out


def _engine(cfg: RemoteD2HConfig, host: str, is_producer: bool, device_id: int) -> TransferEngine:
    """The engine ``transfer_backend`` names (``is_producer``, ``device_id``: MemFabric's
    role and the rank's NPU)."""
    from ascend_offload.transfer.base import create_engine_for

    return create_engine_for(cfg, host=host, role="Prefill" if is_producer else "Decode",
                             device_id=device_id)


def _register(region: KVRegion) -> None:
    try:
        for addr, length in extents(region.layers):
            region.engine.register(addr, length)
            region.registered.append(addr)
    except Exception:
        for addr in region.registered:
            region.engine.unregister(addr)
        region.registered.clear()
        raise


def open_region(layers: list[LayerDesc], cfg: RemoteD2HConfig, host: str, *,
                engine: TransferEngine | None = None, is_producer: bool = False,
                device_id: int = 0) -> KVRegion:
    """The transfer engine (``engine``, else the configured one), with every extent of
    host-memory ``layers`` registered."""
    region = KVRegion(layers, engine or _engine(cfg, host, is_producer, device_id), [])
    _register(region)
    return region


def open_kv_region(kv_caches: Mapping[str, torch.Tensor], pairs: Sequence[tuple[str, str | None]],
                   num_blocks: int, cfg: RemoteD2HConfig, host: str, *,
                   engine: TransferEngine | None = None, is_producer: bool = False,
                   device_id: int = 0) -> KVRegion:
    """vLLM's KV tensors (one wire layer per (main, indexer) pair) behind the transfer
    engine: registered in place where the engine reaches their memory, else staged
    through host twins."""
    views = kv_views(kv_caches, pairs, num_blocks)
    eng = engine or _engine(cfg, host, is_producer, device_id)
    on_device = any(device.is_accelerator(v) for main, idx in views
                    for v in (*main, *((idx,) if idx is not None else ())))
    if not on_device or eng.device_memory:
        region = KVRegion([layer_desc(main, idx) for main, idx in views], eng, [])
        try:
            _register(region)
            return region
        except TransferError as exc:
            if not on_device:
                raise
            log.warning("transfer engine %s refused device memory (%s); staging KV through pinned "
                        "host memory", eng.name, exc)
    from ascend_offload.transfer.staged import StagedEngine

    mirror = device.HostMirror()
    staged = [[(v, mirror.twin(v)) for v in (*main, *((idx,) if idx is not None else ()))]
              for main, idx in views]
    layers = [layer_desc([h for _, h in layer[:len(main)]], layer[-1][1] if idx is not None else None)
              for layer, (main, idx) in zip(staged, views, strict=True)]
    region = KVRegion(layers, StagedEngine(eng, mirror, [p for layer in staged for p in layer]), [],
                      mirror=mirror, staged=staged)
    _register(region)
    log.info("KV on the accelerator staged through %.2f GiB of pinned host memory (transfer engine %s "
             "reads host memory only)", mirror.nbytes / 2**30, eng.name)
    return region
