"""What the P/D producer needs of a layer-sharing pipeline (the reuse-gate seam).

With layer sharing on a prefill the physical buffer of a layer is rewritten by
a later layer within the same forward, while decode reads it. The producer
therefore registers decode's reads as consumers of the buffer's reuse-gate
slot. These protocols name exactly what it and ``AscendMultiConnector`` use,
so the store's pipeline (``ascend_offload.layerwise.pipeline.LayerwisePipeline``
with its ``ReuseGate``) can change freely behind them; tests drive the seam
with a small stand-in and check that the real pipeline still conforms
(``isinstance`` works: the protocols are runtime-checkable).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

# listener(layer, gate_slot, generation), called inside save_layer before the slot is handed on
SaveListener = Callable[[str, int, int], None]


@runtime_checkable
class ReadGate(Protocol):
    """The reuse gate as a reader of a slot sees it. Tokens are opaque to the reader."""

    def outwait(self, deadline_s: float, margin_s: float = ...) -> None:
        """Writers wait at least ``deadline_s`` (+ margin) before giving up on a slot."""

    def add_consumer(self, slot: int, generation: int, name: str) -> Any:
        """Hold ``slot`` at ``generation`` for one reader; returns its token."""

    def release_consumer(self, token: Any, error: BaseException | None = None) -> bool:
        """The reader of ``token`` finished (``error`` if it failed)."""


@runtime_checkable
class SlotSharing(Protocol):
    """A pipeline whose layers share physical buffers, seen by a sibling that reads them."""

    @property
    def gate(self) -> ReadGate: ...

    def add_save_listener(self, listener: SaveListener) -> None:
        """Call ``listener`` in every save of a layer, before its slot is handed on."""

    def members_of(self, layer: str) -> tuple[str, ...]:
        """The layers saved and handed on together with ``layer``."""

    def failed_requests_at_or_before(self, layer: str) -> frozenset[str] | None:
        """The requests whose store load of this step failed at ``layer`` or before: their
        KV of it is wrong (empty: none; None: every request of the step)."""


@runtime_checkable
class LayerPlan(Protocol):
    @property
    def num_logical(self) -> int: ...
    @property
    def num_physical(self) -> int: ...


@runtime_checkable
class SharedStepPipeline(SlotSharing, Protocol):
    """What ``AscendMultiConnector`` also drives: taking the next layer's slot only after
    the producer published (``defer_next_ready`` + ``ready_next`` within a step)."""

    defer_next_ready: bool

    @property
    def plan(self) -> LayerPlan: ...

    @property
    def in_step(self) -> bool: ...

    def ready_next(self, layer: str) -> None:
        """Own the slot of the layer after ``layer`` and fill it."""
