"""Layerwise buffer plan: which physical device buffer (slot) holds which logical layer.

Why: on a prefill node, N cache-bearing layers can time-share a few physical KV
buffers, because each layer's KV lives in the host store between uses. This
module is the pure arithmetic of that sharing, separate from vLLM so it is
testable in microseconds and reusable by the CLI, the layout hook and the
pipeline.

Rules (compatible with vllm-ascend's ``layerwise_*`` keys):

* Logical layer order is the base layers, then the MTP layers (MTP layers take
  the indices after the base layers and join the same planning).
* ``independent`` (default ``[0]``; negative indices count from the end;
  ``"all"`` disables sharing) layers each own a buffer.
* Layers are grouped by their compatibility key (equal KV spec); layers of
  different groups never share. A group with I independent and R shared layers
  gets ``I + min(B, R)`` buffers; its shared layers are assigned round-robin.
* Indexer caches ("followers") do not take part in round-robin: each follows its
  main layer, so the follower buffers mirror the main slots one to one.
* The prefetch map names, for every layer, the layer that used its slot just
  before it (cyclically: the first user of a slot in a forward step inherits it
  from the last user of the previous step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Literal

from ascend_offload.config import ConfigError

Independent = Sequence[int] | Literal["all"]

KEY_B = "layerwise_num_shared_buffers"
KEY_I = "layerwise_independent_layers"


class PlanError(ConfigError):
    """The layer list or the layerwise settings cannot be planned.

    ``key`` names the offending setting (``KEY_B``, ``KEY_I``) when there is one,
    so front ends (the CLI) can name their own option instead.
    """

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One cache-bearing layer as the planner sees it.

    ``compat``: layers with equal keys may alias one buffer (use the KV spec).
    ``nbytes``: size of the layer's KV buffer, for the footprint ratio (0 = unknown).
    ``follows``: for an indexer cache, the name of the main layer it belongs to.
    """

    name: str
    compat: Hashable = "kv"
    nbytes: int = 0
    follows: str | None = None
    mtp: bool = False


@dataclasses.dataclass(frozen=True)
class PhysicalBuffer:
    """One device allocation; ``layers`` alias it, in execution order."""

    slot: int
    compat: Hashable
    layers: tuple[str, ...]
    independent: bool
    follows: int | None = None  # main slot, for an indexer buffer
    nbytes: int = 0


@dataclasses.dataclass(frozen=True)
class LayerwisePlan:
    """The result of :func:`plan_layers`; immutable and cheap to query."""

    layers: tuple[str, ...]  # main layers, logical order (base, then MTP)
    followers: tuple[str, ...]  # indexer layers, in the order of their main layers
    buffers: tuple[PhysicalBuffer, ...]
    slot_of: Mapping[str, int]
    gate_slot_of: Mapping[str, int]  # followers gate with their main slot
    main_of: Mapping[str, str]  # follower (indexer) layer -> its main layer
    independent: frozenset[str]
    prev_owner: Mapping[str, str | None]
    num_shared_buffers: int
    sharing: bool

    @property
    def num_logical(self) -> int:
        return len(self.layers) + len(self.followers)

    @property
    def num_physical(self) -> int:
        return len(self.buffers)

    @property
    def num_main_physical(self) -> int:
        return sum(1 for b in self.buffers if b.follows is None)

    def assignment(self) -> list[int]:
        """Physical slot of every main layer, in logical layer order."""
        return [self.slot_of[n] for n in self.layers]

    def footprint_ratio(self) -> float:
        """Device KV bytes with sharing / without (by slot count if sizes are unknown)."""
        by_bytes = all(b.nbytes > 0 for b in self.buffers)
        if by_bytes:
            total = sum(self._layer_bytes.values())
            return sum(b.nbytes for b in self.buffers) / total
        return self.num_physical / self.num_logical

    @property
    def _layer_bytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for b in self.buffers:
            for n in b.layers:
                out[n] = b.nbytes
        return out

    def is_shared(self, layer: str) -> bool:
        """True if ``layer``'s slot is used by more than one layer (KV must round-trip the store)."""
        return len(self.buffers[self.slot_of[layer]].layers) > 1

    def to_json(self) -> dict[str, Any]:
        return {
            "num_logical_layers": len(self.layers),
            "num_follower_layers": len(self.followers),
            "physical_buffers": self.num_physical,
            "num_shared_buffers": self.num_shared_buffers,
            "sharing": self.sharing,
            "independent_layers": [i for i, n in enumerate(self.layers) if n in self.independent],
            "assignment": self.assignment(),
            "follower_assignment": [self.slot_of[n] for n in self.followers],
            "prefetch_from": [
                None if self.prev_owner[n] is None else self.layers.index(self.prev_owner[n])
                for n in self.layers
            ],
            "footprint_ratio": round(self.footprint_ratio(), 6),
        }


