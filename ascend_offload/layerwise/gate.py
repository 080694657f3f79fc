"""Per-physical-slot reuse gate (invariant I1).

Several logical layers alias one physical device buffer ("slot"). Before a
writer (a store load or the layer's own attention) puts new contents into a
slot, every consumer of the slot's *current* contents must have finished: the
store save of the previous layer now, the decode node's remote reads later (the
P/D producer releases its consumers when READ_DONE / READ_FAILED arrives).

Why per slot and not per layer name: the layers of one slot share addresses, so
"layer 3's save finished" says nothing about layer 7's, but both guard the same
bytes. Contents are versioned by a per-slot generation: a consumer registers
against one generation, and a consumer of an old generation is refused (its
bytes are gone) instead of silently reading the new layer.

A consumer whose work runs on an ordered copy queue (the pipeline's store save,
see transfer/copy_queue.py) is registered ``queued``: a writer whose own work
goes onto the same queue after it (a store load) may be granted the slot while
such consumers are outstanding (``acquire_write(behind_queued=True)``), because
the queue runs the consumer's copy first - the writer still waits for them, in
the queue instead of on a thread. Every other writer (the layer's own attention)
waits until they are released; ``pump`` lets that waiting thread finish the
queued consumers it is itself responsible for releasing.

Every wait has a deadline that becomes :class:`GateTimeout`, naming slot, layer
and the consumers still outstanding (invariant I5). Consumers can be expired
(fenced) after such a failure: their late release is ignored and
:meth:`ReuseGate.is_current` tells a late reader that the bytes are no longer
its own. Thread-safe; one condition variable, because slots are few and waits
are rare compared with the work they guard.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable

from ascend_offload.errors import AscendOffloadError


class GateError(AscendOffloadError, RuntimeError):
    """The gate was used against its protocol (wrong slot, stale generation, double write)."""


class GateTimeout(AscendOffloadError, TimeoutError):
    """A writer waited past its deadline for a slot's consumers (or writer) to finish."""

    def __init__(self, slot: int, layer: str, waited_s: float, pending: list[str]) -> None:
        self.slot = slot
        self.layer = layer
        self.waited_s = waited_s
        self.pending = pending
        super().__init__(
            f"reuse gate: layer {layer!r} waited {waited_s:.3f}s for physical slot {slot}, "
            f"still in use by {pending or ['<nothing>']}"
        )


class StaleGeneration(GateError):
    """A consumer asked for contents that a later writer already replaced."""


@dataclasses.dataclass(frozen=True)
class WriteLease:
    """Exclusive right to fill ``slot`` with ``layer``'s contents (generation ``generation``)."""

    slot: int
    generation: int
    layer: str


@dataclasses.dataclass(frozen=True)
class ConsumerToken:
    """One registered reader of ``slot``'s contents at ``generation``."""

    slot: int
    generation: int
    name: str
    id: int
    queued: bool = False  # its work is on an ordered copy queue (see the module doc)


@dataclasses.dataclass
class GateStats:
    """Exact counters (tests and metrics assert on them)."""

    writes: int = 0  # leases granted
    waits: int = 0  # leases that found the slot busy and had to block
    queued_waits: int = 0  # leases granted behind queued consumers (they wait in the queue)
    wait_s: float = 0.0  # total time blocked
    max_wait_s: float = 0.0
    timeouts: int = 0
    consumers_added: int = 0
    consumers_released: int = 0
    consumers_failed: int = 0  # released with an error (e.g. READ_FAILED)
    consumers_expired: int = 0  # fenced by expire_consumers
    late_releases: int = 0  # release of an expired or unknown consumer (ignored)

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class _Slot:
    generation: int = 0
    layer: str | None = None  # owner of the current contents
    writer: WriteLease | None = None
    consumers: dict[int, ConsumerToken] = dataclasses.field(default_factory=dict)
    waits: int = 0


