"""Decode-side prefix caching with sparse decode offload.

Why here and not in vLLM's device prefix cache: with sparse offload the device
holds no main KV (only the indexer cache and the hot buffers), so vLLM's own
prefix cache could share indexer blocks whose main-KV rows nobody keeps. The
host pool holds every request's main KV anyway, in reference-counted blocks
(:class:`~ascend_offload.sparse.pools.HostKVPool`), so the cache lives there:

* When a request finishes, each of its full blocks whose hash is not cached yet
  becomes an entry: the pool block is retained (no copy) and the block's indexer
  rows are copied from the device to a host slab (one slot per entry).
* A new request whose leading block hashes are cached is offered those tokens as
  external hits. Its pool table starts with the entries' blocks (shared by
  reference: the rows are stored and counted once) and the entries' indexer rows
  are copied into its new device blocks before the forward; it computes only the
  rest. Its hot buffer starts empty like any new request's, so no hot-buffer state
  passes between requests that share rows.
* Entries in use by a request are pinned; the rest are evicted least recently used
  first when the cache is full or a reservation needs pool blocks.

Two vLLM-free halves, one per role, kept in step by explicit orders (the
scheduler decides, every worker replays them in the same order, as the pool's
deterministic allocation needs):

* :class:`PrefixIndex` (scheduler): block hash -> pins, LRU order, capacity; it
  emits :class:`KeepOrder` / :class:`EvictOrder` for the step's metadata and a
  :class:`PrefixHit` per newly scheduled request that uses entries.
* :class:`PrefixBlocks` (worker): block hash -> (pool block, slab slot), the host
  slab of indexer rows, and the copies.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Sequence

import torch

from ascend_offload import device as dev
from ascend_offload.sparse.pools import HostKVPool

logger = logging.getLogger(__name__)

BlockHash = bytes


@dataclasses.dataclass(frozen=True)
class KeepOrder:
    """Scheduler -> workers: before the finished ``req_id`` releases its pool rows, keep
    its blocks ``entries[i][0]`` (block index in the request) under hash ``entries[i][1]``,
    their indexer rows read from the device blocks ``device_blocks[i]`` (freed by vLLM, not
    reused before this step's forward)."""

    req_id: str
    entries: tuple[tuple[int, BlockHash], ...]
    device_blocks: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class EvictOrder:
    """Scheduler -> workers: drop these entries (pool blocks and slab slots)."""

    hashes: tuple[BlockHash, ...]


PrefixOp = KeepOrder | EvictOrder


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    """Scheduler -> workers, for a newly scheduled request that uses cached entries: its
    table starts with the entries of ``hashes`` (in order), whose indexer rows go into
    its device blocks ``device_blocks`` before the forward."""

    hashes: tuple[BlockHash, ...]
    device_blocks: tuple[int, ...]


class PrefixIndex:
    """Scheduler side: which block hashes are cached, their pins and LRU order."""

    def __init__(self, capacity_blocks: int, block_size: int) -> None:
        if capacity_blocks <= 0 or block_size <= 0:
            raise ValueError(f"capacity_blocks={capacity_blocks}, block_size={block_size}")
        self.capacity = capacity_blocks
        self.block_size = block_size
        self._pins: collections.OrderedDict[BlockHash, int] = collections.OrderedDict()
        self._doomed: set[BlockHash] = set()  # reset while pinned: evicted when unpinned
        self._held: dict[str, tuple[BlockHash, ...]] = {}  # request -> entries it pins
        self._ops: list[PrefixOp] = []
        self.full_skips = 0  # blocks not kept: the cache was full of pinned entries

    def __len__(self) -> int:
        return len(self._pins)

    def __contains__(self, h: object) -> bool:
        return h in self._pins and h not in self._doomed

    def evictable_except(self, protect: Iterable[BlockHash] = ()) -> int:
        """Entries :meth:`evict` could drop now, ``protect`` aside."""
        keep = set(protect)
        return sum(1 for h, n in self._pins.items() if n == 0 and h not in keep)

    # ------------------------------------------------------------------ lookups

    def match(self, hashes: Sequence[BlockHash], num_tokens: int) -> tuple[BlockHash, ...]:
        """The leading cached blocks of a request of ``num_tokens`` tokens with block
        ``hashes``; at most ``(num_tokens - 1) // block_size`` blocks, so at least one
        token is computed and the request never writes a shared block."""
        limit = min(len(hashes), max(0, num_tokens - 1) // self.block_size)
        out: list[BlockHash] = []
        for h in hashes[:limit]:
            if h not in self:
                break
            out.append(h)
        return tuple(out)

    def pin(self, req_id: str, hashes: Sequence[BlockHash]) -> None:
        """``req_id`` uses these entries (its table will share their blocks): not evicted
        until :meth:`unpin`. Touched so the chain's first block is the most recent."""
        if req_id in self._held:
            raise ValueError(f"request {req_id!r} already pins {len(self._held[req_id])} entries")
        if not hashes:
            return
        for h in hashes:
            if h not in self:
                raise KeyError(f"request {req_id!r}: block hash {h.hex()[:16]} is not cached")
            self._pins[h] += 1
        self._touch(hashes)
        self._held[req_id] = tuple(hashes)

    def pinned(self, req_id: str) -> tuple[BlockHash, ...]:
        return self._held.get(req_id, ())

    def unpin(self, req_id: str, keep: int = 0) -> int:
        """Drop ``req_id``'s pins past its first ``keep`` entries (all by default);
        returns the entries evicted because a reset doomed them."""
        held = self._held.pop(req_id, ())
        if keep:
            self._held[req_id] = held[:keep]
        dropped = held[keep:]
        evicted = []
        for h in dropped:
            self._pins[h] -= 1
            if self._pins[h] == 0 and h in self._doomed:
                evicted.append(h)
        self._drop(evicted)
        return len(evicted)

    # ------------------------------------------------------------------ changes

    def evict(self, n: int, protect: Iterable[BlockHash] = ()) -> int:
        """Evict up to ``n`` unpinned entries, least recently used first, never one of
        ``protect``; returns how many."""
        keep = set(protect)
        victims: list[BlockHash] = []
        for h, pins in self._pins.items():
            if len(victims) >= n:
                break
            if pins == 0 and h not in keep:
                victims.append(h)
        self._drop(victims)
        return len(victims)

    def keep(self, req_id: str, hashes: Sequence[BlockHash], device_blocks: Sequence[int]
             ) -> tuple[int, int]:
        """A request finished with full blocks of ``hashes`` (block ``i`` in its device
        block ``device_blocks[i]``): cache those not cached yet, evicting unpinned entries
        when full. Returns ``(kept, evicted)`` (the pool blocks that changed owner from
        the request to the cache, and those freed)."""
        new: list[tuple[int, BlockHash]] = []
        seen: set[BlockHash] = set()
        for i, h in enumerate(hashes[:len(device_blocks)]):
            if h not in self._pins and h not in seen:
                new.append((i, h))
                seen.add(h)
        evicted = 0
        over = len(self._pins) + len(new) - self.capacity
        if over > 0:
            evicted = self.evict(over, protect=seen)
            room = self.capacity - len(self._pins)
            if room < len(new):
                self.full_skips += len(new) - room
                new = new[:room]
        if not new:
            return 0, evicted
        for _, h in new:
            self._pins[h] = 0
        self._touch([h for _, h in new])
        self._ops.append(KeepOrder(req_id, tuple(new), tuple(int(device_blocks[i]) for i, _ in new)))
        return len(new), evicted

    def reset(self) -> int:
        """Forget every entry (``reset_prefix_cache``): unpinned ones are evicted now,
        pinned ones are no longer matched and go when their last user finishes. Returns
        the entries evicted now."""
        self._doomed.update(self._pins)
        victims = [h for h, n in self._pins.items() if n == 0]
        self._drop(victims)
        return len(victims)

    def take_ops(self) -> tuple[PrefixOp, ...]:
        """The orders since the last call, in the order the workers must apply them."""
        ops, self._ops = tuple(self._ops), []
        return ops

    def _touch(self, hashes: Sequence[BlockHash]) -> None:
        for h in reversed(hashes):  # deeper blocks older: a chain is evicted from its tail
            self._pins.move_to_end(h)

    def _drop(self, hashes: Sequence[BlockHash]) -> None:
        if not hashes:
            return
        for h in hashes:
            del self._pins[h]
            self._doomed.discard(h)
        self._ops.append(EvictOrder(tuple(hashes)))


# --------------------------------------------------------------------------- worker


@dataclasses.dataclass
class PrefixBlockCounters:
    kept_blocks: int = 0  # entries created (pool block retained, indexer rows copied)
    loaded_blocks: int = 0  # entry blocks shared into a new request (indexer rows loaded)
    evicted_blocks: int = 0
    load_failures: int = 0  # hit blocks that could not be served (vLLM recomputes them)
    copy_ns: int = 0  # host time of the indexer copies (finished on return)


class PrefixBlocks:
    """Worker side: cache entries as pool blocks plus host copies of their indexer rows.

    ``caches`` are the engine's indexer caches as block-major tensors (block on dim 0),
    the ones the preemption stash copies; the slab holds ``capacity_blocks`` blocks of
    each. ``to_host`` / ``from_host`` are the copies (default: :mod:`ascend_offload.device`'s
    staged block copies on a stream of their own).
    """

    def __init__(self, pool: HostKVPool, caches: Sequence[torch.Tensor], capacity_blocks: int,
                 to_host: Callable[[torch.Tensor, Sequence[int]], torch.Tensor] | None = None,
                 from_host: Callable[[torch.Tensor, torch.Tensor, Sequence[int]], None] | None = None
                 ) -> None:
        if capacity_blocks <= 0 or not caches:
            raise ValueError(f"capacity_blocks={capacity_blocks}, {len(caches)} indexer caches: "
                             "a prefix cache needs both")
        self.pool = pool
        self.caches = list(caches)
        self.capacity = capacity_blocks
        self.slabs = [dev.empty_host((capacity_blocks, *c.shape[1:]), c.dtype) for c in caches]
        self.block_bytes = sum(c[0].numel() * c.element_size() for c in caches)
        stream = dev.new_stream()
        self._to_host = to_host or (lambda kv, ids: dev.blocks_to_host(kv, 0, ids, stream))
        self._from_host = from_host or (lambda rows, kv, ids: dev.blocks_from_host(
            rows, kv, 0, ids, stream))
        self._entries: dict[BlockHash, tuple[int, int]] = {}  # hash -> (pool block, slot)
        self._free_slots = list(range(capacity_blocks))
        self.counters = PrefixBlockCounters()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self.capacity * self.block_bytes

    def apply(self, op: PrefixOp) -> None:
        if isinstance(op, KeepOrder):
            self.keep(op)
        else:
            self.evict(op.hashes)

    def keep(self, order: KeepOrder) -> None:
        """Retain the finished request's blocks and copy their indexer rows to the slab.
        An entry that cannot be made (the request holds no such rows here) is logged and
        left out: a later hit on it is served as a load failure (recomputed)."""
        t0 = time.perf_counter_ns()
        try:
            table = self.pool.block_list(order.req_id)
            blocks = [table[i] for i, _ in order.entries]
        except (KeyError, IndexError) as exc:
            logger.warning("sparse decode prefix cache: finished request %s: %d blocks not kept "
                           "(%s)", order.req_id, len(order.entries), exc)
            return
        if len(self._free_slots) < len(blocks):
            logger.warning("sparse decode prefix cache: %d slots free, %d blocks to keep: the "
                           "scheduler's index and this worker disagree", len(self._free_slots),
                           len(blocks))
            return
        slots = [self._free_slots.pop() for _ in blocks]
        idx = torch.tensor(slots, dtype=torch.long)
        for cache, slab in zip(self.caches, self.slabs, strict=True):
            slab.index_copy_(0, idx, self._to_host(cache, order.device_blocks))
        for (_, h), b, s in zip(order.entries, blocks, slots, strict=True):
            self.pool.retain(b)
            self._entries[h] = (b, s)
        self.counters.kept_blocks += len(blocks)
        self.counters.copy_ns += time.perf_counter_ns() - t0

    def evict(self, hashes: Sequence[BlockHash]) -> None:
        for h in hashes:
            entry = self._entries.pop(h, None)
            if entry is None:
                continue
            block, slot = entry
            self.pool.drop(block)
            self._free_slots.append(slot)
            self.counters.evicted_blocks += 1

    def shared_blocks(self, hit: PrefixHit) -> list[int]:
        """The pool blocks of the hit's leading entries this worker holds (a missing one
        ends the shared run: the rest is the request's own)."""
        out = []
        for h in hit.hashes:
            entry = self._entries.get(h)
            if entry is None:
                break
            out.append(entry[0])
        return out

    def load(self, hit: PrefixHit, shared: int) -> list[int]:
        """Copy the first ``shared`` entries' indexer rows into the hit's device blocks;
        returns the device blocks that could not be served (vLLM recomputes them)."""
        failed = list(hit.device_blocks[shared:])
        if shared:
            t0 = time.perf_counter_ns()
            idx = torch.tensor([self._entries[h][1] for h in hit.hashes[:shared]],
                               dtype=torch.long)
            ids = list(hit.device_blocks[:shared])
            try:
                for cache, slab in zip(self.caches, self.slabs, strict=True):
                    self._from_host(slab.index_select(0, idx), cache, ids)
            except (RuntimeError, IndexError, ValueError) as exc:
                logger.warning("sparse decode prefix cache: %d blocks not loaded (%s): "
                               "recomputed", shared, exc)
                failed = list(hit.device_blocks)
            else:
                self.counters.loaded_blocks += shared
            self.counters.copy_ns += time.perf_counter_ns() - t0
        self.counters.load_failures += len(failed)
        return failed
