"""Our sparse decode path inside vllm-ascend's SFA attention (DeepSeek-V3.2 on NPU).

Written against vllm-ascend ``main`` at 182b75ea84ff (2026-08-22; vLLM v0.27.1 /
vLLM main cdc4824a), ``vllm_ascend/attention/sfa_v1.py`` and
``sfa_kv_offload.py`` (facts in docs/vllm-ascend.md).

vllm-ascend picks its SFA implementation in ``AscendSFABackend.get_impl_cls()``
(its own offload impl ``AscendSFAKVOffloadImpl`` when
``sparse_kv_offload_config.enabled``). :func:`install` wraps that staticmethod:
when one of our connectors has ``sparse_offload.enabled`` it returns
``AscendOffloadSFAImpl`` = :class:`SparseOffloadSFAMixin` over the plain
``AscendSFAImpl``; otherwise it returns whatever vllm-ascend's own choice is, so
with our config off nothing of vllm-ascend's path changes. :func:`uninstall`
restores the original.

Per layer and step the mixin maps vllm-ascend's two offload points onto our
:class:`~ascend_offload.sparse.adapter.SparseDecodeAdapter` (what
``models/attention.py: _run_offloaded`` does for our own model):

* ``exec_kv``: vllm-ascend writes the step's K (``kv_lora_rank``) and rope rows into
  its paged caches as usual; then the rows the host pool lacks are read back
  and handed to ``offload_new_kv`` as one row per token (``[nope | rope]``, the
  layout of our pool).
* ``_execute_sparse_flash_attention_process``: one-token rows of offloaded
  requests give their indexer top-k (logical positions) to ``onload_topk`` and
  attend over the hot-buffer rows it returns; every other row goes to
  vllm-ascend's kernel over the paged cache, unchanged.

The paged main cache stays allocated (our device-KV cut does not apply on the vLLM
vllm-ascend targets; ``registration.py``): prefill and any row the offload side does
not serve read it.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from ascend_offload.config import ConfigError
from ascend_offload.integrations.vllm_ascend import settings
from ascend_offload.patches import apply_patch, restore_patch
from ascend_offload.sparse.adapter import BatchRow, SparseDecodeAdapter, SparseStepPlan

log = logging.getLogger(__name__)

SFA_MODULE = "vllm_ascend.attention.sfa_v1"
_MARK = "_ascend_offload_original_get_impl_cls"
_UNSET = object()


def find_sparse_adapter() -> SparseDecodeAdapter | None:
    """The active KV connector (or a child of a multi connector) that implements the adapter."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    conn = get_kv_transfer_group()
    for c in (conn, *getattr(conn, "sub_connectors", ())):
        if isinstance(c, SparseDecodeAdapter):
            return c
    return None


@dataclasses.dataclass
class StepRows:
    """One step as vllm-ascend's SFA metadata describes it, bound to the adapter's plan."""

    plan: SparseStepPlan
    starts: list[int]  # first query token of each request (TND order)
    ends: list[int]
    seq_lens: list[int]
    block_table: torch.Tensor  # [num_reqs, W] kernel block ids, on the host
    kernel_block_size: int


class _Step:
    """The current step's rows, computed by the first offloaded layer that sees its metadata
    (all SFA layers of a step share one metadata object) and reused by the others."""

    meta: Any = None
    rows: StepRows | None = None


