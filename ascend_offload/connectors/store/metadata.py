"""Messages between the store connector's scheduler and its worker ranks.

Scheduler -> workers once per step (``build_connector_meta``): copy jobs
(whole-prefix mode) or the step's block keys and their pages (layerwise mode).
Workers -> scheduler (``build_connector_worker_meta``): per-step completions,
which vLLM sums across ranks so the scheduler can tell when all ranks reported.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from ascend_offload.layerwise.steps import StepIO
from ascend_offload.store.book.prefix_jobs import CopyJob
from ascend_offload.store.shared.remote_fetch import FetchJob
from ascend_offload.store.ssd.jobs import PromoteJob, SpillJob

__all__ = ["CopyJob", "FetchJob", "LayerwiseMetadata", "StoreConnectorMetadata", "StoreWorkerMetadata"]


@dataclasses.dataclass
class StoreConnectorMetadata(KVConnectorMetadata):
    """Whole-prefix mode: this step's loads (before the forward) and saves (after it)."""

    loads: list[CopyJob] = dataclasses.field(default_factory=list)
    saves: list[CopyJob] = dataclasses.field(default_factory=list)
    # shared tier (backend "mooncake"): blocks to fetch into pages (before the loads),
    # and whether the ranks publish this step's saves (the scheduler saw the master up)
    fetches: list[FetchJob] = dataclasses.field(default_factory=list)
    publish: bool = False
    # SSD tier (local.ssd): slots to write from committed pages (behind, on a writer
    # thread) and slots to read into reserved pages (before the loads)
    ssd_spills: list[SpillJob] = dataclasses.field(default_factory=list)
    ssd_promotes: list[PromoteJob] = dataclasses.field(default_factory=list)
    # the store's epoch (``reset_cache`` increments it): the ranks echo it in their
    # reports, and reports of an older epoch never commit into the reset index
    epoch: int = 0
    preempted: int = 0  # requests vLLM preempted this step (the worker's fence checks)


@dataclasses.dataclass
class LayerwiseMetadata(KVConnectorMetadata):
    """Layerwise mode: what the step moves (block keys) and where each block lives."""

    io: StepIO
    pages: dict[str, int]  # block key -> page, for every block of ``io``
    save_blocks: list[str]  # blocks newly placed for saving this step
    freed: list[str]  # block keys whose pages were freed since the last step
    fetches: list[FetchJob] = dataclasses.field(default_factory=list)  # as StoreConnectorMetadata
    publish: bool = False  # publish this step's saved full blocks to the shared tier
    epoch: int = 0  # as StoreConnectorMetadata
    preempted: int = 0  # as StoreConnectorMetadata


@dataclasses.dataclass
class StoreWorkerMetadata(KVConnectorWorkerMetadata):
    """Per-step completions of one or more ranks: job id (whole-prefix mode) or block key
    (layerwise mode) -> number of ranks; fetch job id -> ranks for shared-tier fetches
    (``fetch_unsafe``: failed ranks whose transfer may still write the pages)."""

    done: Counter[Any] = dataclasses.field(default_factory=Counter)
    failed: Counter[Any] = dataclasses.field(default_factory=Counter)
    fetched: Counter[int] = dataclasses.field(default_factory=Counter)
    fetch_failed: Counter[int] = dataclasses.field(default_factory=Counter)
    fetch_unsafe: Counter[int] = dataclasses.field(default_factory=Counter)
    # SSD tier: spill job id -> ranks written / failed; (promote job id, leading blocks that
    # arrived whole) -> ranks; block key -> ranks whose slot failed verification
    ssd_spilled: Counter[int] = dataclasses.field(default_factory=Counter)
    ssd_spill_failed: Counter[int] = dataclasses.field(default_factory=Counter)
    ssd_promoted: Counter[tuple[int, int]] = dataclasses.field(default_factory=Counter)
    ssd_corrupt: Counter[str] = dataclasses.field(default_factory=Counter)
    # shared tier: a publish past its deadline may still read the saved pages: save job id
    # (whole-prefix) or block key (layerwise) -> ranks holding them, then ranks whose late
    # put ended; fetch job id -> ranks whose late get (reported unsafe) ended
    save_held: Counter[Any] = dataclasses.field(default_factory=Counter)
    save_released: Counter[Any] = dataclasses.field(default_factory=Counter)
    fetch_released: Counter[int] = dataclasses.field(default_factory=Counter)
    epoch: int = 0  # the epoch of the step whose jobs ``done`` / ``failed`` report

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, StoreWorkerMetadata)
        # every rank ran the same step's metadata; should two epochs ever meet, the
        # older one wins, so the whole report is treated as pre-reset (dropped)
        return StoreWorkerMetadata(
            done=self.done + other.done, failed=self.failed + other.failed,
            fetched=self.fetched + other.fetched, fetch_failed=self.fetch_failed + other.fetch_failed,
            fetch_unsafe=self.fetch_unsafe + other.fetch_unsafe, epoch=min(self.epoch, other.epoch),
            ssd_spilled=self.ssd_spilled + other.ssd_spilled,
            ssd_spill_failed=self.ssd_spill_failed + other.ssd_spill_failed,
            ssd_promoted=self.ssd_promoted + other.ssd_promoted,
            ssd_corrupt=self.ssd_corrupt + other.ssd_corrupt,
            save_held=self.save_held + other.save_held,
            save_released=self.save_released + other.save_released,
            fetch_released=self.fetch_released + other.fetch_released,
        )

    def empty(self) -> bool:
        return not (self.done or self.failed or self.fetched or self.fetch_failed or self.ssd_spilled
                    or self.ssd_spill_failed or self.ssd_promoted or self.ssd_corrupt or self.save_held
                    or self.save_released or self.fetch_released)
