"""Worker side of sparse decode offload: the manager over the engine's hot regions.

One per TP rank. It builds a :class:`~ascend_offload.sparse.manager.SparseOffloadManager`
whose hot buffers are the engine's own KV allocation for the main-KV layers
(the regions :mod:`.kv_cut` reserved), with its own host pool or the one a
remote-D2H consumer fills, and a
:class:`~ascend_offload.sparse.colocated.ColocatedSparseDecode` for the
request bookkeeping. It is the :class:`~ascend_offload.sparse.adapter.SparseDecodeAdapter`
the model's attention calls, through the connector that owns it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ascend_offload.config import ConfigError
from ascend_offload.connectors.sparse_decode.kv_cut import HOT_ALIGN, hot_buffer_view
from ascend_offload.connectors.sparse_decode.scheduler import SparseDecodeMetadata
from ascend_offload.connectors.sparse_decode.settings import SparseDecodeSettings
from ascend_offload.kv_layout import layer_order
from ascend_offload.sparse.colocated import ColocatedSparseDecode
from ascend_offload.sparse.hybrid import ResidentArea, area_views
from ascend_offload.sparse.manager import SparseOffloadManager
from ascend_offload.sparse.pools import HostKVPool, pool_rows_from_config
from ascend_offload.sparse.preemption import IndexerStash, block_major
from ascend_offload.sparse.prefix_cache import PrefixBlocks

log = logging.getLogger(__name__)


def main_kv_rows(kv_caches: Mapping[str, torch.Tensor], names: Sequence[str]
                 ) -> tuple[int, torch.dtype]:
    """The one row shape of the main-KV layers (one host pool needs one)."""
    first = kv_caches[names[0]]
    row, dtype = first.shape[-1], first.dtype
    for n in names:
        if kv_caches[n].shape[-1] != row or kv_caches[n].dtype != dtype:
            raise ConfigError(f"key 'sparse_offload.enabled'=True: main-KV layer {n} has rows of "
                              f"{kv_caches[n].shape[-1]} x {kv_caches[n].dtype}, {names[0]} of "
                              f"{row} x {dtype}: one host pool needs one row shape")
    return row, dtype


def paged_main_kv_rows(kv_caches: Mapping[str, Any], names: Sequence[str], row_bytes: int
                       ) -> tuple[int, torch.dtype, torch.device]:
    """Row, dtype and device of main-KV layers the engine keeps paged as ``(k_cache, v_cache)``
    (vllm-ascend: nope and rope rows split); the row must be the one the scheduler sized the
    host pool with (``row_bytes``), so both roles count the same pool blocks."""
    shapes = set()
    for n in names:
        kv = kv_caches[n]
        if not isinstance(kv, (tuple, list)) or len(kv) != 2:
            raise ConfigError(f"key 'sparse_offload.enabled'=True: main-KV layer {n} registered "
                              f"{type(kv).__name__}; a paged main KV is a (k_cache, v_cache) pair")
        k, v = kv
        if k.dtype != v.dtype or k.device != v.device:
            raise ConfigError(f"key 'sparse_offload.enabled'=True: main-KV layer {n} has k/v "
                              f"caches of {k.dtype}/{v.dtype} on {k.device}/{v.device}")
        shapes.add((k.shape[-1] + v.shape[-1], k.dtype, k.device))
    if len(shapes) != 1:
        raise ConfigError(f"key 'sparse_offload.enabled'=True: main-KV layers have rows of "
                          f"{sorted(map(str, shapes))}: one host pool needs one row shape")
    row, dtype, dev = shapes.pop()
    if row * dtype.itemsize != row_bytes:
        raise ConfigError(f"key 'sparse_offload.enabled'=True: the main-KV caches have rows of "
                          f"{row} x {dtype} ({row * dtype.itemsize} B), the scheduler sized the "
                          f"host pool for {row_bytes} B rows: the roles disagree on the model")
    return row, dtype, dev


def unwrap_paged_caches(kv_caches: Mapping[str, Any], settings: SparseDecodeSettings
                        ) -> tuple[dict[str, Any], set[str]]:
    """vllm-ascend's registration (``settings.paged``): main layers keep their
    ``(k_cache, v_cache)`` pairs, an indexer layer's ``(k_cache,)`` becomes its tensor;
    returns them with the indexer names (every layer that is not main KV)."""
    mains = set(settings.layers)
    out: dict[str, Any] = {}
    for name, kv in kv_caches.items():
        if name not in mains and isinstance(kv, (tuple, list)):
            if len(kv) != 1:
                raise ConfigError(f"key 'sparse_offload.enabled'=True: indexer layer {name} "
                                  f"registered {len(kv)} tensors (a quantized key + scale "
                                  "cache); pulling it is not supported")
            kv = kv[0]
        out[name] = kv
    return out, set(out) - mains


ATTACH_TIMEOUT_S = 120.0


def shared_tp_pool(settings: SparseDecodeSettings, *, num_layers: int, row: int, dtype: torch.dtype,
                   tp_rank: int, name: str, timeout_s: float = ATTACH_TIMEOUT_S) -> HostKVPool:
    """The host pool all TP ranks of one engine share through ``/dev/shm``.

    Every rank holds the same (replicated, MLA) main KV, so one copy serves them all:
    rank 0 creates the mapping and writes new rows, the others attach and read after
    rank 0's per-layer publish fence. Ranks start concurrently, so a reader retries
    the attach until rank 0's file exists with its header written, or ``timeout_s``.
    """
    num_rows = pool_rows_from_config(
        settings.cfg, num_layers=num_layers, row_shape=(row,), dtype=dtype, block_size=settings.block_size)

    def pool(create: bool) -> HostKVPool:
        return HostKVPool(num_layers=num_layers, num_rows=num_rows, row_shape=(row,), dtype=dtype,
                          block_size=settings.block_size, shared_name=name, create=create)

    if tp_rank == 0:
        return pool(create=True)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return pool(create=False)
        except (FileNotFoundError, RuntimeError) as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(f"TP rank {tp_rank}: could not attach the shared host pool "
                                   f"{name!r} within {timeout_s}s: {exc}") from None
            time.sleep(0.05)


class SparseDecodeWorker:
    """Per-rank sparse decode state; applies the scheduler's metadata once per step."""

    def __init__(self, settings: SparseDecodeSettings, kv_caches: Mapping[str, Any], *,
                 tp_rank: int = 0, pool: HostKVPool | None = None, shared_pool: str | None = None
                 ) -> None:
        """``shared_pool``: with TP > 1, the name of the ``/dev/shm`` pool this engine's
        ranks share (see :func:`shared_tp_pool`); ``None``: a private pool (TP = 1)."""
        names = [n for n in settings.layers if n in kv_caches]
        if not names:
            raise ConfigError("key 'sparse_offload.enabled'=True: the model registered no sparse "
                              "main-KV cache layer (cache_role SPARSE); accepted: False")
        hot: list[torch.Tensor] | None = None
        where: torch.device | None = None
        if settings.paged:  # the engine's main KV stays paged: hot buffers of our own
            row, dtype, where = paged_main_kv_rows(kv_caches, names, settings.row_bytes)
        else:
            row, dtype = main_kv_rows(kv_caches, names)
            rows = settings.max_num_seqs * settings.cfg.topk_buffer_size
            hot = [hot_buffer_view(kv_caches[n], rows) for n in names]
        area = self._resident_area(settings, kv_caches, row, dtype) if settings.hybrid else None
        if shared_pool is not None and pool is None:
            pool = shared_tp_pool(settings, num_layers=len(names), row=row, dtype=dtype,
                                  tp_rank=tp_rank, name=shared_pool)
        self._unlink_pending = pool is not None and pool.shared_name is not None and tp_rank == 0
        self.manager = SparseOffloadManager(
            settings.cfg, num_layers=len(names), row_shape=(row,), dtype=dtype,
            block_size=settings.block_size, max_requests=settings.max_num_seqs,
            index_topk=settings.index_topk, pool=pool, device=where, hot_buffers=hot,
            tp_rank=tp_rank, max_positions=settings.max_model_len, area=area)
        if self.manager.pool.num_blocks != settings.pool_blocks and (pool is None or shared_pool):
            raise ConfigError(f"host pool of {self.manager.pool.num_blocks} blocks, the scheduler "
                              f"counts {settings.pool_blocks}: the roles disagree on the config")
        if settings.max_model_len > self.manager.residency.max_positions:
            raise ConfigError(
                f"key 'sparse_offload.topk_buffer_size'={settings.cfg.topk_buffer_size}: the "
                f"{self.manager.residency.kind} residency table indexes "
                f"{self.manager.residency.max_positions} positions, less than "
                f"max_model_len={settings.max_model_len}")
        stash = self._indexer_stash(settings, kv_caches)
        prefix = None
        if settings.cfg.prefix_cache_blocks:
            if not stash.caches:
                raise ConfigError(
                    f"key 'sparse_offload.prefix_cache_blocks'={settings.cfg.prefix_cache_blocks}: "
                    "the engine's indexer caches are not block-addressable here, so cached "
                    "blocks' indexer rows cannot be kept (accepted: 0)")
            prefix = PrefixBlocks(self.manager.pool, stash.caches, settings.cfg.prefix_cache_blocks)
            log.info("sparse decode prefix cache: up to %d blocks, their indexer rows in %.1f MiB "
                     "of host memory (main-KV rows shared in the pool)", prefix.capacity,
                     prefix.nbytes / 2**20)
        self.decode = ColocatedSparseDecode(self.manager, names, stash,
                                            # the paged main KV (vllm-ascend's SFA path)
                                            # serves multi-token rows itself
                                            query_tokens=1 if settings.paged
                                            else settings.query_tokens, prefix=prefix)
        self.applied: object = None  # the last metadata applied (identity: once per step)
        # steps whose orders changed what this worker holds (admissions, finishes,
        # preemptions, resumptions, prefix cache and hybrid orders): the gauges change
        # with these only, so a report recomputes them only when this moved
        self.holdings_version = 0
        self._preempts_handled: object = None
        self._prefix_applied: object = None
        self._load_errors: set[int] = set()
        self._kv_gauges: dict[str, int] | None = None
        kv = self.manager.pool.kv
        log.info("sparse decode offload of %d layers: host pool %d rows x %d x %s (%.3f GiB), "
                 "hot buffers %d rows per request x %d requests %s (%.1f MiB), residency %s "
                 "(%s)%s", len(names), kv.shape[1], row, dtype,
                 kv.numel() * kv.element_size() / 2**30, self.manager.hot_size,
                 self.manager.max_requests,
                 "beside the paged main KV" if settings.paged else "in the engine's KV allocation",
                 self.manager.hot.nbytes / 2**20,
                 self.manager.residency.kind, settings.cfg.residency_policy,
                 f"; pool shared by the TP ranks ({shared_pool}), rank {tp_rank} "
                 f"{'writes' if tp_rank == 0 else 'reads'}" if self.manager.pool.shared_name else "")

    @staticmethod
    def _resident_area(settings: SparseDecodeSettings, kv_caches: Mapping[str, Any], row: int,
                       dtype: torch.dtype) -> ResidentArea:
        """Hybrid residency's rows: main-KV layer ``i`` in indexer layer ``i``'s borrowed
        blocks (both in model order)."""
        assert settings.hybrid is not None
        names = layer_order(n for n, _ in settings.indexer_layers)
        try:
            caches = block_major(kv_caches, names, settings.num_blocks)
            views = area_views(caches, settings.hybrid, settings.num_blocks, dtype, row)
        except (ValueError, TypeError, AttributeError) as exc:
            raise ConfigError(f"key 'sparse_offload.hybrid'=True: the indexer caches cannot hold "
                              f"resident main-KV rows here ({exc}); accepted: False") from exc
        log.info("sparse decode hybrid residency: resident main-KV rows in borrowed blocks of "
                 "%d indexer layers (%d-%d rows of %d B a block)", len(views),
                 settings.hybrid.min_rows, settings.hybrid.min_rows + 1, settings.hybrid.row_bytes)
        return ResidentArea(views, settings.hybrid)

    @staticmethod
    def _indexer_stash(settings: SparseDecodeSettings, kv_caches: Mapping[str, Any]) -> IndexerStash:
        """The preemption stash over the engine's indexer caches (none: every preempted
        request is recomputed; see :attr:`SparseDecodeSettings.stash_tokens`)."""
        names = [n for n, _ in settings.indexer_layers if n in kv_caches]
        groups = [g for n, g in settings.indexer_layers if n in kv_caches]
        caches: list[torch.Tensor] = []
        if settings.stash_tokens and names:
            try:
                caches = block_major(kv_caches, names, settings.num_blocks)
            except (ValueError, TypeError, AttributeError) as exc:
                log.warning("sparse decode: indexer caches not block-addressable (%s): preempted "
                            "requests are recomputed", exc)
                caches, groups = [], []
        else:
            groups = []
        return IndexerStash(caches, groups, settings.block_size,
                            settings.stash_tokens if caches else 0)

    def handle_preemptions(self, meta: SparseDecodeMetadata) -> None:
        """Requests vLLM preempted this step (once per step, before the forward reuses their
        freed blocks): stash their indexer rows to host, free their hot rows."""
        if meta is self._preempts_handled:
            return
        self._preempts_handled = meta
        for rid, order in meta.preempted.items():
            self.decode.preempt(rid, order)

    def take_load_errors(self) -> set[int]:
        """Blocks of resumed requests whose stash could not be loaded (vLLM recomputes them)."""
        out, self._load_errors = self._load_errors | self.decode.load_errors, set()
        self.decode.load_errors.clear()
        return out

    def apply(self, meta: SparseDecodeMetadata) -> None:
        """This step's facts, once: preemptions (if vLLM did not hand them over first),
        prefix cache orders, finishes (their rows are free again), admissions (cached
        prefix blocks loaded), then resumptions (their stashed
        indexer rows into the new blocks, before the forward)."""
        if meta is self.applied:
            return
        self.applied = meta
        if self._unlink_pending:
            # vLLM steps the model only after every rank registered its KV caches, so
            # every reader has mapped the pool by now: drop the name (the mappings stay).
            self._unlink_pending = False
            self.manager.pool.unlink()
        if not (meta.finished or meta.new or meta.preempted or meta.resumed or meta.unshare
                or meta.prefix_ops or meta.hybrid_ops):
            # the usual decode step: nothing to preempt, admit, finish or move
            self._preempts_handled = self._prefix_applied = meta
            self.decode.begin(meta, meta.keys, meta.drafts)
            return
        self.handle_preemptions(meta)
        self.holdings_version += 1
        # prefix cache orders first: a keep takes over rows of a request finished below,
        # an eviction frees rows an admission below may need
        self.apply_prefix(meta)
        if meta.hybrid_ops:
            self.decode.apply_hybrid(meta.hybrid_ops)
        for rid in meta.finished:
            self.decode.finish(rid)
        for rid, max_tokens in meta.new.items():
            if self.manager.pool.holds(rid):  # a remote-D2H consumer filled its prompt rows
                self.decode.attach(rid, min(max_tokens, self.manager.pool.capacity(rid)),
                                   meta.computed.get(rid, 0))
            else:
                self.decode.admit(rid, max_tokens, meta.prefix_hits.get(rid))
        for rid, blocks in meta.unshare.items():  # recomputed from 0: own rows first
            self.decode.unshare(rid, blocks)
        for rid, order in meta.resumed.items():
            self._load_errors.update(self.decode.resume(rid, order))
        self.decode.begin(meta, meta.keys, meta.drafts)

    def apply_prefix(self, meta: SparseDecodeMetadata) -> None:
        """The step's prefix cache orders, once (the remote-D2H decode applies them before
        its pulls are admitted, then :meth:`apply` runs the rest)."""
        if meta is not self._prefix_applied:
            self._prefix_applied = meta
            self.decode.apply_prefix(meta.prefix_ops)

    def end_step(self) -> None:
        self.decode.end_step()

    # ------------------------------------------------------------------ metrics

    def device_kv_gauges(self) -> dict[str, int]:
        """:meth:`_device_kv_gauges`, read once (the allocation never changes)."""
        if self._kv_gauges is None:
            self._kv_gauges = self._device_kv_gauges()
        return self._kv_gauges

    def _device_kv_gauges(self) -> dict[str, int]:
        """The engine's device KV allocation, read from the storage the hot buffers live in.

        vLLM backs every layer's KV with one allocation; the cut put one hot region
        per main-KV layer at its end (:mod:`.kv_cut`), so the main-KV bytes are the
        hot buffers and everything before the first of them is the indexer cache
        (the rest: page alignment and the slack vLLM's overlapping views need). Hot
        buffers that are not views of one backing (the manager allocated them itself)
        count whole, with no indexer bytes known here.
        """
        hot = self.manager.hot.buffers
        storages = {b.untyped_storage().data_ptr() for b in hot}
        if len(storages) != 1:
            main = sum(b.untyped_storage().nbytes() for b in hot)
            return {"device_kv_bytes": main, "device_main_kv_bytes": main,
                    "device_indexer_kv_bytes": 0}
        backing = hot[0].untyped_storage().nbytes()
        start = min(int(b.storage_offset()) * b.element_size() for b in hot)
        main = sum(-(-b.numel() * b.element_size() // HOT_ALIGN) * HOT_ALIGN for b in hot)
        return {"device_kv_bytes": backing, "device_main_kv_bytes": main,
                "device_indexer_kv_bytes": start}