class ReuseGate:
    """Writers wait until a slot has no writer and no consumer; see the module doc."""

    def __init__(
        self,
        num_slots: int,
        *,
        default_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots}: must be >= 1")
        if default_timeout_s <= 0:
            raise ValueError(f"default_timeout_s={default_timeout_s}: must be > 0")
        self._slots = [_Slot() for _ in range(num_slots)]
        self._default_timeout_s = default_timeout_s
        self._clock = clock
        self._cv = threading.Condition()
        self._ids = itertools.count(1)
        self._stats = GateStats()

    @property
    def default_timeout_s(self) -> float:
        return self._default_timeout_s

    def outwait(self, deadline_s: float, margin_s: float = 5.0) -> None:
        """Make writers wait at least ``deadline_s + margin_s`` for a slot. Why: a consumer
        that is guaranteed to release by its own deadline (the P/D producer releases on
        ack or ack timeout) must not make a writer time out first, which would fail the
        forward instead of just that transfer."""
        with self._cv:
            self._default_timeout_s = max(self._default_timeout_s, deadline_s + margin_s)

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def _slot(self, slot: int) -> _Slot:
        if not 0 <= slot < len(self._slots):
            raise GateError(f"slot {slot} out of range [0, {len(self._slots)})")
        return self._slots[slot]

    @staticmethod
    def _busy(s: _Slot, behind_queued: bool = False) -> bool:
        if s.writer is not None:
            return True
        if behind_queued:
            return any(not c.queued for c in s.consumers.values())
        return bool(s.consumers)

    @staticmethod
    def _pending(s: _Slot) -> list[str]:
        out = [f"writer {s.writer.layer!r}"] if s.writer is not None else []
        out += [f"{c.name} (layer {s.layer!r})" for c in s.consumers.values()]
        return out

    def _grant(self, s: _Slot, slot: int, layer: str, behind_queued: bool = False) -> WriteLease:
        if behind_queued and s.consumers:
            self._stats.queued_waits += 1
        s.generation += 1
        s.layer = layer
        s.writer = WriteLease(slot, s.generation, layer)
        self._stats.writes += 1
        return s.writer

    # ------------------------------------------------------------------ writers

    def acquire_write(self, slot: int, layer: str, timeout_s: float | None = None, *,
                      behind_queued: bool = False,
                      pump: Callable[[float], bool] | None = None) -> WriteLease:
        """Block until ``slot`` is free, then own it for ``layer``; :class:`GateTimeout` on deadline.

        ``behind_queued``: the writer's work goes onto the ordered queue of the slot's
        queued consumers, so only a writer and the other consumers make it wait.
        ``pump(seconds_left)`` is called (without the gate's lock) while the slot is
        busy: it may block up to that long to finish and release consumers, and returns
        False when it has nothing to finish (then the gate waits for others' releases).
        """
        timeout = self._default_timeout_s if timeout_s is None else timeout_s
        with self._cv:
            s = self._slot(slot)
            if not self._busy(s, behind_queued):
                return self._grant(s, slot, layer, behind_queued)
            start = self._clock()
            deadline = start + timeout
            s.waits += 1
            self._stats.waits += 1
        try:
            while True:
                with self._cv:
                    if not self._busy(s, behind_queued):
                        return self._grant(s, slot, layer, behind_queued)
                    left = deadline - self._clock()
                    if left <= 0:
                        self._stats.timeouts += 1
                        raise GateTimeout(slot, layer, self._clock() - start, self._pending(s))
                    if pump is None:
                        self._cv.wait(left)
                        continue
                if not pump(left):
                    with self._cv:
                        if self._busy(s, behind_queued):
                            self._cv.wait(max(0.0, min(left, deadline - self._clock())))
        finally:
            with self._cv:
                waited = self._clock() - start
                self._stats.wait_s += waited
                self._stats.max_wait_s = max(self._stats.max_wait_s, waited)

    def try_acquire_write(self, slot: int, layer: str, *,
                          behind_queued: bool = False) -> WriteLease | None:
        """Own ``slot`` for ``layer`` if it is free right now (prefetch), else ``None``."""
        with self._cv:
            s = self._slot(slot)
            return None if self._busy(s, behind_queued) else self._grant(s, slot, layer,
                                                                         behind_queued)

    def release_write(self, lease: WriteLease) -> None:
        """The writer is done; consumers added before this keep the slot busy."""
        with self._cv:
            s = self._slot(lease.slot)
            if s.writer != lease:
                raise GateError(f"release_write of {lease} but slot holds writer {s.writer}")
            s.writer = None
            self._cv.notify_all()

    # ---------------------------------------------------------------- consumers

    def add_consumer(self, slot: int, generation: int, name: str, *,
                     queued: bool = False) -> ConsumerToken:
        """Register a reader of ``slot`` at ``generation``; :class:`StaleGeneration` if replaced.
        ``queued``: its read is on an ordered copy queue (see the module doc)."""
        with self._cv:
            s = self._slot(slot)
            if generation != s.generation:
                raise StaleGeneration(
                    f"consumer {name!r} of slot {slot} generation {generation}: the slot now holds "
                    f"generation {s.generation} (layer {s.layer!r})"
                )
            tok = ConsumerToken(slot, generation, name, next(self._ids), queued)
            s.consumers[tok.id] = tok
            self._stats.consumers_added += 1
            return tok

    def release_consumer(self, token: ConsumerToken, error: BaseException | None = None) -> bool:
        """The consumer finished (``error`` if it failed). False if it was expired or unknown."""
        with self._cv:
            s = self._slot(token.slot)
            if s.consumers.pop(token.id, None) is None:
                self._stats.late_releases += 1
                return False
            self._stats.consumers_released += 1
            if error is not None:
                self._stats.consumers_failed += 1
            self._cv.notify_all()
            return True

    def expire_consumers(self, slot: int) -> list[ConsumerToken]:
        """Fence every outstanding consumer of ``slot`` (after a timeout): the slot may be reused."""
        with self._cv:
            s = self._slot(slot)
            gone = list(s.consumers.values())
            s.consumers.clear()
            self._stats.consumers_expired += len(gone)
            self._cv.notify_all()
            return gone

    def is_current(self, token: ConsumerToken) -> bool:
        """True while ``token``'s bytes are still in the slot and it is registered."""
        with self._cv:
            s = self._slot(token.slot)
            return token.id in s.consumers and s.generation == token.generation

    # ------------------------------------------------------------------ queries

    def is_free(self, slot: int) -> bool:
        with self._cv:
            return not self._busy(self._slot(slot))

    def consumers_held(self) -> int:
        """Consumers currently holding any slot (0 when idle: a leak check and a gauge)."""
        with self._cv:
            return sum(len(s.consumers) for s in self._slots)

    def pending(self, slot: int) -> list[str]:
        with self._cv:
            return self._pending(self._slot(slot))

    def generation(self, slot: int) -> int:
        with self._cv:
            return self._slot(slot).generation

    def owner(self, slot: int) -> str | None:
        """The layer whose contents the slot holds (or is being filled with)."""
        with self._cv:
            return self._slot(slot).layer

    def slot_waits(self, slot: int) -> int:
        with self._cv:
            return self._slot(slot).waits

    def wait_consumers(self, timeout_s: float | None = None, slots: list[int] | None = None) -> None:
        """Block until the given (default all) slots have no consumers; GateTimeout on deadline."""
        timeout = self._default_timeout_s if timeout_s is None else timeout_s
        idx = list(range(len(self._slots))) if slots is None else slots
        with self._cv:
            start = self._clock()
            deadline = start + timeout
            while True:
                busy = [i for i in idx if self._slot(i).consumers]
                if not busy:
                    return
                left = deadline - self._clock()
                if left <= 0:
                    self._stats.timeouts += 1
                    s = self._slots[busy[0]]
                    raise GateTimeout(busy[0], "<drain>", self._clock() - start, self._pending(s))
                self._cv.wait(left)

    def stats(self) -> GateStats:
        with self._cv:
            return dataclasses.replace(self._stats)
