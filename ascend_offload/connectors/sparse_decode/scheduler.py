"""Scheduler side of sparse decode offload: which request is which, and pool admission.

Per step it tells the workers which requests are new (with the rows to
reserve), which finished, and how to name each scheduled request from the
attention's batch (the block holding its newest position -> request id). It
also keeps the host pool's ledger (:class:`~ascend_offload.sparse.admission.PoolLedger`):
a request enters vLLM's running set only when its pool rows are reserved.

Preemption (:class:`~ascend_offload.sparse.preemption.PreemptionBook`): a preempted
request keeps its pool rows; the step that preempts it orders the workers to
stash its indexer rows (its old blocks, remembered here: vLLM freed them before
this side sees the preemption), and on resumption the stashed tokens are offered
to vLLM as computed (``get_num_new_matched_tokens``) and loaded into the new
blocks before the forward.

Hybrid residency (:class:`~ascend_offload.sparse.hybrid.ResidentBook`,
``sparse_offload.hybrid``): newly scheduled requests are placed in blocks borrowed from
vLLM's block pool while it has spare ones, resident requests grow with them, and when
vLLM needs blocks back (a waiting request does not fit, a running one cannot grow:
``has_pending_block_frees``) the longest-running residents move to the host pool.

Decode-side prefix caching (:class:`~ascend_offload.sparse.prefix_cache.PrefixIndex`,
``sparse_offload.prefix_cache_blocks``): a new request's leading cached blocks are
offered as external hits and reserved as shared (the ledger counts them once); a
finished request's full blocks become entries; the orders go to the workers in the
step's metadata, in the order they were decided.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ascend_offload.connectors.sparse_decode.settings import SparseDecodeSettings
from ascend_offload.sparse.admission import PoolLedger
from ascend_offload.sparse.hybrid import HybridOp, ResidentBook
from ascend_offload.sparse.preemption import (
    PreemptionBook,
    PreemptState,
    ResumeOrder,
    StashOrder,
    set_load_failure_policy,
    stash_offer_guard,
)
from ascend_offload.sparse.prefix_cache import PrefixHit, PrefixIndex, PrefixOp

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclasses.dataclass
class SparseDecodeMetadata(KVConnectorMetadata):
    """Scheduler -> workers, one per step."""

    new: dict[str, int]  # newly scheduled request -> positions to reserve
    keys: dict[int, str]  # block holding a scheduled request's newest position -> request
    finished: tuple[str, ...]  # finished or aborted since the last step
    # new requests' computed tokens when scheduled (remote-D2H: the prompt rows the
    # consumer already put in the pool)
    computed: dict[str, int] = dataclasses.field(default_factory=dict)
    # preempted this step -> what to stash before the forward (tokens 0: recomputed later)
    preempted: dict[str, StashOrder] = dataclasses.field(default_factory=dict)
    # resumed this step -> what to load into its new blocks before the forward
    resumed: dict[str, ResumeOrder] = dataclasses.field(default_factory=dict)
    # scheduled request -> draft tokens this step verifies (speculative decoding; absent: 0)
    drafts: dict[str, int] = dataclasses.field(default_factory=dict)
    # prefix cache orders since the last step, in order (before finishes and admissions)
    prefix_ops: tuple[PrefixOp, ...] = ()
    # newly scheduled request -> the cached blocks it starts from
    prefix_hits: dict[str, PrefixHit] = dataclasses.field(default_factory=dict)
    # resumed request recomputed from position 0 (no stash) -> its leading blocks shared
    # with prefix cache entries, to be replaced by blocks of its own before it writes them
    unshare: dict[str, int] = dataclasses.field(default_factory=dict)
    # hybrid residency orders of this step, in order (before finishes and admissions)
    hybrid_ops: tuple[HybridOp, ...] = ()


class PoolBlocks:
    """Blocks borrowed from vLLM's block pool for resident main KV (hybrid residency).

    Why the pool directly: a borrowed block is one vLLM will not hand out (reference
    count 1), counted as used in its usage and free-block figures, and returned with
    ``free_blocks`` like any request's."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self._held: dict[int, KVCacheBlock] = {}

    def num_free(self) -> int:
        return self.pool.get_num_free_blocks()

    def take(self) -> int:
        block = self.pool.get_new_blocks(1)[0]
        self._held[block.block_id] = block
        return block.block_id

    def give(self, blocks: Sequence[int]) -> None:
        self.pool.free_blocks([self._held.pop(b) for b in blocks])

    def __len__(self) -> int:
        return len(self._held)


