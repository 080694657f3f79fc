"""P/D rank processes for the integration tests: the bench's ranks plus what a test inspects.

:class:`RankConfig` extends the bench's config (``ascend_offload/bench/pd_ranks.py``)
with a manual clock (deadlines move only on ``advance`` RPCs, so a test decides
when they pass) and the control plane's shared secret; its :meth:`RankConfig.build`
makes ranks with the RPCs tests need (``publish`` of chosen requests, slot
releases, pending slots, decoded blocks, active requests). The spawned process
unpickles the config and so imports this module: the repository root is on its
``sys.path`` as on the parent's.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ascend_offload.bench import pd_ranks as bench
from ascend_offload.bench.pd_ranks import KVShape, RankError, RankProcess, start_ranks

__all__ = ["KVShape", "RankConfig", "RankError", "RankProcess", "expected_blocks", "start_ranks"]


class RankClock:
    """A rank's clock: ``time.monotonic`` or, with ``manual_clock``, moved by ``advance``."""

    def __init__(self, manual: bool) -> None:
        self.manual = manual
        self._offset = 0.0
        self._frozen = time.monotonic()
        self._lock = threading.Lock()

    def __call__(self) -> float:
        if not self.manual:
            return time.monotonic()
        with self._lock:
            return self._frozen + self._offset

    def advance(self, seconds: float) -> None:
        if not self.manual:
            raise RankError("advance needs RankConfig(manual_clock=True)")
        with self._lock:
            self._offset += seconds


@dataclass
class RankConfig(bench.RankConfig):
    # deadlines move only on ``advance`` RPCs, so a test decides when they pass
    manual_clock: bool = False
    secret_path: str = ""  # the control plane's CURVE secret file ("" = no authentication)

    def build(self) -> PrefillTestRank | DecodeTestRank:
        return PrefillTestRank(self) if self.role == "prefill" else DecodeTestRank(self)


class PrefillTestRank(bench.PrefillRank):
    """The bench's prefill rank, with a manual clock, slot releases and per-request publish."""

    def __init__(self, cfg: RankConfig) -> None:
        from ascend_offload.pd.auth import load_keys

        self.clock = RankClock(cfg.manual_clock)
        self.releases: list[Any] = []
        super().__init__(cfg, clock=self.clock, keys=load_keys(cfg.secret_path), listener=self.releases.append)

    def publish(self, layer: int, rids: list[str] | None = None) -> int:
        return self.producer.publish_layer(layer, request_ids=rids)

    def drain_releases(self) -> list[tuple[int, int, bool, tuple[tuple[str, str], ...]]]:
        out, self.releases[:] = list(self.releases), []
        return [(r.slot, r.generation, r.ok, r.failures) for r in out]

    def pending_slots(self) -> dict[int, int]:
        return self.producer.pending_slots()

    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)


class DecodeTestRank(bench.DecodeRank):
    """The bench's decode rank, with a manual clock and reads of its blocks and requests."""

    def __init__(self, cfg: RankConfig) -> None:
        from ascend_offload.pd.auth import load_keys

        self.clock = RankClock(cfg.manual_clock)
        super().__init__(cfg, clock=self.clock, keys=load_keys(cfg.secret_path))

    def blocks(self, dst_blocks: list[int]) -> list[tuple[np.ndarray, np.ndarray | None]]:
        return [(kv[:, dst_blocks].copy(), idx[dst_blocks].copy() if idx is not None else None)
                for kv, idx in self.arrays]

    def active(self) -> list[str]:
        return self.consumer.active()

    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)


def expected_blocks(shape: KVShape, seed: int, src_blocks: list[int]) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """What decode blocks filled from prefill blocks ``src_blocks`` must hold, per layer."""
    return [(kv[:, src_blocks].copy(), idx[src_blocks].copy() if idx is not None else None)
            for kv, idx in shape.arrays(seed)]