def _step_rows(adapter: SparseDecodeAdapter, meta: Any, scheduler_block_size: int) -> StepRows:
    if _Step.meta is meta and _Step.rows is not None:
        return _Step.rows
    seq = [int(s) for s in meta.seq_lens_cpu.tolist()]
    num_reqs = len(seq)
    ends = [int(c) for c in meta.cum_query_lens[:num_reqs].tolist()]
    starts = [0, *ends[:-1]]
    kbs = int(meta.block_size)
    if scheduler_block_size % kbs:
        raise ValueError(f"scheduler block size {scheduler_block_size} is not a multiple of "
                         f"the SFA kernel block size {kbs}")
    ratio = scheduler_block_size // kbs
    table = meta.block_table[:num_reqs].to("cpu", torch.int64)
    # BatchRow.key names a request by the scheduler block holding its newest position;
    # vllm-ascend's kernel block ids are scheduler_block * ratio + j (worker/block_table.py).
    rows = [BatchRow(int(table[r, (seq[r] - 1) // kbs]) // ratio, seq[r], ends[r] - starts[r])
            for r in range(num_reqs)]
    step = StepRows(adapter.plan_step(rows), starts, ends, seq, table, kbs)
    _Step.meta, _Step.rows = meta, step
    return step


def _slots(table: torch.Tensor, r: int, positions: torch.Tensor, kbs: int) -> torch.Tensor:
    """Paged-cache rows (kernel block id * kbs + offset) of request ``r``'s positions."""
    return table[r, positions // kbs] * kbs + positions % kbs


class SparseOffloadSFAMixin:
    """Overrides of ``AscendSFAImpl`` that route sparse layers through our adapter."""

    # set by offloaded_impl_class: vLLM's (scheduler) block size, which BatchRow keys use
    _ao_scheduler_block_size: int = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if getattr(self, "enable_sparse_sfa_c8", False):
            raise ConfigError("key 'sparse_offload.enabled'=True with vllm-ascend's sparse SFA C8 "
                              "main cache (packed rows): not supported; disable "
                              "enable_sparse_sfa_c8 or sparse_offload")
        self._ao_offload: Any = _UNSET
        self._ao_layer_name: str | None = None

    def _resolve_preprocess_type(self, act_dtype: torch.dtype) -> Any:
        # The fused prolog/MLAPO kernels write the caches without exec_kv, where the
        # new rows are offloaded: the native preprocessing is required (as in
        # vllm-ascend's own AscendSFAKVOffloadImpl).
        chosen = super()._resolve_preprocess_type(act_dtype)  # type: ignore[misc]
        return type(chosen).NATIVE

    def forward(self, layer_name: str, hidden_states: torch.Tensor, kv_cache: Any,
                attn_metadata: Any, output: torch.Tensor | None = None) -> torch.Tensor:
        self._ao_layer_name = layer_name
        try:
            return super().forward(layer_name, hidden_states, kv_cache,  # type: ignore[misc]
                                   attn_metadata, output)
        finally:
            self._ao_layer_name = None

    # ------------------------------------------------------------------ binding

    def _ao_target(self) -> tuple[SparseDecodeAdapter, int] | None:
        """(adapter, pool layer) of this layer, found once; None: not offloaded."""
        if self._ao_offload is _UNSET:
            name = self._ao_layer_name or getattr(self, "layer_name", None)
            adapter = find_sparse_adapter()
            layer = None if adapter is None or name is None else adapter.sparse_layer_index(name)
            self._ao_offload = None if layer is None else (adapter, layer)
            if self._ao_offload is None:
                log.info("ascend-offload: SFA layer %s is not offloaded (no sparse decode "
                         "adapter or not a registered layer): vllm-ascend's path runs", name)
        return self._ao_offload

    # ------------------------------------------------------------------ new rows

    def exec_kv(self, kv_no_split: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, ...], slots: torch.Tensor, attn_metadata: Any) -> Any:
        result = super().exec_kv(kv_no_split, cos, sin, kv_cache, slots,  # type: ignore[misc]
                                 attn_metadata)
        target = self._ao_target()
        if target is None:
            return result
        adapter, layer = target
        step = _step_rows(adapter, attn_metadata, self._ao_scheduler_block_size)
        src, pos = [], []
        for r, b in enumerate(step.plan.batch_index):
            if b < 0:
                continue
            p = torch.arange(step.plan.offload_from[r], step.seq_lens[r])
            src.append(_slots(step.block_table, r, p, step.kernel_block_size))
            pos.append(torch.stack((torch.full_like(p, b), p), dim=1))
        if src:
            rows = torch.cat(src).to(kv_cache[0].device)
            k_cache, rope_cache = kv_cache[0], kv_cache[1]
            blk, off = rows // step.kernel_block_size, rows % step.kernel_block_size
            new_kv = torch.cat((k_cache[blk, off, 0], rope_cache[blk, off, 0]), dim=-1)
            adapter.offload_new_kv(layer, new_kv, torch.cat(pos))
        return result

    # ------------------------------------------------------------------ attention

    def _execute_sparse_flash_attention_process(
        self, ql_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: Any, topk_indices: torch.Tensor,
        attn_metadata: Any, actual_seq_lengths_query: torch.Tensor,
        actual_seq_lengths_key: torch.Tensor, block_table: torch.Tensor | None = None,
    ) -> torch.Tensor:
        original = super()._execute_sparse_flash_attention_process  # type: ignore[misc]
        target = self._ao_target()
        step = None if target is None else _step_rows(target[0], attn_metadata,
                                                      self._ao_scheduler_block_size)
        if target is None or step is None or not step.plan.any_decode:
            return original(ql_nope, q_pe, kv_cache, topk_indices, attn_metadata,
                            actual_seq_lengths_query, actual_seq_lengths_key,
                            block_table=block_table)
        adapter, layer = target
        plan = step.plan
        dec = [r for r, d in enumerate(plan.decode) if d]
        rest = [r for r, d in enumerate(plan.decode) if not d]
        dec_tok = torch.tensor([step.starts[r] for r in dec], device=ql_nope.device)

        # top-k of the offloaded one-token rows, in the adapter's batch order
        topk = topk_indices.reshape(topk_indices.shape[0], -1)
        k = topk.shape[1]
        sel = topk[dec_tok.to(topk.device)].to("cpu", torch.int32)  # one copy per layer
        lens = torch.tensor([step.seq_lens[r] for r in dec], dtype=torch.int32).unsqueeze(1)
        request = torch.full((plan.num_entries, k), -1, dtype=torch.int32)
        request[torch.tensor([plan.batch_index[r] for r in dec])] = torch.where(
            (sel >= 0) & (sel < lens), sel, -1)
        hot_slots = adapter.onload_topk(layer, request)
        hot = adapter.hot_buffer(layer)
        entries = torch.tensor([plan.batch_index[r] for r in dec], device=hot_slots.device)
        dec_out = original(ql_nope[dec_tok], q_pe[dec_tok],
                           *self._ao_hot_view(hot, hot_slots[entries], step.kernel_block_size),
                           attn_metadata, *self._ao_hot_lengths(len(dec), k, step, hot.device),
                           block_table=self._ao_hot_table(len(dec), k, step, hot.device))
        out = dec_out.new_zeros((ql_nope.shape[0], *dec_out.shape[1:]))
        out[dec_tok.to(out.device)] = dec_out
        if rest:
            tok = torch.cat([torch.arange(step.starts[r], step.ends[r]) for r in rest])
            tok = tok.to(ql_nope.device)
            qlens = torch.tensor([step.ends[r] - step.starts[r] for r in rest], dtype=torch.int32)
            rows = torch.tensor(rest, device=actual_seq_lengths_key.device)
            table = attn_metadata.block_table if block_table is None else block_table
            out[tok.to(out.device)] = original(
                ql_nope[tok], q_pe[tok], kv_cache, topk_indices[tok], attn_metadata,
                torch.cumsum(qlens, 0, dtype=torch.int32).to(actual_seq_lengths_query.device),
                actual_seq_lengths_key[rows], block_table=table[rows.to(table.device)])
        return out

    # The hot rows a decode token selected, gathered into a paged layout the SFA kernel
    # reads (PA_BSND, split nope / rope caches): token i's K rows are its "sequence",
    # pages i*P .. (i+1)*P-1, and sparse index j (or -1) is the j-th selected row. The
    # gather copies K rows per token; the same positions in the same order reach the
    # kernel as over the paged cache.

    def _ao_pages(self, k: int, kbs: int) -> int:
        return -(-k // kbs)

    def _ao_hot_view(self, hot: torch.Tensor, slots: torch.Tensor, kbs: int
                     ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        k_dim = int(self.kv_lora_rank)  # type: ignore[attr-defined]
        if hot.shape[-1] != k_dim + int(self.qk_rope_head_dim):  # type: ignore[attr-defined]
            raise ValueError(f"hot buffer rows of {hot.shape[-1]} values; the SFA layer needs "
                             f"kv_lora_rank + qk_rope_head_dim = "
                             f"{k_dim + int(self.qk_rope_head_dim)}")  # type: ignore[attr-defined]
        n, k = slots.shape
        width = self._ao_pages(k, kbs) * kbs
        slots = slots.to(torch.int64)
        rows = hot[slots.clamp(min=0)]  # [n, k, D]
        if width > k:
            rows = torch.cat((rows, rows.new_zeros(n, width - k, rows.shape[-1])), dim=1)
        nope = rows[..., :k_dim].reshape(-1, kbs, 1, k_dim)
        rope = rows[..., k_dim:].reshape(-1, kbs, 1, rows.shape[-1] - k_dim)
        idx = torch.full((n, width), -1, dtype=torch.int32, device=hot.device)
        j = torch.arange(k, dtype=torch.int32, device=hot.device).expand(n, k)
        idx[:, :k] = torch.where(slots.to(hot.device) >= 0, j, -1)
        return (nope, rope), idx.unsqueeze(1)

    def _ao_hot_lengths(self, n: int, k: int, step: StepRows, device: torch.device
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        width = self._ao_pages(k, step.kernel_block_size) * step.kernel_block_size
        cum_q = torch.arange(1, n + 1, dtype=torch.int32, device=device)
        return cum_q, torch.full((n,), width, dtype=torch.int32, device=device)

    def _ao_hot_table(self, n: int, k: int, step: StepRows, device: torch.device) -> torch.Tensor:
        pages = self._ao_pages(k, step.kernel_block_size)
        return torch.arange(n * pages, dtype=torch.int32, device=device).view(n, pages)


def offloaded_impl_class(base: type, scheduler_block_size: int) -> type:
    """``AscendOffloadSFAImpl``: the mixin over vllm-ascend's ``AscendSFAImpl`` (or a fake)."""
    return type("AscendOffloadSFAImpl", (SparseOffloadSFAMixin, base),
                {"_ao_scheduler_block_size": scheduler_block_size,
                 "__module__": __name__})


def _check_graph_mode(vllm_config: Any) -> None:
    comp = getattr(vllm_config, "compilation_config", None)
    mode = getattr(comp, "cudagraph_mode", None)
    if mode is not None and getattr(mode, "has_full_cudagraphs", lambda: False)():
        raise ConfigError(
            f"key 'sparse_offload.enabled'=True on vllm-ascend: the hot-buffer resolve runs on "
            f"the host between kernels, which full graphs ({mode.name}) capture; use PIECEWISE "
            "or NONE (or enforce_eager=True)")


def patch_backend(module: Any) -> None:
    """Wrap ``module.AscendSFABackend.get_impl_cls`` (idempotent)."""
    backend = module.AscendSFABackend
    if _MARK in backend.__dict__:
        return
    original = backend.__dict__["get_impl_cls"]
    original_fn = original.__func__ if isinstance(original, staticmethod) else original
    classes: dict[tuple[type, int], type] = {}

    def get_impl_cls() -> type:
        from vllm.config import get_current_vllm_config

        vllm_config = get_current_vllm_config()
        if settings.sparse_offload_settings(vllm_config) is None:
            return original_fn()
        settings.check_single_offload_manager(vllm_config)
        _check_graph_mode(vllm_config)
        chosen = original_fn()
        if chosen is not module.AscendSFAImpl:
            raise ConfigError(
                f"key 'sparse_offload.enabled'=True: vllm-ascend selected the SFA impl "
                f"{chosen.__name__} (context parallel or another variant); sparse decode "
                "offload runs over the plain AscendSFAImpl only (accepted: no DSA/SFA context "
                "parallel, or sparse_offload.enabled=False)")
        key = (module.AscendSFAImpl, int(vllm_config.cache_config.block_size))
        if key not in classes:
            classes[key] = offloaded_impl_class(*key)
            log.info("ascend-offload: vllm-ascend SFA decode runs through ascend-offload's "
                     "sparse decode offload (AscendOffloadSFAImpl)")
        return classes[key]

    setattr(backend, _MARK, original)
    apply_patch("vllm_ascend.sfa.impl_cls", backend, staticmethod(get_impl_cls))


def unpatch_backend(module: Any) -> None:
    """Undo :func:`patch_backend`."""
    backend = module.AscendSFABackend
    original = backend.__dict__.get(_MARK)
    if original is not None:
        restore_patch("vllm_ascend.sfa.impl_cls", backend, original)
        delattr(backend, _MARK)
