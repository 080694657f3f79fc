"""``SfaRemoteD2HConnector``'s scheduler side: vLLM's scheduler hooks onto the vLLM-free
bookkeeping of :mod:`ascend_offload.pd.decode_requests` (decode) and
:mod:`ascend_offload.pd.prefill_requests` (prefill).

Only the translation lives here: a request's blocks come from vLLM's KV cache
manager, the step's scheduled tokens from ``SchedulerOutput``, and the result
goes into :class:`RemoteD2HMetadata`. A prefill request dispatched before its decode
registered is scheduled at once and its workers claim the registration
(``claim_in_worker``), or, held for the scheduler's claim, answered ``None`` (not
schedulable; vLLM asks again next step) until its claim ended (:meth:`PrefillRequests.ready`).

Hybrid residency on a sparse decode (``sparse_offload.hybrid``): a pulled request is
placed when its pull is registered (:class:`~ascend_offload.sparse.hybrid.ResidentBook`, pinned), so its main KV
lands in its resident rows, not the pool; it stays pinned (never chosen to move)
until vLLM first schedules it, i.e. while reads may write its rows and until the
workers attached it. A pulled request not placed then (no spare blocks, or it
starts from the decode's cached prefix blocks, whose rows are the pool's) lands
in the pool and is never placed later (its rows would be empty).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ascend_offload.connectors.remote_d2h.metadata import RemoteD2HMetadata
from ascend_offload.connectors.remote_d2h.settings import Settings
from ascend_offload.connectors.sparse_decode.scheduler import SparseDecodeScheduler
from ascend_offload.connectors.sparse_decode.settings import SparseDecodeSettings
from ascend_offload.pd.decode_requests import DecodeRequests, wants_remote_prefill
from ascend_offload.pd.prefill_requests import PrefillRequests, SendJob, wants_remote_decode
from ascend_offload.pd.registration import Registrar
from ascend_offload.sparse.hybrid import ResidentBook
from ascend_offload.transfer.base import transfer_protocol

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from ascend_offload.sparse.prefix_cache import PrefixHit


class RemoteD2HScheduler:
    """Scheduler state of one connector: decode's pulls and/or prefill's sends."""

    def __init__(
        self,
        settings: Settings,
        sparse: SparseDecodeSettings | None = None,
        kv_transfer_config: Any = None,
    ) -> None:
        """``kv_transfer_config``: vLLM's, handed to the sparse scheduler (it sets the
        load-failure policy its preemption stash relies on)."""
        cfg = settings.cfg
        self.decode = (
            DecodeRequests(
                settings.endpoint,
                block_size=settings.block_size,
                sparse=settings.sparse,
                registrar=Registrar(
                    timeout_s=cfg.registration_timeout_s, retries=cfg.registration_retries
                ),
                reservation=None if sparse is None else sparse.reservation,
            )
            if settings.is_consumer
            else None
        )
        self.prefill = (
            PrefillRequests(transfer_protocol(cfg), claim_timeout_s=cfg.claim_timeout_s,
                            claim_wait_s=cfg.claim_wait_ms / 1000, claim_in_worker=cfg.claim_in_worker)
            if settings.is_producer
            else None
        )
        # Decode with sparse offload: request names for the attention, and the host-pool ledger.
        self.sparse = (
            SparseDecodeScheduler(sparse, kv_transfer_config)
            if sparse is not None and self.decode
            else None
        )
        self._ledger_after_pull: set[str] = set()  # finished while pulling: released once stopped
        self._kv_cache_manager: KVCacheManager | None = None  # bound by vLLM after construction

    @property
    def kv_cache_manager(self) -> KVCacheManager | None:
        return self._kv_cache_manager

    @kv_cache_manager.setter
    def kv_cache_manager(self, mgr: KVCacheManager | None) -> None:
        self._kv_cache_manager = mgr
        if self.sparse is not None:
            self.sparse.kv_cache_manager = mgr

    def bind_block_pool(self, pool: BlockPool) -> None:
        """vLLM's block pool (bound with the KV cache manager): hybrid residency borrows
        from it."""
        if self.sparse is not None:
            self.sparse.bind_block_pool(pool)

    @property
    def hybrid(self) -> ResidentBook | None:
        return None if self.sparse is None else self.sparse.hybrid

    def _hybrid_wait(self, request: Request, num_computed_tokens: int) -> bool:
        """A waiting request that does not fit vLLM's free blocks while residents hold
        borrowed ones: wait a step (they move at its end). A pull allocates its whole
        prompt at once, so it needs all of its blocks, not one step's chunk."""
        assert self.sparse is not None
        pull = wants_remote_prefill(request.kv_transfer_params)
        return self.sparse.hybrid_wait(
            request,
            num_computed_tokens,
            request.num_prompt_tokens - num_computed_tokens if pull else None,
        )

    def has_pending_block_frees(self) -> bool:
        return self.sparse is not None and self.sparse.pending_frees()

    def _block_ids(self, request_id: str) -> list[int] | None:
        mgr = self.kv_cache_manager
        return list(mgr.get_block_ids(request_id)[0]) if mgr is not None else None

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self.prefill is not None and not self.prefill.ready(request):
            return None, False  # dispatched early: its decode's registration is not claimed yet
        if self.decode is None:
            return 0, False
        if self.sparse is not None and not self.sparse.admit(request):
            return None, False  # its host pool rows are not free yet: wait
        if self.sparse is not None and self._hybrid_wait(request, num_computed_tokens):
            return None, False  # resident requests give blocks back at the end of this step
        count, load_async = self.decode.num_new_matched_tokens(request, num_computed_tokens)
        if count == 0 and self.sparse is not None:
            # a resumed preempted request, or one prefilled here from cached prefix blocks
            resumed = self.sparse.resume_offer(request, num_computed_tokens)
            return resumed or self.sparse.prefix_offer(request, num_computed_tokens), False
        return count, load_async

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self.sparse is not None and self.sparse.after_alloc(request, num_external_tokens):
            return  # a resumed preempted request: its stash loads, nothing is pulled
        params = request.kv_transfer_params
        if not params:
            return
        if self.decode is not None and wants_remote_prefill(params):
            ids: list[int] = []
            if num_external_tokens > 0:
                # All of the request's blocks; before the manager is bound, this allocation's.
                found = self._block_ids(request.request_id)
                ids = found if found is not None else list(blocks.get_block_ids()[0])
            sparse = self.sparse
            hits: list[object] = []

            def cached(blocks: Sequence[int]) -> PrefixHit | None:
                assert sparse is not None
                hit = sparse.recv_hit(request.request_id, blocks)
                hits.append(hit)
                return hit

            self.decode.after_alloc(
                request, ids, num_external_tokens, cached=None if sparse is None else cached
            )
            book = self.hybrid
            rid = request.request_id
            if book is not None and rid in self.decode.receiving:
                if any(h is not None for h in hits):  # its cached blocks' rows are the pool's
                    book.forgo(rid)
                else:  # placed now (pinned), so the workers land its prompt in its rows
                    book.place(rid, request.num_prompt_tokens, pinned=True)
        elif self.prefill is not None and wants_remote_decode(params):
            self.prefill.after_alloc(request, params)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> RemoteD2HMetadata:
        meta = RemoteD2HMetadata()
        if self.decode is not None:
            step = self.decode.take_step()
            meta.recv, meta.fail_recv, meta.cancel_recv = step.recv, step.fail, step.cancel
            meta.idle = not any(scheduler_output.num_scheduled_tokens.values())
        if self.sparse is not None:
            meta.sparse = self.sparse.build_meta(scheduler_output)
            book = self.hybrid
            if book is not None:  # attached by the workers this step: may move from now on
                for r in scheduler_output.scheduled_new_reqs:
                    book.unpin(r.req_id)
        if self.prefill is not None:
            for job in self.prefill.take_sends(scheduler_output.num_scheduled_tokens, self._block_ids):
                if isinstance(job, SendJob):
                    meta.send.append(job)
                else:
                    meta.late_send.append(job)
            self.prefill.end_step(idle=not any(scheduler_output.num_scheduled_tokens.values()))
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Delay freeing while decode still pulls into the blocks or reads from them."""
        rid = request.request_id
        reading = self.prefill.request_finished(rid) if self.prefill is not None else False
        pulling = self.decode.request_finished(rid) if self.decode is not None else False
        error = self.prefill.take_error(rid) if self.prefill is not None else None
        if self.sparse is not None:
            if pulling:  # a read may still write its pool rows: the worker frees them once stopped
                self._ledger_after_pull.add(rid)
            else:
                self.sparse.finished(rid, request, block_ids)
        return pulling or reading, error

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        recved = connector_output.finished_recving or ()
        sent = connector_output.finished_sending or ()
        if self.decode is not None:
            self.decode.workers_done(recved)
            self.decode.workers_done(sent)  # a cancelled pull reports "sent"
        if self.sparse is not None:
            for rid in self._ledger_after_pull & set(sent):
                self._ledger_after_pull.discard(rid)
                self.sparse.finished(rid)
        if self.prefill is not None:
            self.prefill.workers_done(sent)

    def shutdown(self) -> None:
        if self.decode is not None:
            self.decode.close()
        if self.prefill is not None:
            self.prefill.close()