def normalize_independent(independent: Independent, n: int) -> list[int]:
    """Resolve ``independent`` to sorted non-negative indices; reject bad values by name."""
    if isinstance(independent, str):
        if independent != "all":
            raise PlanError(
                f"key '{KEY_I}'={independent!r}: not a layer list (accepted: list of ints or 'all')",
                KEY_I,
            )
        return list(range(n))
    seen: dict[int, int] = {}
    for raw in independent:
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise PlanError(
                f"key '{KEY_I}': {raw!r} is not an integer (accepted: ints or 'all')", KEY_I
            )
        if not -n <= raw < n:
            raise PlanError(
                f"key '{KEY_I}'={list(independent)!r}: index {raw} out of range for {n} "
                f"cache-bearing layers (accepted: integers in [{-n}, {n - 1}] or 'all')",
                KEY_I,
            )
        idx = raw % n
        if idx in seen:
            raise PlanError(
                f"key '{KEY_I}'={list(independent)!r}: {seen[idx]} and {raw} name the same "
                f"layer {idx} (duplicates are not allowed)",
                KEY_I,
            )
        seen[idx] = raw
    return sorted(seen)


def plan_layers(
    layers: Sequence[LayerSpec],
    *,
    num_shared_buffers: int,
    independent: Independent = (0,),
) -> LayerwisePlan:
    """Plan physical buffers for ``layers`` (base layers in order, MTP anywhere; see module doc)."""
    if not layers:
        raise PlanError("layerwise plan: the model has no cache-bearing layers")
    names = [spec.name for spec in layers]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise PlanError(f"layerwise plan: duplicate layer names {dup}")
    by_name = {spec.name: spec for spec in layers}
    mains = [s for s in layers if s.follows is None and not s.mtp]
    mains += [s for s in layers if s.follows is None and s.mtp]
    followers = [s for s in layers if s.follows is not None]
    for f in followers:
        main = by_name.get(f.follows or "")
        if main is None or main.follows is not None:
            raise PlanError(
                f"layerwise plan: indexer layer {f.name!r} follows {f.follows!r}, "
                "which is not a main cache-bearing layer"
            )
    if not mains:
        raise PlanError("layerwise plan: only indexer layers given, no main layer to follow")
    n = len(mains)
    indep_idx = set(normalize_independent(independent, n))
    sharing = len(indep_idx) < n
    if sharing and (isinstance(num_shared_buffers, bool) or not isinstance(num_shared_buffers, int)
                    or num_shared_buffers < 1):
        raise PlanError(
            f"key '{KEY_B}'={num_shared_buffers!r}: must be an integer >= 1 while layers are "
            f"shared ('{KEY_I}' is not 'all')",
            KEY_B,
        )

    order = [s.name for s in mains]
    slot_layers: list[list[str]] = []
    slot_meta: list[tuple[Hashable, bool, int]] = []  # compat, independent, nbytes
    slot_of: dict[str, int] = {}

    def new_slot(spec: LayerSpec, indep: bool) -> int:
        slot_layers.append([])
        slot_meta.append((spec.compat, indep, spec.nbytes))
        return len(slot_layers) - 1

    shared_count: dict[Hashable, int] = {}
    group_total: dict[Hashable, int] = {}
    for i, s in enumerate(mains):
        if i not in indep_idx:
            group_total[s.compat] = group_total.get(s.compat, 0) + 1
    group_slots: dict[Hashable, list[int]] = {}
    for i, s in enumerate(mains):
        if i in indep_idx:
            slot = new_slot(s, True)
        else:
            k = shared_count.get(s.compat, 0)
            shared_count[s.compat] = k + 1
            width = min(num_shared_buffers, group_total[s.compat])
            slots = group_slots.setdefault(s.compat, [])
            if k < width:
                slots.append(new_slot(s, False))
            slot = slots[k % width]
            if slot_meta[slot][2] != s.nbytes:
                raise PlanError(
                    f"layerwise plan: layers {slot_layers[slot][0]!r} and {s.name!r} have the same "
                    f"KV spec but different sizes ({slot_meta[slot][2]} vs {s.nbytes} bytes)"
                )
        slot_layers[slot].append(s.name)
        slot_of[s.name] = slot

    # Followers mirror their main slot: one follower buffer per (main slot, follower spec).
    follower_slot: dict[tuple[int, Hashable], int] = {}
    follows_of: dict[int, int] = {}
    follower_order = sorted(followers, key=lambda f: order.index(f.follows or ""))
    for f in follower_order:
        main_slot = slot_of[f.follows or ""]
        key = (main_slot, f.compat)
        if key not in follower_slot:
            follower_slot[key] = new_slot(f, slot_meta[main_slot][1])
            follows_of[follower_slot[key]] = main_slot
        slot = follower_slot[key]
        if slot_meta[slot][2] != f.nbytes:
            raise PlanError(
                f"layerwise plan: indexer layers {slot_layers[slot][0]!r} and {f.name!r} share a "
                f"buffer but differ in size ({slot_meta[slot][2]} vs {f.nbytes} bytes)"
            )
        slot_layers[slot].append(f.name)
        slot_of[f.name] = slot

    buffers = tuple(
        PhysicalBuffer(
            slot=i,
            compat=meta[0],
            layers=tuple(slot_layers[i]),
            independent=meta[1],
            follows=follows_of.get(i),
            nbytes=meta[2],
        )
        for i, meta in enumerate(slot_meta)
    )
    prev_owner: dict[str, str | None] = {}
    for b in buffers:
        if b.follows is not None:
            continue
        for j, name in enumerate(b.layers):
            prev_owner[name] = None if len(b.layers) == 1 else b.layers[j - 1]
    gate_slot_of = {name: follows_of.get(slot, slot) for name, slot in slot_of.items()}
    return LayerwisePlan(
        layers=tuple(order),
        followers=tuple(f.name for f in follower_order),
        buffers=buffers,
        slot_of=slot_of,
        gate_slot_of=gate_slot_of,
        main_of={f.name: f.follows or "" for f in follower_order},
        independent=frozenset(order[i] for i in indep_idx),
        prev_owner=prev_owner,
        num_shared_buffers=num_shared_buffers,
        sharing=sharing,
    )


def plan_uniform(
    num_layers: int,
    num_shared_buffers: int,
    independent: Independent = (0,),
    mtp_layers: int = 0,
) -> LayerwisePlan:
    """Plan ``num_layers`` identical layers plus ``mtp_layers`` MTP layers (the CLI's model)."""
    if num_layers < 1:
        raise PlanError(f"num_layers={num_layers}: must be >= 1")
    if mtp_layers < 0:
        raise PlanError(f"mtp_layers={mtp_layers}: must be >= 0")
    specs = [LayerSpec(f"layers.{i}") for i in range(num_layers)]
    specs += [LayerSpec(f"mtp.{j}", mtp=True) for j in range(mtp_layers)]
    return plan_layers(specs, num_shared_buffers=num_shared_buffers, independent=independent)
