"""The decode-side consumer's records: what it tracks per request, per parked item and per read.

Kept apart from :mod:`ascend_offload.pd.consumer` so the reader's control flow reads on its
own; these are plain data with no behaviour.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ascend_offload.pd import protocol as P
from ascend_offload.transfer.base import ReadOp


@dataclass(frozen=True)
class RecvOutcome:
    """A request whose every (layer, contributor) is terminal."""

    request_id: str
    ok: bool
    failed_blocks: tuple[int, ...] = ()  # decode block ids that must not be trusted
    reasons: tuple[str, ...] = ()
    # Only when the indexer has its own destination blocks (host-pool destination):
    # failed_blocks are then main-KV (pool) blocks and these are indexer blocks.
    failed_index_blocks: tuple[int, ...] = ()


class BlockPool(Protocol):
    """What :meth:`Consumer.expect_pool` needs of a host KV pool
    (:class:`~ascend_offload.sparse.pools.HostKVPool`; duck-typed so ``pd`` does not import ``sparse``)."""

    block_size: int

    def admit(self, req_id: str, max_tokens: int, shared: Sequence[int] = ()) -> Any: ...
    def block_table(self, req_id: str) -> Any: ...
    def release(self, req_id: str) -> None: ...


@dataclass
class ConsumerStats:
    items: int = 0
    reads: int = 0
    descriptors: int = 0
    bytes_read: int = 0
    read_retries: int = 0
    failed: int = 0
    rejected: int = 0
    parked: int = 0
    acked_empty: int = 0
    metas_evicted: int = 0
    readers_retired: int = 0


@dataclass
class RequestState:
    request_id: str
    dst_blocks: list[int]
    num_layers: int
    deadline: float
    done: dict[tuple[int, int], bool] = field(default_factory=dict)  # (layer, p_rank) -> ok
    failed: set[int] = field(default_factory=set)
    reasons: list[str] = field(default_factory=list)
    index_blocks: list[int] | None = None  # indexer destination when it differs from dst_blocks
    failed_index: set[int] = field(default_factory=set)
    # Row destination (:meth:`Consumer.expect_rows`): the main KV goes to these runs of
    # per-token rows (``layout.row_runs``), ``dst_blocks`` are the device blocks
    row_runs: list[tuple[int, int, int, int]] | None = None
    inflight: int = 0  # reads submitted to a reader thread and not returned yet
    finished: bool = False


@dataclass
class ParkedItem:
    ident: bytes
    engine_id: str
    p_rank: int
    budget_s: float
    received: float
    item: P.ReadReady


@dataclass
class ReadJob:
    """One item's batched read, handed from the I/O thread to its peer's reader."""

    parked: ParkedItem
    req: RequestState
    endpoint: str
    ops: list[ReadOp]
    budget_end: float  # the read must end by then (else ``late``)


@dataclass
class ReadResult:
    parked: ParkedItem
    req: RequestState
    code: str
    err: str
    descriptors: int
    nbytes: int
    retries: int
