"""A worker's KV memory as the P/D transfer engine sees it: wire layouts plus registration.

Shared by both worker roles (a ``kv_both`` rank's consumer and producers use
one engine over the same memory), so it is opened once per rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ascend_offload.config import ConfigError, RemoteD2HConfig
from ascend_offload.kv_layout import block_dim, block_views, layer_index, layer_order
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


def device_view(t: torch.Tensor, num_blocks: int, name: str, connector: str) -> list[torch.Tensor]:
    """Block-major views of one of vLLM's KV tensors (host memory only here)."""
    if t.device.type != "cpu":
        raise ConfigError(f"{connector}: KV cache of {name} is on {t.device}; the Mooncake backend here "
                          "reads host memory (device memory needs the Ascend backend)")
    return block_views(t, block_dim(t, num_blocks))


def device_layers(kv_caches: Mapping[str, torch.Tensor], pairs: Sequence[tuple[str, str | None]],
                  num_blocks: int, *, connector: str) -> list[LayerDesc]:
    """Wire layouts of vLLM's own KV tensors, one per (main, indexer) pair."""
    layers = []
    for main, idx in pairs:
        views = device_view(kv_caches[main], num_blocks, main, connector)
        index = None
        if idx is not None:
            (index,) = device_view(kv_caches[idx], num_blocks, idx, connector)
        layers.append(layer_desc(views, index))
    return layers


def open_region(layers: list[LayerDesc], cfg: RemoteD2HConfig, host: str) -> KVRegion:
    """The transfer engine, with every extent of ``layers`` registered."""
    from ascend_offload.transfer.base import create_engine

    engine = create_engine("mooncake", host=host, protocol=cfg.mooncake_protocol,
                           device_name=cfg.mooncake_device_name, timeout_s=cfg.read_timeout_s)
    region = KVRegion(layers, engine, [])
    for addr, length in extents(layers):
        engine.register(addr, length)
        region.registered.append(addr)
    return region