class SparseDecodeScheduler:
    """Request naming and host-pool admission for one engine."""

    def __init__(self, settings: SparseDecodeSettings, kv_transfer_config: Any = None) -> None:
        """``kv_transfer_config`` (vLLM's, at startup): its ``kv_load_failure_policy`` is
        set to ``recompute`` when stashes are offered (``set_load_failure_policy``)."""
        self.s = settings
        self.ledger = PoolLedger(settings.pool_blocks, settings.block_size)
        self.preemption = PreemptionBook(settings.stash_tokens, settings.block_size)
        if kv_transfer_config is None:  # vLLM's config of this process, where one is current
            from vllm.config import get_current_vllm_config_or_none

            current = get_current_vllm_config_or_none()
            kv_transfer_config = None if current is None else current.kv_transfer_config
        set_load_failure_policy(kv_transfer_config, settings.stash_tokens)
        self.kv_cache_manager: KVCacheManager | None = None  # bound by vLLM after construction
        self._groups_checked = False
        cap = settings.cfg.prefix_cache_blocks
        self.prefix = PrefixIndex(cap, settings.block_size) if cap else None
        self._hits: dict[str, int] = {}  # request -> pinned blocks vLLM took as computed
        self.hybrid: ResidentBook | None = None  # bound with vLLM's block pool
        self._last_batch = 1  # requests scheduled by the last step (hybrid demand estimate)
        # running request -> its block ids per group as last read from vLLM; read again only
        # when a step's newest position lies past them (a running request's blocks of one
        # full-attention group are only ever appended to), dropped at preemption, resumption
        # and finish; None: read every step (several groups, see _check_groups)
        self._block_ids: dict[str, tuple[list[int], ...]] | None = {}

    def bind_block_pool(self, pool: BlockPool) -> None:
        """vLLM's block pool, once built: hybrid residency borrows from it."""
        if self.s.hybrid is not None and self.hybrid is None:
            self.hybrid = ResidentBook(self.s.hybrid, PoolBlocks(pool),
                                       keep_free=self.s.hybrid_keep_free,
                                       max_resident=self.s.cfg.hybrid_max_resident)
            log.info("sparse decode hybrid residency: main KV resident in borrowed blocks "
                     "(%d to %d rows a block), %d of %d blocks never borrowed",
                     self.s.hybrid.min_rows, self.s.hybrid.min_rows + 1, self.hybrid.keep_free,
                     self.s.num_blocks)

    def hybrid_wait(self, request: Request, num_computed_tokens: int,
                    tokens: int | None = None) -> bool:
        """A waiting request that does not fit in vLLM's free blocks while residents hold
        borrowed ones: ``True`` = wait a step; the residents that give the blocks back move
        at the end of this step (:meth:`build_meta`). ``tokens``: what vLLM allocates for it
        at once (a pull: its whole prompt; default one step's chunk of the rest)."""
        if self.hybrid is None or not len(self.hybrid):
            return False
        if tokens is None:
            tokens = min(request.num_tokens - num_computed_tokens, self.s.max_batched_tokens
                         or request.num_tokens)
        need = -(-max(tokens, 1) // self.s.block_size) + 1
        if self.hybrid.source.num_free() >= need:
            return False
        return self.hybrid.want(need)

    def pending_frees(self) -> bool:
        """vLLM could not allocate for a running request: residents can give blocks back
        (so it waits a step instead of preempting). It asks for a block per request of the
        last step beyond what is free now (a decode step's growth), so at least one moves."""
        if self.hybrid is None:
            return False
        spare = self.hybrid.source.num_free() - self.hybrid.keep_free
        return self.hybrid.want(max(1, spare + self._last_batch))

    def _check_groups(self) -> None:
        """Once the KV cache manager is bound: no stash offers to an engine of several KV
        cache groups (``stash_offer_guard``)."""
        if self._groups_checked or self.kv_cache_manager is None:
            return
        self._groups_checked = True
        groups = int(getattr(self.kv_cache_manager, "num_kv_cache_groups", 1))
        why = stash_offer_guard(groups)
        if why is not None:
            self.preemption.refuse(why)
        if groups > 1:  # a sliding-window group's blocks are replaced, not only appended
            self._block_ids = None

    def _blocks_of(self, req_id: str, last: int) -> tuple[list[int], ...]:
        """The request's block ids per group, holding at least ``last + 1`` blocks of the
        request-key group when vLLM has allocated them (read from vLLM when not known)."""
        cache = self._block_ids
        if cache is None:
            assert self.kv_cache_manager is not None
            return self.kv_cache_manager.get_block_ids(req_id)
        groups = cache.get(req_id)
        if groups is None or last >= len(groups[self.s.group]):
            assert self.kv_cache_manager is not None
            groups = cache[req_id] = self.kv_cache_manager.get_block_ids(req_id)
        return groups

    def _forget_blocks(self, req_ids: Iterable[str]) -> None:
        """Their block ids are no longer vLLM's (preempted, resumed in new blocks, finished)."""
        if self._block_ids is not None:
            for rid in req_ids:
                self._block_ids.pop(rid, None)

    def admit(self, request: Request) -> bool:
        """Reserve the request's pool rows; ``False``: not now (vLLM retries it next step).
        A new request's leading cached blocks (prefix cache) are pinned and reserved as
        shared; unpinned entries are evicted, least recently used first, when the rest
        does not fit otherwise."""
        rid = request.request_id
        if self.ledger.holds(rid):
            return True
        sp = request.sampling_params
        prompt = request.prompt_token_ids
        tokens = self.s.reservation(None if prompt is None else len(prompt),
                                    None if sp is None else sp.max_tokens)
        if self.prefix is None:
            return self.ledger.reserve(rid, tokens)
        hit = self.prefix.match(request.block_hashes, request.num_tokens)
        short = self.ledger.blocks_for(tokens) - len(hit) - self.ledger.free_blocks
        if 0 < short <= self.prefix.evictable_except(hit):
            self.ledger.uncache(self.prefix.evict(short, protect=hit))
        if not self.ledger.reserve(rid, tokens, shared=len(hit)):
            return False
        self.prefix.pin(rid, hit)
        return True

    def prefix_offer(self, request: Request, num_computed_tokens: int = 0) -> int:
        """Tokens of a new request served from cached blocks, beyond ``num_computed_tokens``.
        None for a preempted one: only a new request's blocks are loaded from the cache (a
        resumed one is served by its stash, or recomputed from position 0)."""
        if self.prefix is None or self.preemption.state(request.request_id) is not PreemptState.RUNNING:
            return 0
        hit = self.prefix.pinned(request.request_id)
        return max(0, len(hit) * self.s.block_size - num_computed_tokens)

    def finished(self, request_id: str, request: Request | None = None,
                 block_ids: Sequence[int] = ()) -> None:
        """vLLM finished or aborted the request: its full blocks with KV become prefix cache
        entries (``request`` and its computed ``block_ids`` given, the cache on), the rest
        of its pool rows are free."""
        if self.prefix is not None:
            if request is not None and block_ids:
                done = request.num_computed_tokens - int(getattr(request, "num_in_flight_tokens", 0))
                n = min(len(request.block_hashes), max(0, done) // self.s.block_size,
                        len(block_ids))
                kept, evicted = self.prefix.keep(request_id, request.block_hashes[:n],
                                                 block_ids[:n])
                self.ledger.uncache(evicted)
                self.ledger.to_cache(request_id, kept)
            self._hits.pop(request_id, None)
            self.ledger.uncache(self.prefix.unpin(request_id))
        self.ledger.release(request_id)
        self.preemption.finish(request_id)
        self._forget_blocks((request_id,))
        if self.hybrid is not None:
            self.hybrid.release(request_id)

    def _unshare(self, request_id: str) -> int:
        """A request that shares cached blocks is recomputed from position 0: it needs its
        own blocks for them (reserved here, unpinned entries evicted first if the pool is
        short), and no longer pins the entries. Returns the blocks to replace."""
        if self.prefix is None:
            return 0
        n = len(self.prefix.pinned(request_id))
        if not n:
            return 0
        short = n - self.ledger.free_blocks
        if short > 0:
            self.ledger.uncache(self.prefix.evict(short))
        self.ledger.grow(request_id, n)
        self.ledger.uncache(self.prefix.unpin(request_id))
        self._hits.pop(request_id, None)
        return n

    def reset_prefix(self) -> int:
        """``reset_prefix_cache``: every entry forgotten (pinned ones once unused);
        returns the entries evicted now."""
        if self.prefix is None:
            return 0
        evicted = self.prefix.reset()
        self.ledger.uncache(evicted)
        return evicted

    def resume_offer(self, request: Request, num_computed_tokens: int = 0) -> int:
        """Tokens of a preempted request that vLLM need not recompute, beyond the
        ``num_computed_tokens`` it already has (0: none): the external count both the
        colocated and the RD2H decode connector answer for a resumption."""
        rid = request.request_id
        if self.preemption.state(rid) is not PreemptState.STASHED:
            return 0
        return max(0, self.preemption.offer(rid, request.num_tokens) - num_computed_tokens)

    def after_alloc(self, request: Request, num_external_tokens: int) -> bool:
        """vLLM allocated blocks for ``request``; ``True``: a resumption we load. A new
        request with pinned cached blocks uses those vLLM took as computed (the rest are
        unpinned and reserved as its own)."""
        rid = request.request_id
        if self.preemption.after_alloc(rid, num_external_tokens):
            return True
        if self.prefix is not None and rid not in self._hits:
            pinned = len(self.prefix.pinned(rid))
            take = min(pinned, max(0, num_external_tokens) // self.s.block_size)
            if take < pinned:
                log.warning("sparse decode prefix cache: request %s: vLLM took %d of %d cached "
                            "blocks; the rest are computed", rid, take, pinned)
                self.ledger.grow(rid, pinned - take)
                self.ledger.uncache(self.prefix.unpin(rid, keep=take))
            self._hits[rid] = take
        return False

    def recv_hit(self, request_id: str, block_ids: Sequence[int]) -> PrefixHit | None:
        """A remote-D2H decode request whose prompt is pulled into the pool: the cached
        blocks it starts from (their device blocks ``block_ids[:n]``), which are not pulled.
        Handed to the workers with the pull, not at scheduling."""
        take = self._hits.pop(request_id, 0)
        if not take or self.prefix is None:
            return None
        return PrefixHit(self.prefix.pinned(request_id)[:take], tuple(block_ids[:take]))

    def build_meta(self, scheduler_output: SchedulerOutput) -> SparseDecodeMetadata:
        self._check_groups()
        so = scheduler_output
        done = so.finished_req_ids
        finished = tuple(sorted(done)) if done else ()
        # before the scheduled requests update the book: a request preempted this step
        # stashes what it had after the last step it ran
        preempted: dict[str, StashOrder] = {}
        if so.preempted_req_ids:
            preempted = {rid: self.preemption.preempt(rid)
                         for rid in sorted(so.preempted_req_ids) if rid not in done}
            self._forget_blocks(so.preempted_req_ids)
        new: dict[str, int] = {}
        computed: dict[str, int] = {}
        hits: dict[str, PrefixHit] = {}
        assert self.kv_cache_manager is not None, "vLLM did not bind the KV cache manager"
        g, bs = self.s.group, self.s.block_size
        for r in so.scheduled_new_reqs:
            take = self._hits.get(r.req_id, 0)
            if take and self.prefix is not None:
                blocks = self.kv_cache_manager.get_block_ids(r.req_id)[g]
                hits[r.req_id] = PrefixHit(self.prefix.pinned(r.req_id)[:take],
                                           tuple(blocks[:take]))
            computed[r.req_id] = r.num_computed_tokens
            sp = r.sampling_params
            new[r.req_id] = self.s.reservation(
                None if r.prompt_token_ids is None else len(r.prompt_token_ids),
                None if sp is None else sp.max_tokens)
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        keys: dict[int, str] = {}
        unshare: dict[str, int] = {}
        resumed: dict[str, ResumeOrder] = {}
        resumed_ids = cached.resumed_req_ids
        if resumed_ids:  # in new blocks: read again
            self._forget_blocks(resumed_ids)
        scheduled = self.preemption.scheduled
        for req_id, n in so.num_scheduled_tokens.items():
            c = computed[req_id]
            last = (c + n - 1) // bs
            groups = self._blocks_of(req_id, last)
            blocks = groups[g]
            if last < len(blocks):
                keys[blocks[last]] = req_id
            if resumed_ids and req_id in resumed_ids:
                resumed[req_id] = self.preemption.resumed(req_id, groups)
                if resumed[req_id].tokens == 0:
                    own = self._unshare(req_id)
                    if own:
                        unshare[req_id] = own
            scheduled(req_id, c + n, groups)
        if preempted:
            self.preemption.step_built()
        spec = getattr(so, "scheduled_spec_decode_tokens", None)
        drafts = {rid: len(t) for rid, t in spec.items() if t} if spec else {}
        ops = self.prefix.take_ops() if self.prefix is not None else ()
        return SparseDecodeMetadata(new, keys, finished,
                                    {r: computed[r] for r in new}, preempted, resumed, drafts,
                                    ops, hits, unshare,
                                    self._hybrid_step(so, computed, preempted, hits))

    def _hybrid_step(self, scheduler_output: SchedulerOutput, computed: dict[str, int],
                     preempted: dict[str, StashOrder], hits: dict[str, PrefixHit]
                     ) -> tuple[HybridOp, ...]:
        """Hybrid residency after vLLM scheduled the step: preempted residents move, new
        requests are placed (not those starting from cached prefix blocks: their rows are
        the pool's), residents grow, then vLLM gets back what it asked for."""
        book = self.hybrid
        if book is None:
            return ()
        for rid in preempted:
            book.move(rid)
        new = {r.req_id for r in scheduler_output.scheduled_new_reqs}
        holds, grow = book.holds, book.grow
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            if holds(rid):  # placed earlier (also: before a remote-D2H pull)
                grow(rid, computed[rid] + n)
            elif rid in new and rid not in hits:
                book.place(rid, computed[rid] + n)
        book.relieve()
        self._last_batch = max(1, len(scheduler_output.num_scheduled_tokens))
        return book.take_ops()
