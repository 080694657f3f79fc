"""A worker's KV memory as the P/D transfer engine sees it: wire layouts plus registration.

Shared by both worker roles (a ``kv_both`` rank's consumer and producers use
one engine over the same memory), so it is opened once per rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ascend_offload.config import ConfigError, RemoteD2HConfig
from ascend_offload.kv_layout import block_dim, block_views
from ascend_offload.pd.layout import extents, layer_desc
from ascend_offload.pd.protocol import LayerDesc

if TYPE_CHECKING:
    import torch

    from ascend_offload.transfer.base import TransferEngine


@dataclasses.dataclass
class KVRegion:
    """The layers' wire layouts and the engine with every extent of them registered."""

    layers: list[LayerDesc]
    engine: TransferEngine
    registered: list[int]

    def close(self) -> None:
        for addr in self.registered:
            self.engine.unregister(addr)
        self.engine.close()


def device_layers(kv_caches: Mapping[str, torch.Tensor], names: Sequence[str], num_blocks: int,
                  *, connector: str) -> list[LayerDesc]:
    """Wire layouts of vLLM's own KV tensors, in ``names`` order (host memory only here)."""
    layers = []
    for name in names:
        t = kv_caches[name]
        if t.device.type != "cpu":
            raise ConfigError(f"{connector}: KV cache of {name} is on {t.device}; the Mooncake backend here "
                              "reads host memory (device memory needs the Ascend backend)")
        layers.append(layer_desc(block_views(t, block_dim(t, num_blocks))))
    return layers


def open_region(layers: list[LayerDesc], cfg: RemoteD2HConfig, host: str, *,
                is_producer: bool = False, device_id: int = 0) -> KVRegion:
    """The transfer engine ``transfer_backend`` names, with every extent of ``layers``
    registered (``is_producer``, ``device_id``: MemFabric's role and the rank's NPU)."""
    from ascend_offload.transfer.base import create_engine_for

    engine = create_engine_for(cfg, host=host, role="Prefill" if is_producer else "Decode",
                               device_id=device_id)
    region = KVRegion(layers, engine, [])
    for addr, length in extents(layers):
        engine.register(addr, length)
        region.registered.append(addr)
    return region
