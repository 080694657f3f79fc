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
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ascend_offload import device
from ascend_offload.kv_layout import block_dim, block_views
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


def kv_views(kv_caches: Mapping[str, torch.Tensor], names: Sequence[str], num_blocks: int
             ) -> list[list[torch.Tensor]]:
    """Per layer in ``names`` order, vLLM's KV tensors as block-major views (block index on
    dim 0): what a layer's wire layout lists."""
    out = []
    for name in names:
        t = kv_caches[name]
        out.append(block_views(t, block_dim(t, num_blocks)))
    return out


def _engine(cfg: RemoteD2HConfig, host: str) -> TransferEngine:
    from ascend_offload.transfer.base import create_engine

    return create_engine("mooncake", host=host, protocol=cfg.mooncake_protocol,
                         device_name=cfg.mooncake_device_name, timeout_s=cfg.read_timeout_s)


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
                engine: TransferEngine | None = None) -> KVRegion:
    """The transfer engine (``engine``, else the configured one), with every extent of
    host-memory ``layers`` registered."""
    region = KVRegion(layers, engine or _engine(cfg, host), [])
    _register(region)
    return region


def open_kv_region(kv_caches: Mapping[str, torch.Tensor], names: Sequence[str], num_blocks: int,
                   cfg: RemoteD2HConfig, host: str, *, engine: TransferEngine | None = None) -> KVRegion:
    """vLLM's KV tensors (in ``names`` order) behind the transfer engine: registered in
    place where the engine reaches their memory, else staged through host twins."""
    views = kv_views(kv_caches, names, num_blocks)
    eng = engine or _engine(cfg, host)
    on_device = any(device.is_accelerator(v) for layer in views for v in layer)
    if not on_device or eng.device_memory:
        region = KVRegion([layer_desc(v) for v in views], eng, [])
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
    staged = [[(v, mirror.twin(v)) for v in layer] for layer in views]
    layers = [layer_desc([h for _, h in layer]) for layer in staged]
    region = KVRegion(layers, StagedEngine(eng, mirror, [p for layer in staged for p in layer]), [],
                      mirror=mirror, staged=staged)
    _register(region)
    log.info("KV on the accelerator staged through %.2f GiB of pinned host memory (transfer engine %s "
             "reads host memory only)", mirror.nbytes / 2**30, eng.name)
    return region
