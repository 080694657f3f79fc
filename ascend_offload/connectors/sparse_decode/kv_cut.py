"""Device KV cut of sparse decode offload: no main KV on the device.

With sparse decode offload on, the whole main-KV history of every sparse layer
lives in the host pool; the device keeps only the indexer cache (the indexer
scores every position every step) and, per main-KV layer, the hot buffer the
attention reads. So the engine's KV allocation is rewritten in the engine core,
before any worker allocates (the same place as the layerwise layout hook,
``get_kv_cache_configs``):

* the cache groups are re-planned with the main-KV layers left out (vLLM's own
  ``get_kv_cache_config_from_groups``), over the memory left after the hot
  buffers: ``num_blocks`` now counts indexer blocks, so vLLM admits requests by
  their indexer blocks, and the bytes the main KV would have taken become more
  blocks;
* the backing allocation grows by the hot buffers, one region per main-KV layer
  (``max_num_seqs * topk_buffer_size`` rows), and each main-KV layer's
  ``KVCacheTensor`` points at its region with a block stride of one element:
  vLLM's view of the layer has every block id but they all overlap inside the
  region (no memory of their own), and no one writes through it; the worker side
  turns the region into the layer's hot buffer (:func:`hot_buffer_view`).

Block tables and cache groups are untouched, so the attention metadata and the
block ids the connectors see stay vLLM's. The host pool's own capacity is
enforced by the scheduler side (:mod:`.admission`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ascend_offload.config import ConfigError, SparseOffloadConfig, parse_extra_config
from ascend_offload.connectors.ours import our_connectors

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)

SPARSE_DECODE = "AscendSparseDecodeConnector"
REMOTE_D2H = "SfaRemoteD2HConnector"
HOT_ALIGN = 4096  # hot regions start on a page boundary


# ------------------------------------------------------------------ settings


def sparse_decode_settings(vllm_config: VllmConfig) -> SparseOffloadConfig | None:
    """The decode offload settings if this engine decodes from a host pool, else ``None``:
    ``AscendSparseDecodeConnector``, or ``SfaRemoteD2HConnector`` as ``kv_consumer`` /
    ``kv_both``, of ours, with ``sparse_offload.enabled``."""
    for name, role, extra in our_connectors(vllm_config):
        if name == SPARSE_DECODE or (name == REMOTE_D2H and role in ("kv_consumer", "kv_both")):
            cfg = parse_extra_config(name, extra).sparse_offload
            if cfg.enabled:
                return cfg
    return None


def check_engine_constraints(vllm_config: VllmConfig) -> None:
    """No main KV on the device: refuse what would need it there."""
    if getattr(vllm_config.cache_config, "enable_prefix_caching", False):
        raise ConfigError(
            "key 'sparse_offload.enabled'=True: the main KV is not kept on the device, so "
            "vLLM's device prefix cache cannot share it between requests; set "
            "enable_prefix_caching=False (--no-enable-prefix-caching) on this instance, and "
            "'sparse_offload.prefix_cache_blocks' for the host pool's own prefix cache")


# ------------------------------------------------------------------ specs


def _layer_specs(group: Any) -> Mapping[str, Any]:
    spec = group.kv_cache_spec
    sub = getattr(spec, "kv_cache_specs", None)
    return sub if isinstance(sub, Mapping) else {n: spec for n in group.layer_names}


def main_kv_layers(groups: Sequence[Any]) -> dict[str, Any]:
    """The sparse main-KV layers (``cache_role`` SPARSE) and their specs, in group order."""
    from vllm.v1.kv_cache_interface import SparseCacheRole

    return {name: spec for g in groups for name, spec in _layer_specs(g).items()
            if getattr(spec, "cache_role", None) == SparseCacheRole.SPARSE}


@dataclasses.dataclass(frozen=True)
class HotLayout:
    """Where the hot buffers sit in the backing allocation (same on every worker)."""

    rows: int  # hot rows per layer: max_num_seqs * topk_buffer_size
    row_bytes: int
    layer_bytes: int  # region per main-KV layer (rows * row_bytes, page-aligned)

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes


def hot_layout(vllm_config: VllmConfig, cfg: SparseOffloadConfig, specs: Mapping[str, Any]) -> HotLayout:
    block = vllm_config.cache_config.block_size
    row_bytes = {int(s.page_size_bytes) // block for s in specs.values()}
    if len(row_bytes) != 1:
        raise ConfigError("key 'sparse_offload.enabled'=True: the main-KV layers have rows of "
                          f"{sorted(row_bytes)} bytes; one host pool needs one row size")
    rb = row_bytes.pop()
    rows = vllm_config.scheduler_config.max_num_seqs * cfg.topk_buffer_size
    return HotLayout(rows, rb, -(-rows * rb // HOT_ALIGN) * HOT_ALIGN)


# ------------------------------------------------------------------ rewrite


def cut_kv_cache_config(vllm_config: VllmConfig, config: Any, available_memory: int,
                        cfg: SparseOffloadConfig) -> Any:
    """``config`` without device main KV: indexer blocks over the memory left after the
    hot buffers, and one hot region per main-KV layer at the end of the allocation."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import KVCacheTensor

    if any(getattr(t, "host_resident", False) for t in config.kv_cache_tensors):
        raise ConfigError("key 'sparse_offload.enabled'=True: vLLM's own host-resident "
                          "(HiSparse) KV groups are configured too; use one of them")
    mains = main_kv_layers(config.kv_cache_groups)
    if not mains:
        raise ConfigError(
            "key 'sparse_offload.enabled'=True: the model has no sparse main-KV cache layer "
            "(cache_role SPARSE), so there is nothing to decode from a host pool; accepted: False")
    homes = {g for g, grp in enumerate(config.kv_cache_groups) for n in grp.layer_names
             if n in mains}
    if len(homes) > 1:
        raise ConfigError("key 'sparse_offload.enabled'=True: the sparse main-KV layers are "
                          "split over several KV cache groups (unsupported)")
    hot = hot_layout(vllm_config, cfg, mains)
    rest = []
    for group in config.kv_cache_groups:
        names = [n for n in group.layer_names if n not in mains]
        if not names:
            continue
        spec = group.kv_cache_spec
        sub = getattr(spec, "kv_cache_specs", None)
        if isinstance(sub, Mapping):
            spec = dataclasses.replace(spec, kv_cache_specs={n: sub[n] for n in names})
        rest.append(dataclasses.replace(group, layer_names=names, kv_cache_spec=spec))
    if not rest:
        raise ConfigError("key 'sparse_offload.enabled'=True: the model has no indexer cache "
                          "layer beside its main KV (cache_role INDEXER); nothing would select "
                          "the rows to load")
    hot_total = hot.layer_bytes * len(mains)  # plus a few KiB of slack below
    left = available_memory - hot_total
    phys = get_kv_cache_config_from_groups(vllm_config, rest, max(left, 0))
    if left <= 0 or phys.num_blocks < 2:
        raise ConfigError(
            f"key 'sparse_offload.topk_buffer_size'={cfg.topk_buffer_size}: hot buffers of "
            f"{len(mains)} layers x {hot.rows} rows x {hot.row_bytes} B ({hot_total / 2**20:.1f} "
            f"MiB) leave no room for the indexer cache in the {available_memory / 2**20:.1f} MiB "
            "of KV memory; lower it or max_num_seqs, or give the KV cache more memory")
    # vLLM's view of a main-KV layer: block b starts one element after block b-1 (vLLM
    # wants positive strides), so all its blocks overlap, from the start of the layer's
    # region on. A view may reach into the next layers' regions (no one writes through
    # it); only the last one needs slack past its region, once: (num_blocks - 1) elements
    # + a page, when that is longer than a hot buffer.
    spec = next(iter(mains.values()))
    elem = torch.empty(0, dtype=spec.dtype).element_size()
    region = hot.layer_bytes

    def slack_of(num_blocks: int) -> int:
        span = (num_blocks - 1) * elem + int(spec.page_size_bytes)
        return -(-max(0, span - region) // HOT_ALIGN) * HOT_ALIGN

    slack = slack_of(phys.num_blocks)
    if slack:  # the slack comes out of the same budget (fewer blocks need no more of it)
        phys = get_kv_cache_config_from_groups(vllm_config, rest, max(left - slack - HOT_ALIGN, 0))
        slack = slack_of(phys.num_blocks)
    base = -(-phys.kv_cache_tensors[0].size // HOT_ALIGN) * HOT_ALIGN
    size = base + region * len(mains) + slack
    tensors = [dataclasses.replace(t, size=size) for t in phys.kv_cache_tensors]
    for i, name in enumerate(mains):
        tensors.append(KVCacheTensor(size=size, layers=[name], layer_stride=region,
                                     block_stride=elem, offset=base + i * region))
    out = dataclasses.replace(config, num_blocks=phys.num_blocks, kv_cache_tensors=tensors)
    pages = {int(sp.page_size_bytes) for g in rest for sp in _layer_specs(g).values()}
    mark_cut(out, CutFacts(tuple(mains), hot.row_bytes, region,
                           pages.pop() if len(pages) == 1 else 0))
    return out


@dataclasses.dataclass(frozen=True)
class CutFacts:
    """What the cut decided, carried on the ``KVCacheConfig`` it rewrote.

    Why on the config: vLLM hands the scheduler a copy of worker 0's config whose
    per-layer specs are collapsed to one per group (``generate_scheduler_kv_cache_config``),
    so the scheduler side could no longer tell main-KV from indexer layers; the copy
    keeps instance attributes (deepcopy and pickle both do).
    """

    layers: tuple[str, ...]  # main-KV layers, group order
    row_bytes: int
    region_bytes: int  # device bytes per main-KV layer (its hot buffer)
    # one block's page of each indexer layer (0: they differ): where hybrid residency
    # fits resident main-KV rows
    index_page: int = 0


_FACTS = "ascend_offload_sparse_cut"


def mark_cut(config: KVCacheConfig, facts: CutFacts) -> None:
    object.__setattr__(config, _FACTS, facts)


def cut_facts(config: KVCacheConfig) -> CutFacts | None:
    """The cut applied to ``config`` (``None``: vLLM's allocation, main KV on the device)."""
    return getattr(config, _FACTS, None)


def cut_kv_cache_configs(vllm_config: VllmConfig, configs: list[Any], available_memory: Sequence[int],
                         cfg: SparseOffloadConfig) -> list[Any]:
    """Rewrite every worker's config; all keep the smallest worker's ``num_blocks``."""
    from ascend_offload.connectors.logging_setup import wire_logging

    wire_logging()  # the engine core builds no connector before this runs
    check_engine_constraints(vllm_config)
    out = [c if not c.kv_cache_tensors else cut_kv_cache_config(vllm_config, c, mem, cfg)
           for c, mem in zip(configs, available_memory, strict=True)]
    sized = [c.num_blocks for c in out if c.kv_cache_tensors]
    if sized and len(set(sized)) > 1:
        low = min(sized)
        for c in out:
            if c.kv_cache_tensors:
                c.num_blocks = low
    for before, after in zip(configs, out, strict=True):
        if after.kv_cache_tensors:
            log.info("ascend-offload sparse decode: main KV of %d layers kept in the host pool, "
                     "not on the device; device KV %.1f -> %.1f MiB (indexer + hot buffers), "
                     "blocks %d -> %d", len(main_kv_layers(after.kv_cache_groups)),
                     before.kv_cache_tensors[0].size / 2**20,
                     after.kv_cache_tensors[0].size / 2**20, before.num_blocks, after.num_blocks)
    return out


# ------------------------------------------------------------------ worker side


def is_cut(kv_cache: torch.Tensor) -> bool:
    """A main-KV layer view of a cut allocation (blocks one element apart)."""
    return kv_cache.dim() >= 2 and kv_cache.shape[0] > 1 and kv_cache.stride(0) == 1


def hot_buffer_view(kv_cache: torch.Tensor, rows: int) -> torch.Tensor:
    """The layer's hot region as ``[rows, row]`` over the engine's own allocation."""
    row = kv_cache.shape[-1]
    need = (kv_cache.storage_offset() + rows * row) * kv_cache.element_size()
    have = kv_cache.untyped_storage().nbytes()
    if not is_cut(kv_cache) or need > have:
        raise ConfigError(
            "key 'sparse_offload.enabled'=True: the engine allocated main KV on the device "
            f"(layer view {tuple(kv_cache.shape)} stride {kv_cache.stride()}, {have} B backing, "
            f"{need} B needed): the KV cut was not applied in the engine core; is the "
            "ascend_offload plugin installed in every vLLM process?")
    return torch.as_strided(kv_cache, (rows, row), (row, 1), kv_cache.storage_offset())


def device_kv_bytes(config: KVCacheConfig) -> dict[str, int]:
    """Device KV bytes of a (cut or plain) config: ``total`` backing, ``main`` bytes of the
    main-KV layers (hot regions when cut), ``indexer`` the rest."""
    mains = main_kv_layers(config.kv_cache_groups)
    total = config.kv_cache_tensors[0].size if config.kv_cache_tensors else 0
    main = 0
    for t in config.kv_cache_tensors:
        n = sum(1 for name in t.layers if name in mains)
        if not n:
            continue
        page = int(mains[t.layers[0]].page_size_bytes)
        if t.block_stride < page:  # a cut layer (overlapping blocks): its hot region
            main += n * t.layer_stride
        else:
            main += n * page * config.num_blocks
    return {"total": total, "main": main, "indexer": total - main}
