"""Scheduler-side ledger of the host pool: admit a request only when its rows exist.

Why: with sparse decode offload the device holds no main KV, so a request the
pool cannot hold has nowhere to attend. vLLM's scheduler counts only device
blocks (here: indexer blocks), so the connector's scheduler side keeps this
mirror of the workers' pools: the same number of blocks (computed from the same
config), the same reservation per request (``ceil(tokens / block_size)``
blocks, reserved once, released when vLLM finishes the request). A request that
does not fit waits (vLLM retries it next step) instead of failing later. Block
*ids* are the workers' business; only counts must agree.

With the decode-side prefix cache (:mod:`.prefix_cache`) some blocks are held by
cache entries instead of requests: a request that starts from cached blocks
reserves only the rest (``shared``), a finished request hands the blocks it keeps
to the cache (:meth:`PoolLedger.to_cache`), and an evicted entry frees its block
(:meth:`PoolLedger.uncache`).
"""

from __future__ import annotations


class PoolLedger:
    """Block counts of one host pool, per request."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks={num_blocks}, block_size={block_size}: must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._held: dict[str, int] = {}
        self._used = 0
        self.cached = 0  # blocks held by prefix cache entries
        self.waits = 0  # reservations refused for lack of rows (requests kept waiting)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def fits_ever(self, tokens: int) -> bool:
        return self.blocks_for(tokens) <= self.num_blocks

    def reserve(self, req_id: str, tokens: int, shared: int = 0) -> bool:
        """Hold ``tokens`` rows for ``req_id`` (idempotent), the first ``shared`` blocks
        being cache entries' (not taken here); ``False`` if they do not fit now."""
        if req_id in self._held:
            return True
        need = self.blocks_for(tokens) - shared
        if need < 0:
            raise ValueError(f"request {req_id!r}: {shared} shared blocks of {tokens} tokens")
        if need > self.free_blocks:
            self.waits += 1
            return False
        self._held[req_id] = need
        self._used += need
        return True

    def release(self, req_id: str) -> None:
        self._used -= self._held.pop(req_id, 0)

    def grow(self, req_id: str, blocks: int) -> None:
        """The request needs ``blocks`` more of its own than reserved (vLLM took fewer
        cached blocks than offered); counted even past the pool: the worker takes them."""
        self._held[req_id] = self._held.get(req_id, 0) + blocks
        self._used += blocks

    def to_cache(self, req_id: str, blocks: int) -> None:
        """``blocks`` of the request's own blocks are kept by the prefix cache (before it
        is released: they stay used, counted as the cache's)."""
        held = self._held.get(req_id, 0)
        if blocks > held:
            raise ValueError(f"request {req_id!r}: {blocks} blocks to cache, {held} held")
        if blocks:
            self._held[req_id] = held - blocks
            self._used -= blocks
            self.cached += blocks

    def uncache(self, blocks: int) -> None:
        """Prefix cache entries evicted: their blocks are free."""
        if blocks > self.cached:
            raise ValueError(f"{blocks} cached blocks to free, {self.cached} cached")
        self.cached -= blocks

    def holds(self, req_id: str) -> bool:
        return req_id in self._held

    @property
    def free_blocks(self) -> int:
        return self.num_blocks - self._used - self.cached

    @property
    def requests(self) -> int:
        return len(self._held)
