"""Startup facts and checks of sparse decode offload, shared by every connector that
decodes from a host pool (``AscendSparseDecodeConnector``, ``SfaRemoteD2HConnector``'s
decode side). Every role runs them, so a bad config fails at startup everywhere."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from ascend_offload.config import ConfigError, SparseOffloadConfig
from ascend_offload.kv_layout import layer_order
from ascend_offload.sparse.hybrid import AreaGeometry
from ascend_offload.sparse.pools import GiB, rows_for_budget

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def model_index_topk(vllm_config: VllmConfig) -> int:
    """The model's indexer top-k; startup error naming the key if it has no sparse attention."""
    hf = vllm_config.model_config.hf_config
    topk = getattr(hf, "index_topk", None)
    if topk is None or not getattr(hf, "use_sparse_attention", True):
        raise ConfigError(
            f"key 'sparse_offload.enabled'=True: model {vllm_config.model_config.model!r} "
            f"({getattr(hf, 'architectures', None)}) has no sparse attention (no 'index_topk', "
            "or 'use_sparse_attention' false), so there is no top-k to decode from a host pool "
            "(accepted: False for this model)")
    return int(topk)


# Speculative methods whose drafts need no layer of ours: the proposer reads token ids
# only. A draft model (eagle, draft_model, MTP) runs attention layers of its own whose
# KV this offload does not manage.
SPEC_METHODS = ("ngram",)


