"""Scheduler-side ledger of the host pool: admit a request only when its rows exist.

Why: with sparse decode offload the device holds no main KV, so a request the
pool cannot hold has nowhere to attend. vLLM's scheduler counts only device
blocks (here: indexer blocks), so the connector's scheduler side keeps this
mirror of the workers' pools: the same number of blocks (computed from the same
config), the same reservation per request (``ceil(tokens / block_size)``
blocks, reserved once, released when vLLM finishes the request). A request that
does not fit waits (vLLM retries it next step) instead of failing later. Block
*ids* are the workers' business; only counts must agree.
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
        self.waits = 0  # reservations refused for lack of rows (requests kept waiting)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def fits_ever(self, tokens: int) -> bool:
        return self.blocks_for(tokens) <= self.num_blocks

    def reserve(self, req_id: str, tokens: int) -> bool:
        """Hold ``tokens`` rows for ``req_id`` (idempotent); ``False`` if they do not fit now."""
        if req_id in self._held:
            return True
        need = self.blocks_for(tokens)
        if need > self.num_blocks - self._used:
            self.waits += 1
            return False
        self._held[req_id] = need
        self._used += need
        return True

    def release(self, req_id: str) -> None:
        self._used -= self._held.pop(req_id, 0)

    def holds(self, req_id: str) -> bool:
        return req_id in self._held

    @property
    def free_blocks(self) -> int:
        return self.num_blocks - self._used

    @property
    def requests(self) -> int:
        return len(self._held)
