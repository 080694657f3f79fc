"""Eviction policies: which committed object a full store gives up first.

One interface for every tier that holds objects by key (host pages, SSD slots),
shaped like vLLM's ``kv_offload`` cache policies: the policy only *orders*
resident keys; the store owns pages, pins and sizes, and skips the candidates
it cannot evict (pinned ones) while walking :meth:`EvictionPolicy.victims`.
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Iterator


class EvictionPolicy(abc.ABC):
    """Order of the resident keys of one store, first victim first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"eviction policy capacity must be >= 1, got {capacity}")
        self.capacity = capacity  # objects the store can hold (sizes ghost lists)

    @abc.abstractmethod
    def insert(self, key: str) -> None:
        """A newly resident key (committed)."""

    @abc.abstractmethod
    def touch(self, key: str) -> None:
        """A hit on a resident key (a lookup that will be read)."""

    def miss(self, key: str) -> None:  # noqa: B027 - optional hook
        """A lookup of a key that is not resident (ARC adapts on ghost hits)."""

    @abc.abstractmethod
    def remove(self, key: str) -> None:
        """A key that left the store (evicted, discarded, forgotten); no-op if absent."""

    @abc.abstractmethod
    def victims(self) -> Iterator[str]:
        """Resident keys in eviction order; the caller removes the ones it evicts."""

    @abc.abstractmethod
    def clear(self) -> None:
        """Forget every key (and any history)."""

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def __contains__(self, key: object) -> bool: ...


class LRUPolicy(EvictionPolicy):
    """Least recently used first (insert and touch both make a key the newest)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[str, None] = OrderedDict()

    def insert(self, key: str) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: str) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: str) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[str]:
        return iter(list(self._order))

    def clear(self) -> None:
        self._order.clear()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


_POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy}

#: the names ``eviction`` accepts
EVICTION_POLICIES: tuple[str, ...] = tuple(_POLICIES)


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """The policy called ``name`` for a store of ``capacity`` objects."""
    cls = _POLICIES.get(name)
    if cls is None:
        raise ValueError(f"eviction must be one of {sorted(_POLICIES)}, got {name!r}")
    return cls(capacity)