def speculative_tokens(vllm_config: VllmConfig, cfg: SparseOffloadConfig, index_topk: int) -> int:
    """Draft tokens per step of the engine's speculative config (0: none), checked: the
    method needs no draft layers, and a verification row's union of top-k sets fits the
    hot buffer (``(1 + k) * index_topk`` rows, a multiple of the block size)."""
    spec = vllm_config.speculative_config
    if spec is None:
        return 0
    method = getattr(spec, "method", None)
    if method not in SPEC_METHODS:
        raise ConfigError(
            f"key 'speculative_config.method'={method!r} with 'sparse_offload.enabled'=True: "
            f"a draft model's attention layers are not offloaded (accepted: "
            f"{', '.join(repr(m) for m in SPEC_METHODS)}, or no speculative_config)")
    k = int(spec.num_speculative_tokens or 0)
    need = (1 + k) * index_topk
    block = vllm_config.cache_config.block_size
    need = -(-need // block) * block
    if cfg.topk_buffer_size < need:
        raise ConfigError(
            f"key 'sparse_offload.topk_buffer_size'={cfg.topk_buffer_size} with "
            f"'speculative_config.num_speculative_tokens'={k}: a verification row of {1 + k} "
            f"tokens selects up to {1 + k} x index_topk={index_topk} distinct positions, resolved "
            f"into the hot buffer at once; the smallest size that works is {need} (a multiple of "
            f"block_size={block}), or lower num_speculative_tokens")
    return k


def prefix_cache_checks(cfg: SparseOffloadConfig, *, paged: bool, pool_blocks: int,
                        groups: int) -> None:
    """Where the decode-side prefix cache cannot work, refused at startup naming the key."""
    key = f"key 'sparse_offload.prefix_cache_blocks'={cfg.prefix_cache_blocks}"
    if paged:
        raise ConfigError(f"{key}: the engine keeps the main KV paged on the device (vllm-ascend), "
                          "where vLLM's own prefix cache applies; accepted: 0")
    if groups > 1:
        raise ConfigError(f"{key}: the engine has {groups} KV cache groups; the cache copies one "
                          "group's indexer blocks (accepted: 0 for this model)")
    if cfg.prefix_cache_blocks > pool_blocks:
        raise ConfigError(f"{key}: every entry holds one host pool block and the pool has "
                          f"{pool_blocks} (at most that, or raise 'dram_size_per_dp_GB')")


def hybrid_geometry(cfg: SparseOffloadConfig, kv_cache_config: KVCacheConfig, *,
                    mains: tuple[str, ...], indexers: list[str], row_bytes: int, paged: bool,
                    index_page: int) -> AreaGeometry:
    """Where resident main-KV rows fit in borrowed indexer blocks; refused at startup,
    naming the key, where hybrid residency cannot work."""
    key = "key 'sparse_offload.hybrid'=True"
    if paged:
        raise ConfigError(f"{key}: the engine keeps the main KV paged on the device (vllm-ascend); "
                          "it is resident there already (accepted: False)")
    if len(kv_cache_config.kv_cache_groups) != 1 or len(indexers) != len(mains):
        raise ConfigError(f"{key}: resident rows live in the paired indexer layer's borrowed "
                          f"blocks, one indexer layer per main-KV layer in one KV cache group; "
                          f"this engine has {len(kv_cache_config.kv_cache_groups)} groups, "
                          f"{len(indexers)} indexer and {len(mains)} main-KV layers (accepted: False)")
    places = {(t.block_stride, t.layer_stride) for t in kv_cache_config.kv_cache_tensors
              if any(n in indexers for n in t.layers)}
    page = index_page
    if len(places) != 1 or not page:
        raise ConfigError(f"{key}: the indexer layers have {len(places)} block layouts and "
                          f"{'one page size' if page else 'several page sizes'}; one of each is "
                          "needed (accepted: False)")
    geometry = AreaGeometry(places.pop()[0], page, row_bytes)
    if geometry.min_rows < 1:
        raise ConfigError(f"{key}: an indexer block page of {page} B cannot hold two main-KV rows "
                          f"of {row_bytes} B; raise the block size (accepted: False)")
    return geometry


@dataclasses.dataclass(frozen=True)
class PagedMainKV:
    """Main-KV facts of an engine allocation that keeps the main KV paged on the device.

    Why: on an engine our engine-core cut does not reach (vllm-ascend on the older vLLM
    it targets), the main KV stays allocated by the engine and its own prefill reads it;
    the integration that runs there marks the engine core's configs with these facts
    (the scheduler's copy keeps instance attributes, as with the cut's facts) so both
    roles size the host pool from the same layers and row bytes.
    """

    layers: tuple[str, ...]  # main-KV layers, group order
    row_bytes: int  # one token's main-KV row (nope | rope) in the caches' dtype


_PAGED = "ascend_offload_sparse_paged"
_PAGED_ACCEPTED = {"on": False}


def accept_paged_main_kv(on: bool) -> None:
    """Turned on by an integration whose engine keeps the main KV paged (vllm-ascend's
    ``install``); off, an uncut allocation is refused."""
    _PAGED_ACCEPTED["on"] = on


def mark_paged_main_kv(config: KVCacheConfig, facts: PagedMainKV) -> None:
    object.__setattr__(config, _PAGED, facts)


def paged_main_kv(config: KVCacheConfig) -> PagedMainKV | None:
    """The paged main-KV facts on ``config``, only while an integration accepts them."""
    return getattr(config, _PAGED, None) if _PAGED_ACCEPTED["on"] else None


@dataclasses.dataclass(frozen=True)
class SparseDecodeSettings:
    """What both sides of sparse decode offload derive from the engine config."""

    cfg: SparseOffloadConfig
    index_topk: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    layers: tuple[str, ...]  # main-KV layers (as the cut found them)
    group: int  # their KV cache group (block ids for the request keys)
    row_bytes: int
    pool_blocks: int  # host pool blocks per layer (the worker computes the same)
    # main KV paged on the device by the engine (an integration's allocation, not cut):
    # the worker allocates the hot buffers and reads (k_cache, v_cache) pairs
    paged: bool = False
    # every other cache layer (the indexer caches) with its KV cache group: what a
    # preempted request's stash copies out of vLLM's blocks and back
    indexer_layers: tuple[tuple[str, int], ...] = ()
    num_blocks: int = 0  # vLLM's device blocks (the block dimension of those caches)
    # draft tokens a speculative step verifies per request (0: no speculation): a decode
    # row then has up to 1 + spec_tokens query tokens, resolved into the hot buffer at once
    spec_tokens: int = 0
    # hybrid residency: how resident rows fit in borrowed indexer blocks (None: off)
    hybrid: AreaGeometry | None = None
    max_batched_tokens: int = 0  # vLLM's per-step token budget

    @property
    def hybrid_keep_free(self) -> int:
        """vLLM blocks hybrid residency never borrows."""
        return math.ceil(self.cfg.hybrid_free_fraction * self.num_blocks)

    @property
    def query_tokens(self) -> int:
        """The most query tokens of a row served from the hot buffer (a verification row)."""
        return 1 + self.spec_tokens

    @property
    def stash_tokens(self) -> int:
        """The preemption stash budget: the pool's token capacity; 0 with the main KV
        paged on the device (vllm-ascend): vLLM's own prefill there reads the paged main
        KV the preemption freed, so a preempted request is recomputed."""
        return 0 if self.paged else self.pool_blocks * self.block_size

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig, cfg: SparseOffloadConfig,
                  kv_cache_config: KVCacheConfig | None) -> SparseDecodeSettings:
        block = vllm_config.cache_config.block_size
        topk = model_index_topk(vllm_config)
        cfg.check_against(block_size=block, index_topk=topk)
        spec_tokens = speculative_tokens(vllm_config, cfg, topk)
        max_len = vllm_config.model_config.max_model_len
        layers: list[str] = []
        group, row_bytes, pool_blocks, paged = 0, 0, 0, False
        indexers: list[tuple[str, int]] = []
        num_blocks = 0
        hybrid: AreaGeometry | None = None
        if kv_cache_config is not None:
            from ascend_offload.connectors.sparse_decode.kv_cut import cut_facts

            facts = cut_facts(kv_cache_config) or paged_main_kv(kv_cache_config)
            if facts is None:
                raise ConfigError(
                    "key 'sparse_offload.enabled'=True: the engine's KV cache config was not cut "
                    "(main KV still allocated on the device); the ascend_offload plugin must be "
                    "installed in the engine core process (vLLM entry point "
                    "'vllm.general_plugins')")
            paged = isinstance(facts, PagedMainKV)
            layers = layer_order(facts.layers)
            group = next(g for g, grp in enumerate(kv_cache_config.kv_cache_groups)
                         if layers[0] in grp.layer_names)
            row_bytes = facts.row_bytes
            indexers = [(n, g) for g, grp in enumerate(kv_cache_config.kv_cache_groups)
                        for n in grp.layer_names if n not in layers]
            num_blocks = int(kv_cache_config.num_blocks)
            rows = rows_for_budget(cfg.dram_size_per_dp_GB * GiB, len(layers), row_bytes, block)
            pool_blocks = rows // block
            if cfg.prefix_cache_blocks:
                prefix_cache_checks(cfg, paged=paged, pool_blocks=pool_blocks,
                                    groups=len(kv_cache_config.kv_cache_groups))
            if cfg.hybrid:
                hybrid = hybrid_geometry(cfg, kv_cache_config, mains=tuple(layers),
                                         indexers=layer_order(n for n, _ in indexers),
                                         row_bytes=row_bytes, paged=paged,
                                         index_page=getattr(facts, "index_page", 0))
            if rows < max_len:
                raise ConfigError(
                    f"key 'sparse_offload.dram_size_per_dp_GB'={cfg.dram_size_per_dp_GB}: the host "
                    f"pool holds {rows} tokens x {len(layers)} layers x {row_bytes} B, less than "
                    f"one request of max_model_len={max_len}; raise it or lower max_model_len")
        return cls(cfg, topk, block, max_len, vllm_config.scheduler_config.max_num_seqs,
                   tuple(layers), group, row_bytes, pool_blocks, paged, tuple(indexers),
                   num_blocks, spec_tokens, hybrid,
                   int(vllm_config.scheduler_config.max_num_batched_tokens))

    def reservation(self, prompt_tokens: int | None, max_tokens: int | None) -> int:
        """Positions a request may ever need (prompt + new tokens, capped). With
        speculation a step computes KV for its drafts too: vLLM bounds drafts by
        ``max_model_len``, not by ``max_tokens``, so the last step may write up to
        ``spec_tokens`` positions past ``prompt + max_tokens``."""
        if prompt_tokens is None or max_tokens is None:
            return self.max_model_len
        return min(prompt_tokens + max_tokens + self.spec_tokens, self.max_model_len)


def sampling_max_tokens(request: Any) -> int | None:
    sp = getattr(request, "sampling_params", None)
    return None if sp is None else sp.max_tokens
