"""Preemption of a sparse-decode request without recomputing its history.

Why: with sparse decode offload the main KV of every request lives in the host
pool, and a preempted request keeps its pool rows (its reservation outlives the
preemption). Only the indexer cache lives in vLLM's device blocks, which the
preemption frees. Stashing the request's indexer rows to host before the
blocks are reused, and loading them into the blocks vLLM allocates on
resumption, lets vLLM count the whole history as computed: nothing of the main
KV moves, and no token is recomputed.

Two vLLM-free halves, one per role, driven by the connector's objects:

* :class:`PreemptionBook` (scheduler): one explicit state per preempted request,
  ``RUNNING -> STASHING -> STASHED -> RESUMING -> RUNNING``, or ``LOST`` (the
  request is recomputed) when the stash budget cannot hold it. It decides what
  the workers stash (the metadata of the preempting step) and how many tokens
  vLLM may count as computed on resumption (``get_num_new_matched_tokens``).
* :class:`IndexerStash` (worker): the host copies of the stashed requests'
  indexer blocks, bounded by a byte budget; a request it cannot hold is refused
  (counted), and its resumption loads nothing and reports its blocks as load
  errors, so vLLM recomputes them.

The budget on both sides is the host pool's token capacity: every stashed
request still holds at least as many pool rows as it stashes tokens, so the
stash never holds more indexer rows than the pool holds main-KV rows.

What vLLM does with a stash the worker could not load (:func:`stash_offer_guard`):
the worker reports the resumed request's blocks as load errors. vLLM recomputes them
only with ``kv_load_failure_policy: recompute``; its default, ``fail``, fails the
user's request, and with several KV cache groups vLLM raises on any block-level load
error whatever the policy. So the scheduler side sets ``recompute`` at startup (the
only loads of a sparse decode engine's stash), and never offers a stash to an engine
with several KV cache groups (every preempted request is recomputed there).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ascend_offload import device as dev

logger = logging.getLogger(__name__)


class PreemptState(enum.Enum):
    RUNNING = "running"  # scheduled by vLLM (or never preempted)
    STASHING = "stashing"  # preempted this step: the workers stash before the forward
    STASHED = "stashed"  # its indexer rows are on the host; waiting for resumption
    RESUMING = "resuming"  # vLLM allocated blocks and counts the stashed tokens as computed
    LOST = "lost"  # preempted without a stash: resumption recomputes it


@dataclasses.dataclass(frozen=True)
class StashOrder:
    """Scheduler -> workers, in the step that preempts the request: copy the indexer
    rows of positions ``[0, tokens)`` out of ``blocks`` (block ids per KV cache group,
    the request's blocks before the preemption freed them). ``tokens == 0``: nothing
    to stash (the request will be recomputed)."""

    tokens: int
    blocks: tuple[tuple[int, ...], ...]


@dataclasses.dataclass(frozen=True)
class ResumeOrder:
    """Scheduler -> workers, in the step that resumes the request: load the stashed
    rows of positions ``[0, tokens)`` into ``blocks`` (its new block ids per group)
    before the forward. ``tokens == 0``: recomputed, nothing to load."""

    tokens: int
    blocks: tuple[tuple[int, ...], ...]


def stash_offer_guard(num_kv_cache_groups: int) -> str | None:
    """Why vLLM cannot take a stash offer safely (None: it can). A stash the worker could
    not hold or load comes back as block-level load errors (``invalid_block_ids``), which
    vLLM 0.32 refuses with a RuntimeError for models of several KV cache groups (block
    ids are unique only within a group) - an engine failure, whatever
    ``kv_load_failure_policy`` says."""
    if num_kv_cache_groups > 1:
        return (f"the engine has {num_kv_cache_groups} KV cache groups, and vLLM fails the engine "
                "on a block-level load error then")
    return None


def set_load_failure_policy(kv_transfer_config: Any, stash_tokens: int) -> None:
    """Startup: a worker that cannot load an offered stash reports its blocks as load
    errors, which vLLM recomputes only under ``kv_load_failure_policy: recompute`` (its
    default ``fail`` fails the user's request). With a stash budget the policy is set to
    ``recompute`` (logged when changed); vLLM's scheduler reads it after it created the
    connector, so the setting takes effect."""
    if stash_tokens <= 0 or kv_transfer_config is None:
        return
    policy = getattr(kv_transfer_config, "kv_load_failure_policy", "fail")
    if policy == "recompute":
        return
    kv_transfer_config.kv_load_failure_policy = "recompute"
    logger.warning("sparse decode: key 'kv_load_failure_policy'=%r set to 'recompute': a "
                   "preempted request's stash that a worker could not hold or load is reported as "
                   "load errors, which %r would turn into a failed request", policy, policy)


class PreemptionBook:
    """Scheduler side: the per-request preemption state and the stash budget (tokens)."""

    def __init__(self, capacity_tokens: int, block_size: int) -> None:
        if capacity_tokens < 0 or block_size <= 0:
            raise ValueError(f"capacity_tokens={capacity_tokens}, block_size={block_size}")
        self.block_size = block_size
        self.capacity_blocks = capacity_tokens // block_size
        self._used = 0  # stash blocks held by STASHING / STASHED / RESUMING requests
        self._state: dict[str, PreemptState] = {}  # requests not RUNNING
        self._tokens: dict[str, int] = {}  # stashed tokens (and loaded on resumption)
        self._held: dict[str, int] = {}  # stash blocks each request holds of the budget
        # running requests: tokens computed once the last scheduled step ran, and blocks
        self._progress: dict[str, tuple[int, Sequence[Sequence[int]]]] = {}
        self.stashed_requests = 0
        self.lost_requests = 0
        #: why stashes are not offered at all (every preempted request is recomputed)
        self.refused: str | None = None

    def refuse(self, why: str) -> None:
        """Stop stashing (and so offering) from now on: every preempted request is
        ``LOST`` and recomputed (logged once)."""
        if self.refused is None:
            self.refused = why
            logger.warning("sparse decode: preempted requests are recomputed, not resumed from "
                           "the stash: %s", why)

    def state(self, req_id: str) -> PreemptState:
        return self._state.get(req_id, PreemptState.RUNNING)

    @property
    def used_tokens(self) -> int:
        return self._used * self.block_size

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # ------------------------------------------------------------------ steps

    def scheduled(self, req_id: str, computed_after_step: int,
                  blocks: Sequence[Sequence[int]]) -> None:
        """vLLM scheduled ``req_id`` this step: after it ran, positions
        ``[0, computed_after_step)`` have KV, in ``blocks`` (per group; kept by
        reference, not copied: the caller hands over lists it no longer changes)."""
        self._progress[req_id] = (computed_after_step, blocks)

    def preempt(self, req_id: str) -> StashOrder:
        """vLLM preempted ``req_id`` (its blocks are freed but not yet overwritten):
        ``STASHING`` with what to stash, or ``LOST`` when nothing is known of it or the
        budget cannot hold it."""
        tokens, blocks = self._progress.pop(req_id, (0, ()))
        self._release(req_id)
        need = self._blocks_for(tokens)
        if tokens <= 0 or self.refused is not None or need > self.capacity_blocks - self._used:
            self._state[req_id] = PreemptState.LOST
            self.lost_requests += 1
            return StashOrder(0, ())
        self._used += need
        self._held[req_id] = need
        self._state[req_id] = PreemptState.STASHING
        self._tokens[req_id] = tokens
        self.stashed_requests += 1
        return StashOrder(tokens, tuple(tuple(b[:need]) for b in blocks))

    def step_built(self) -> None:
        """The metadata carrying this step's stash orders is handed to the workers, who
        run them before this step's forward and before any later step."""
        for rid, st in self._state.items():
            if st is PreemptState.STASHING:
                self._state[rid] = PreemptState.STASHED

    def offer(self, req_id: str, num_tokens: int) -> int:
        """Tokens vLLM may count as computed when it resumes ``req_id`` (a request of
        ``num_tokens`` tokens): the stashed ones, but at least one token is computed."""
        if self.state(req_id) is not PreemptState.STASHED:
            return 0
        return max(0, min(self._tokens[req_id], num_tokens - 1))

    def after_alloc(self, req_id: str, num_external_tokens: int) -> bool:
        """vLLM allocated blocks for a resumed request; ``True`` if it is ours to load.
        A stashed request vLLM resumes without the offered tokens is recomputed."""
        if self.state(req_id) is not PreemptState.STASHED:
            return False
        if num_external_tokens <= 0:
            self._lose(req_id)
            return False
        self._tokens[req_id] = min(self._tokens[req_id], num_external_tokens)
        self._state[req_id] = PreemptState.RESUMING
        return True

    def resumed(self, req_id: str, blocks: Sequence[Sequence[int]]) -> ResumeOrder:
        """vLLM scheduled the preempted ``req_id`` again with new ``blocks`` (per group):
        what the workers load before the forward; the request is ``RUNNING`` again."""
        st = self.state(req_id)
        tokens = self._tokens.get(req_id, 0) if st is PreemptState.RESUMING else 0
        if st is PreemptState.STASHED:  # resumed without asking us: recomputed
            self.lost_requests += 1
        self._release(req_id)
        need = self._blocks_for(tokens)
        return ResumeOrder(tokens, tuple(tuple(b[:need]) for b in blocks) if tokens else ())

    def finish(self, req_id: str) -> None:
        """vLLM finished or aborted ``req_id`` (in any state): forget it, free its stash."""
        self._progress.pop(req_id, None)
        self._release(req_id)

    def _lose(self, req_id: str) -> None:
        self._release(req_id)
        self._state[req_id] = PreemptState.LOST
        self.lost_requests += 1

    def _release(self, req_id: str) -> None:
        self._state.pop(req_id, None)
        self._tokens.pop(req_id, None)
        self._used -= self._held.pop(req_id, 0)

    def __len__(self) -> int:
        """Requests in a preemption state (not RUNNING)."""
        return len(self._state)


# --------------------------------------------------------------------------- worker


@dataclasses.dataclass
class StashCounters:
    preempted_requests: int = 0  # preemptions seen (stashed or not)
    stashed_tokens: int = 0  # tokens whose indexer rows went to host
    resumed_tokens: int = 0  # tokens loaded back on resumption (not recomputed)
    stash_failures: int = 0  # stash orders this worker could not hold (recomputed)
    stash_ns: int = 0  # host time saving and loading stashes (copies finished on return)


class IndexerStash:
    """Worker side: host copies of preempted requests' indexer blocks, bounded in bytes.

    ``caches`` are the engine's indexer caches as block-major tensors (block on dim 0,
    one KV cache group each: ``groups[i]``). A stash of ``n`` blocks holds ``n`` blocks
    of every cache; the budget is ``capacity_tokens`` tokens of every cache.
    """

    def __init__(self, caches: Sequence[torch.Tensor], groups: Sequence[int], block_size: int,
                 capacity_tokens: int,
                 to_host: Callable[[torch.Tensor, Sequence[int]], torch.Tensor] | None = None,
                 from_host: Callable[[torch.Tensor, torch.Tensor, Sequence[int]], None] | None = None
                 ) -> None:
        if len(caches) != len(groups):
            raise ValueError(f"{len(caches)} indexer caches, {len(groups)} groups")
        self.caches = list(caches)
        self.groups = list(groups)
        self.block_size = block_size
        self.block_bytes = sum(c[0].numel() * c.element_size() for c in caches) if caches else 0
        self.capacity_bytes = -(-capacity_tokens // block_size) * self.block_bytes
        stream = dev.new_stream()
        self._to_host = to_host or (lambda kv, ids: dev.blocks_to_host(kv, 0, ids, stream))
        self._from_host = from_host or (lambda rows, kv, ids: dev.blocks_from_host(
            rows, kv, 0, ids, stream))
        self._held: dict[str, tuple[int, list[torch.Tensor]]] = {}  # req -> (tokens, per cache)
        self.bytes_held = 0
        self.counters = StashCounters()

    def holds(self, req_id: str) -> bool:
        return req_id in self._held

    def _ids(self, blocks: Sequence[Sequence[int]], i: int, n: int) -> list[int]:
        ids = list(blocks[self.groups[i]][:n])
        if len(ids) != n:
            raise ValueError(f"{len(ids)} blocks of group {self.groups[i]}, {n} needed")
        return ids

    def save(self, req_id: str, order: StashOrder) -> bool:
        """Copy the order's indexer blocks to host; ``False`` (counted, logged) when the
        budget cannot hold them or the order names too few blocks."""
        self.counters.preempted_requests += 1
        self.drop(req_id)
        if order.tokens <= 0:
            return False
        n = -(-order.tokens // self.block_size)
        nbytes = n * self.block_bytes
        t0 = time.perf_counter_ns()
        try:
            if not self.caches:
                raise ValueError("no indexer cache to stash from")
            if self.bytes_held + nbytes > self.capacity_bytes:
                raise MemoryError(f"{nbytes} B over the stash budget ({self.bytes_held} of "
                                  f"{self.capacity_bytes} B held)")
            rows = [self._to_host(c, self._ids(order.blocks, i, n)) for i, c in enumerate(self.caches)]
        except (MemoryError, ValueError, IndexError, RuntimeError) as exc:
            self.counters.stash_failures += 1
            logger.warning("sparse decode: preempted request %s not stashed (%s): it will be "
                           "recomputed", req_id, exc)
            return False
        self._held[req_id] = (order.tokens, rows)
        self.bytes_held += nbytes
        self.counters.stashed_tokens += order.tokens
        self.counters.stash_ns += time.perf_counter_ns() - t0
        return True

    def load(self, req_id: str, order: ResumeOrder) -> list[int]:
        """Copy the stashed blocks into the order's new blocks and drop the stash; returns
        the block ids that could not be loaded (vLLM recomputes them), ``[]`` on success."""
        n = -(-order.tokens // self.block_size)
        held = self._held.get(req_id)
        t0 = time.perf_counter_ns()
        try:
            if held is None or held[0] < order.tokens:
                raise KeyError(f"{0 if held is None else held[0]} tokens stashed, "
                               f"{order.tokens} to load")
            for i, c in enumerate(self.caches):
                self._from_host(held[1][i][:n], c, self._ids(order.blocks, i, n))
        except (KeyError, ValueError, IndexError, RuntimeError) as exc:
            logger.warning("sparse decode: resumed request %s: stash not loaded (%s): its "
                           "blocks are recomputed", req_id, exc)
            self.drop(req_id)
            return sorted({b for g in order.blocks for b in g[:n]})
        self.drop(req_id)
        self.counters.resumed_tokens += order.tokens
        self.counters.stash_ns += time.perf_counter_ns() - t0
        return []

    def drop(self, req_id: str) -> None:
        held = self._held.pop(req_id, None)
        if held is not None:
            self.bytes_held -= -(-held[0] // self.block_size) * self.block_bytes

    def __len__(self) -> int:
        return len(self._held)


def block_major(caches: Mapping[str, Any], names: Sequence[str], num_blocks: int
                ) -> list[torch.Tensor]:
    """The named caches as tensors with the block index on dim 0 (one view each)."""
    from ascend_offload.kv_layout import block_dim, block_views

    out = []
    for n in names:
        views = block_views(caches[n], block_dim(caches[n], num_blocks))
        if len(views) != 1:
            raise ValueError(f"indexer cache {n}: {len(views)} block-major views, expected one")
        out.append(views[0])
    return out
