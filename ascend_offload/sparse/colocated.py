"""Colocated sparse decode: one engine prefills and then decodes from the host pool.

The :class:`~ascend_offload.sparse.adapter.SparseDecodeAdapter` implementation
behind ``AscendSparseDecodeConnector`` (no vLLM here: the connector only feeds
it the scheduler's per-step facts). Per request it keeps how many leading
positions the host pool holds, so every step writes exactly the rows the pool
lacks: the new tokens, prompt positions that came from vLLM's prefix cache
instead of being computed, and positions recomputed after a preemption.

Which request a batch row is comes from the scheduler as ``key -> request id``
(the block holding the request's newest position, see
:class:`~ascend_offload.sparse.adapter.BatchRow`). The engine keeps no main KV
on the device, so every row must be served from the pool: the scheduler side
admits a request only once its pool rows are reserved (the same count this
side reserves), and a row that still cannot be matched is a broken invariant,
raised, never attended over wrong rows.

Requests arrive two ways: :meth:`ColocatedSparseDecode.admit` (this engine
prefills them) or :meth:`ColocatedSparseDecode.attach` (the remote-D2H consumer
already reserved their rows and filled the prompt's KV). A preempted request
is :meth:`~ColocatedSparseDecode.preempt`-ed (its hot row is freed, its pool
rows and pooled count stay, its indexer rows go to the
:class:`~ascend_offload.sparse.preemption.IndexerStash`) and
:meth:`~ColocatedSparseDecode.resume`-d on a fresh hot row (the stash loaded
into its new blocks); positions it writes again below its high-water mark are
counted as recomputed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence

import torch

from ascend_offload import device as dev
from ascend_offload.sparse.adapter import BatchRow, ResidentStep, SparseStepPlan
from ascend_offload.sparse.hybrid import GrowOp, HybridOp, MoveOp
from ascend_offload.sparse.manager import SparseOffloadManager, StepEntry
from ascend_offload.sparse.pools import PoolCapacityError
from ascend_offload.sparse.preemption import IndexerStash, ResumeOrder, StashOrder
from ascend_offload.sparse.prefix_cache import KeepOrder, PrefixBlocks, PrefixHit, PrefixOp

# the device.host_read reasons counted per report, in the counters' order
_READ_REASONS = (dev.TOPK_READ, dev.NEW_ROWS_READ, dev.STEP_READ)

logger = logging.getLogger(__name__)


class ColocatedSparseDecode:
    """Request bookkeeping and step binding over one :class:`SparseOffloadManager`."""

    def __init__(self, manager: SparseOffloadManager, layer_names: Sequence[str],
                 stash: IndexerStash | None = None, *, query_tokens: int = 1,
                 prefix: PrefixBlocks | None = None) -> None:
        """``stash``: where preempted requests' indexer rows wait (default: none, every
        preempted request is recomputed). ``prefix``: the decode-side prefix cache (default:
        none). ``query_tokens``: rows of up to this many query
        tokens attend over the hot buffer (1 + the speculative draft tokens); longer rows
        (prefill chunks, recomputation) over the pool's rows."""
        if query_tokens < 1 or query_tokens * manager.index_topk > manager.hot_size:
            raise ValueError(f"query_tokens={query_tokens}: a row's union of top-k sets must fit "
                             f"the hot buffer of {manager.hot_size} rows")
        if len(layer_names) != manager.num_layers:
            raise ValueError(f"{len(layer_names)} layer names for a manager of "
                             f"{manager.num_layers} layers")
        self.manager = manager
        self.stash = stash if stash is not None else IndexerStash([], [], manager.block_size, 0)
        self.prefix = prefix
        self.load_errors: set[int] = set()  # device blocks vLLM must recompute (taken by the worker)
        self.layer_names = list(layer_names)
        self.query_tokens = query_tokens
        self._layer_of = {n: i for i, n in enumerate(layer_names)}
        self._pooled: dict[str, int] = {}  # admitted request -> leading positions in the pool
        self._high: dict[str, int] = {}  # admitted request -> most positions it ever pooled
        self._detached: set[str] = set()  # preempted: pool rows kept, no hot row
        self._keys: Mapping[int, str] = {}
        self._drafts: Mapping[str, int] = {}
        self._step_key: object = None
        self._plan: SparseStepPlan | None = None
        self._plan_rows: tuple[BatchRow, ...] = ()
        self._open = False
        self._warned: set[str] = set()  # admitted-or-refused requests only: bounded by finish
        self.admission_failures = 0
        self.unmatched_rows = 0
        self.recomputed_tokens = 0  # positions written again after they had been pooled
        self.verify_rows = 0  # decode rows of several query tokens (speculative verification)
        self.placed_requests = 0  # hybrid: requests that started resident
        self.moved_requests = 0  # hybrid: resident requests moved to the host pool
        # device.host_read totals are per process: counted from here
        self._reads0 = dev.host_read_counts(_READ_REASONS)
        # the prefix cache's counter fields, read by name every report (no asdict copy)
        self._prefix_fields = (() if prefix is None else
                               tuple(f.name for f in dataclasses.fields(prefix.counters)))

    # ------------------------------------------------------------------ requests

    def admit(self, req_id: str, max_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Reserve pool rows for ``max_tokens`` positions and a hot row; ``False`` (logged,
        counted) when the pool or the hot rows are exhausted (the scheduler's ledger
        should have prevented it; its rows then fail in :meth:`plan_step`). A request
        already admitted (resumed after preemption) keeps its rows.

        ``hit``: the request starts with cached prefix blocks: their indexer rows go into
        its device blocks now (before the forward) and its table shares their pool rows,
        so those positions count as pooled. Blocks that cannot be served are the
        request's own and land in :attr:`load_errors` (vLLM recomputes them)."""
        if req_id in self._pooled:
            return True
        shared = self.take_prefix(req_id, hit) if hit is not None else []
        try:
            self.manager.admit(req_id, max_tokens, shared)
        except PoolCapacityError as exc:
            self.admission_failures += 1
            self._warn(req_id, f"not admitted to the host pool: {exc}")
            return False
        self._pooled[req_id] = self._high[req_id] = len(shared) * self.manager.block_size
        return True

    def take_prefix(self, req_id: str, hit: PrefixHit) -> list[int]:
        """Serve a request's cached prefix blocks: their indexer rows into its device blocks
        (now, before any forward of it); returns the pool blocks its table must start with.
        Blocks that cannot be served land in :attr:`load_errors` (vLLM recomputes them)."""
        if self.prefix is None:
            shared: list[int] = []
            failed = list(hit.device_blocks)
        else:
            shared = self.prefix.shared_blocks(hit)
            failed = self.prefix.load(hit, len(shared))
            shared = shared[:len(hit.device_blocks) - len(failed)]
        if failed:
            self._warn(req_id, f"{len(failed)} cached prefix blocks not served: recomputed")
            self.load_errors.update(failed)
        return shared

    def apply_prefix(self, ops: Sequence[PrefixOp]) -> None:
        """The scheduler's prefix cache orders of this step, in order (before finished
        requests release their rows: a keep takes over some of them)."""
        if self.prefix is None:
            if ops:
                self._warn("prefix cache", f"{len(ops)} orders but no prefix cache here")
            return
        for op in ops:
            if isinstance(op, KeepOrder) and self.resident(op.req_id):
                # hybrid residency: the kept blocks' main-KV rows are on the device; the
                # entry holds the request's pool blocks, so they get the rows first
                bs = self.manager.block_size
                pos = torch.tensor([i * bs + o for i, _ in op.entries for o in range(bs)],
                                   dtype=torch.int64)
                self.manager.copy_to_pool(op.req_id, pos)
            self.prefix.apply(op)

    def apply_hybrid(self, ops: Sequence[HybridOp]) -> None:
        """The scheduler's hybrid residency orders of this step, in order: rows of borrowed
        blocks join a resident request, or a resident request's rows move to its pool rows
        (before the forward: vLLM may hand its blocks out from the next step on)."""
        area = self.manager.area
        if area is None:
            if ops:
                self._warn("hybrid", f"{len(ops)} residency orders but hybrid residency is off here")
            return
        for op in ops:
            if isinstance(op, GrowOp):
                self.placed_requests += int(not area.holds(op.req_id))
                area.grow(op.req_id, op.blocks)
            elif isinstance(op, MoveOp) and area.holds(op.req_id):
                self.manager.move_to_pool(op.req_id, self._pooled.get(op.req_id, 0))
                self.moved_requests += 1

    def resident(self, req_id: str) -> bool:
        """Hybrid residency: the request's main KV is on the device."""
        return self.manager.area is not None and self.manager.area.holds(req_id)

    def attach(self, req_id: str, max_tokens: int, pooled: int) -> None:
        """A request whose pool rows another party reserved and whose first ``pooled``
        positions it filled (remote-D2H prompt KV): take a hot row for it."""
        if req_id in self._pooled:
            return
        self.manager.attach(req_id, max_tokens)
        self._pooled[req_id] = pooled
        self._high[req_id] = pooled

    def finish(self, req_id: str) -> None:
        """Free the request's pool rows, hot row and residency state (idempotent)."""
        self._pooled.pop(req_id, None)
        self._high.pop(req_id, None)
        self._warned.discard(req_id)
        self.stash.drop(req_id)
        if self.manager.area is not None:
            self.manager.area.drop(req_id)
        if req_id in self._detached:  # preempted: no hot row, its pool rows are still held
            self._detached.discard(req_id)
            self.manager.pool.release(req_id)
        self.manager.finish(req_id)

    def preempt(self, req_id: str, order: StashOrder) -> bool:
        """vLLM preempted the request (its blocks are freed, not yet reused): stash its
        indexer rows as ``order`` says, free its hot row and residency state, keep its
        pool rows and pooled count (what its resumption does not recompute). ``True``
        if its rows were stashed."""
        if req_id in self._pooled and self.manager.detach(req_id):
            self._detached.add(req_id)
        return self.stash.save(req_id, order)

    def unshare(self, req_id: str, blocks: int) -> None:
        """A request that started from cached blocks is recomputed (preempted without a
        stash): its first ``blocks`` pool blocks become its own before it writes them, so
        the cache's rows are never written over. Logged (and left shared) when the pool
        has no free blocks for them."""
        if not self.manager.pool.holds(req_id):
            return
        try:
            self.manager.unshare(req_id, blocks)
        except PoolCapacityError as exc:
            self._warn(req_id, f"cached blocks not replaced before its recomputation: {exc}")

    def resume(self, req_id: str, order: ResumeOrder) -> list[int]:
        """vLLM scheduled a preempted request again: load its stash into its new blocks
        (``order``), and give it a hot row whose contents start invalid (a new residency
        tag), so its top-k misses fetch from the pool. Returns the blocks whose load
        failed (vLLM recomputes them)."""
        failed = self.stash.load(req_id, order) if order.tokens else []
        if not order.tokens:
            self.stash.drop(req_id)
        if req_id in self._detached:
            self.manager.attach(req_id, self.manager.pool.capacity(req_id))
            self._detached.discard(req_id)
        return failed

    def pooled(self, req_id: str) -> int:
        """Leading positions of the request whose main-KV rows are in the pool."""
        return self._pooled.get(req_id, 0)

    @property
    def admitted(self) -> list[str]:
        return list(self._pooled)

    # ------------------------------------------------------------------ per step

    def begin(self, step_key: object, keys: Mapping[int, str],
              drafts: Mapping[str, int] | None = None) -> None:
        """A new engine step: ``keys`` maps each scheduled request's key block to its id,
        ``drafts`` a request to the draft tokens this step verifies (speculative decoding:
        their positions may be rolled back, so rewriting them later is no recomputation).
        ``step_key`` is any object unique to the step (the connector's metadata)."""
        if step_key is self._step_key:
            return
        self.end_step()
        self._step_key = step_key
        self._keys = keys
        self._drafts = drafts or {}
        self._plan = None

    def sparse_layer_index(self, layer_name: str) -> int | None:
        return self._layer_of.get(layer_name)

    def plan_step(self, rows: Sequence[BatchRow]) -> SparseStepPlan:
        """Bind the manager's step to the attention's batch (once per step)."""
        rows = tuple(rows)
        if self._plan is not None:
            if rows != self._plan_rows:
                raise ValueError("plan_step: a layer of this step saw another batch "
                                 f"({len(rows)} rows, {len(self._plan_rows)} planned)")
            return self._plan
        # once per step on the critical path: locals, no per-row method calls
        area = self.manager.area
        held = area.request_ids() if area is not None else frozenset()
        keys, pooled, drafts, qt = self._keys, self._pooled, self._drafts, self.query_tokens
        start: list[int] = []
        decode: list[bool] = []
        entries: list[StepEntry] = []
        for row in rows:
            req = keys.get(row.key)
            if req is None or req not in pooled:
                self.unmatched_rows += int(req is None)
                raise RuntimeError(
                    f"sparse decode: batch row (key block {row.key}, {row.num_tokens} tokens) "
                    + ("matches no scheduled request" if req is None else
                       f"is request {req!r}, which holds no host pool rows")
                    + "; the device has no main KV to attend over instead")
            n_tok, n_new = row.num_tokens, row.num_new
            first = min(pooled[req], n_tok - n_new)
            on_device = req in held
            if on_device and area.capacity(req) < n_tok:  # type: ignore[union-attr]
                raise RuntimeError(
                    f"sparse decode: request {req!r} is resident with "
                    f"{area.capacity(req)} device rows, "  # type: ignore[union-attr]
                    f"fewer than its {n_tok} tokens this step")
            start.append(first)
            # resident rows attend over their device rows (context_rows), not the hot buffer
            dec = not on_device and 1 <= n_new <= qt
            decode.append(dec)
            if dec and drafts.get(req, 0) > 0:
                self.verify_rows += 1
            # positions written this step are not trusted in the hot buffer (recomputation,
            # rewritten rejected drafts): the stable-length rule
            entries.append(StepEntry(req, n_tok, first))
        resident: ResidentStep | None = None
        if entries:
            self.manager.begin_step(entries)  # validates the batch before anything changes
            self._open = True
            resident = self.manager.resident_step([row.num_new for row in rows])
        plan = SparseStepPlan(tuple(range(len(entries))), tuple(start), tuple(decode),
                              len(entries), qt, resident)
        high_of = self._high
        for row, e in zip(rows, entries, strict=True):
            req, n_tok = e.req_id, row.num_tokens
            high = high_of.get(req, 0)
            # positions this step writes that the pool already held (a recomputation)
            if high > n_tok - row.num_new:
                self.recomputed_tokens += min(high, n_tok) - (n_tok - row.num_new)
            # draft positions are tentative: a rejection rewrites them, not a recompute
            certain = n_tok - min(drafts.get(req, 0), row.num_new)
            if certain > high:
                high_of[req] = certain
            pooled[req] = n_tok
        self._plan, self._plan_rows = plan, rows
        return plan

    def end_step(self) -> None:
        if self._open:
            self.manager.end_step()
            self._open = False

    # ------------------------------------------------------------------ data path

    def offload_new_kv(self, layer: int, new_kv: torch.Tensor, positions: torch.Tensor) -> None:
        self.manager.offload_new_kv(layer, new_kv, positions)

    def onload_topk(self, layer: int, topk: torch.Tensor) -> torch.Tensor:
        return self.manager.onload_topk(layer, topk)

    def hot_buffer(self, layer: int) -> torch.Tensor:
        return self.manager.hot_buffer(layer)

    def context_rows(self, layer: int, batch_index: int, positions: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.manager.context_rows(layer, batch_index, positions)

    # ------------------------------------------------------------------ reporting

    def counters(self) -> dict[str, int]:
        """Monotonic totals (the connector turns them into per-report deltas). Read every
        step: plain attribute reads into one dict, nothing else."""
        st = self.manager.stats
        sc = self.stash.counters
        reads = dev.host_read_counts(_READ_REASONS)
        r0 = self._reads0
        out = {
            "steps": st.steps,
            "resolved_positions": st.resolved_positions,
            "hit_positions": st.hits,
            "miss_rows": st.miss_rows,
            "miss_bytes": st.onload_bytes,
            "offload_rows": st.offload_rows,
            "offload_bytes": st.offload_bytes,
            "offload_ns": st.offload_ns,
            "resolve_ns": st.resolve_ns,
            "copy_ns": st.copy_ns,
            "context_rows": st.context_rows,
            "pool_query_tokens": st.pool_query_tokens,
            "admission_failures": self.admission_failures,
            "unmatched_rows": self.unmatched_rows,
            "recomputed_tokens": self.recomputed_tokens,
            "verify_rows": self.verify_rows,
            "resident_rows": st.resident_rows,
            "resident_query_tokens": st.resident_query_tokens,
            "placed_requests": self.placed_requests,
            "moved_requests": self.moved_requests,
            "moved_bytes": st.moved_bytes,
            "preempted_requests": sc.preempted_requests,
            "resumed_tokens": sc.resumed_tokens,
            "stash_failures": sc.stash_failures,
            "stash_ns": sc.stash_ns,
            # device -> host reads on the sparse path (device.host_read) since this object was
            # made, in its process (engines sharing a process share the count): per layer
            # with the host resolver (top-k, new rows), per step with the device one
            "host_reads_topk": reads[0] - r0[0],
            "host_reads_new_rows": reads[1] - r0[1],
            "host_reads_step": reads[2] - r0[2],
        }
        if self.prefix is not None:
            pc = self.prefix.counters
            out.update((f"prefix_{n}", getattr(pc, n)) for n in self._prefix_fields)
        return out

    def gauges(self) -> dict[str, int]:
        area = self.manager.area
        pooled = len(self._pooled)
        # admitted requests holding device rows (a set intersection, not a loop per request)
        resident = 0 if area is None else len(area.request_ids() & self._pooled.keys())
        return {"pool_rows_used": self.manager.pool_rows_used,
                "admitted_requests": pooled,
                "stash_bytes": self.stash.bytes_held,
                "prefix_cache_blocks": 0 if self.prefix is None else len(self.prefix),
                "resident_requests": resident,
                "offloaded_requests": pooled - resident}

    def _warn(self, who: str, msg: str) -> None:
        if who not in self._warned:
            self._warned.add(who)
            logger.warning("sparse decode: %s: %s", who, msg)
