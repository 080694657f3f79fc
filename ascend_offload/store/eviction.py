"""Eviction policies: which committed object a full store gives up first.

One interface for every tier that holds objects by key (host pages, SSD slots),
shaped like vLLM's ``kv_offload`` cache policies: the policy only *orders*
resident keys; the store owns pages, pins and sizes, and names the candidates
it cannot evict (pinned ones) when it walks :meth:`EvictionPolicy.victims`.
"""

from __future__ import annotations

import abc
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from itertools import filterfalse, islice

#: ``skip(key)`` is true for a resident key the store cannot evict now (pinned)
Skip = Callable[[str], bool]


class EvictionPolicy(abc.ABC):
    """Order of the resident keys of one store, first victim first.

    The store reports every event on a key: :meth:`insert` (committed),
    :meth:`touch` (a hit that will be read), :meth:`miss` (a lookup stopped at a
    key it does not hold), :meth:`evict` (gave the key up for room) and
    :meth:`remove` (dropped it for any other reason). When it needs room it walks
    :meth:`victims` and evicts the keys it takes."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"eviction policy capacity must be >= 1, got {capacity}")
        self.capacity = capacity  # objects the store can hold (bounds any history kept)

    @abc.abstractmethod
    def insert(self, key: str) -> None:
        """A newly resident key (committed). Inserting a resident key is not a use:
        it does not promote the key (LRU keeps its place, ARC its list)."""

    @abc.abstractmethod
    def touch(self, key: str) -> None:
        """A hit on a resident key (a lookup that will be read); no-op if absent."""

    def miss(self, key: str) -> None:  # noqa: B027 - optional hook
        """A lookup of a key that is not resident (ARC adapts on ghost hits)."""

    def evict(self, key: str) -> None:
        """The store gave ``key`` up to make room (ARC remembers it in a ghost list);
        no-op if absent."""
        self.remove(key)

    @abc.abstractmethod
    def remove(self, key: str) -> None:
        """A key that left the store for another reason (discarded, forgotten): no
        history is kept; no-op if absent."""

    # A store reports a request's keys together: the batch forms save the per-key
    # method call (~0.1 us each, visible in the index path of a busy scheduler).

    def insert_many(self, keys: Iterable[str]) -> None:
        """:meth:`insert` of each key, in order."""
        for key in keys:
            self.insert(key)

    def touch_many(self, keys: Iterable[str]) -> None:
        """:meth:`touch` of each key, in order."""
        for key in keys:
            self.touch(key)

    def evict_many(self, keys: Iterable[str]) -> None:
        """:meth:`evict` of each key, in order."""
        for key in keys:
            self.evict(key)

    @abc.abstractmethod
    def victims(self, skip: Skip | None = None) -> Iterator[str]:
        """Resident keys in eviction order, lazily, as if every key yielded is evicted.

        ``skip(key)`` is true for keys the caller will not take (pinned). A policy whose
        order depends on what was taken (ARC weighs ``|T1|`` against ``p``) consults it
        and neither yields nor counts those keys; one whose order does not (LRU) may
        yield them anyway, sparing a Python call per candidate - so the caller still
        checks every key it gets. The iterator walks the live order (no copy: taking
        ``k`` victims costs O(k + skipped)), so the caller must not report events while
        it iterates: collect the victims, drop the iterator, then :meth:`evict_many`."""

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
        self.insert_many((key,))

    def touch(self, key: str) -> None:
        self.touch_many((key,))

    def remove(self, key: str) -> None:
        self._order.pop(key, None)

    evict = remove  # LRU keeps no history

    # Plain loops over bound C methods: every request's index path runs these and LRU
    # is the default (map/update(zip) forms measured more instructions, a tuple per key).

    def insert_many(self, keys: Iterable[str]) -> None:
        order = self._order
        for key in keys:
            order[key] = None  # a new key goes to the end (the newest); a resident one stays

    def touch_many(self, keys: Iterable[str]) -> None:
        order = self._order
        for key in keys:
            if key in order:
                order.move_to_end(key)

    def evict_many(self, keys: Iterable[str]) -> None:
        pop = self._order.pop
        for key in keys:
            pop(key, None)

    def victims(self, skip: Skip | None = None) -> Iterator[str]:
        return iter(self._order)  # the order does not depend on what is taken: no skip

    def clear(self) -> None:
        self._order.clear()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST 2003) over keys.

    Resident keys live in T1 (seen once since they entered) or T2 (hit again
    since); both are LRU-ordered. Evicted keys are remembered, without data, in
    the ghost lists B1 (evicted from T1) and B2 (evicted from T2). The target
    size ``p`` of T1 moves on ghost hits: a lookup that misses a key in B1 means
    T1 was too small (``p`` grows), one in B2 that T2 was (``p`` shrinks). A
    victim comes from T1 while ``|T1| > p``, else from T2.

    Why it resists scans: a one-pass scan only ever enters T1 and is never hit
    again, so it pushes out other seen-once keys - not the re-used working set in
    T2 - and it adds nothing to the ghost hits that would grow T1.

    Memory is bounded: each ghost list keeps the last ``capacity`` keys evicted from
    its list (the oldest goes first), so history never exceeds twice the store. The
    paper bounds ``|T1| + |B1|`` by the capacity instead; with a store full of
    seen-once keys that leaves no ghost at all, and a prefix whose reuse comes back
    after more than a storeful of other blocks (the looped working set behind a scan)
    could never be recognised. Like vLLM's ARC, each list is bounded on its own."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._t1: OrderedDict[str, None] = OrderedDict()
        self._t2: OrderedDict[str, None] = OrderedDict()
        # ghost key -> whether its hit already moved p (one adaptation per ghost: the
        # store looks a waiting request's prefix up again every scheduler step)
        self._b1: OrderedDict[str, bool] = OrderedDict()
        self._b2: OrderedDict[str, bool] = OrderedDict()
        self.p = 0.0  # target size of T1

    # ------------------------------------------------------------------ events
    # The batch forms are the implementations (plain loops, the lists bound once):
    # the store reports a request's keys together.

    def insert(self, key: str) -> None:
        self.insert_many((key,))

    def touch(self, key: str) -> None:
        self.touch_many((key,))

    def evict(self, key: str) -> None:
        self.evict_many((key,))

    def insert_many(self, keys: Iterable[str]) -> None:
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        for key in keys:
            if key in t1 or key in t2:  # a store is not a use
                continue
            if key in b1:  # evicted before, wanted again: frequent, T2
                if not b1[key]:
                    self._adapt(True)
                del b1[key]
                t2[key] = None
            elif key in b2:
                if not b2[key]:
                    self._adapt(False)
                del b2[key]
                t2[key] = None
            else:
                t1[key] = None

    def touch_many(self, keys: Iterable[str]) -> None:
        t1, t2 = self._t1, self._t2
        for key in keys:
            if key in t1:
                del t1[key]
                t2[key] = None
            elif key in t2:
                t2.move_to_end(key)

    def evict_many(self, keys: Iterable[str]) -> None:
        t1, t2, b1, b2, cap = self._t1, self._t2, self._b1, self._b2, self.capacity
        for key in keys:
            if key in t1:
                del t1[key]
                b1[key] = False
                if len(b1) > cap:
                    b1.popitem(last=False)
            elif key in t2:
                del t2[key]
                b2[key] = False
                if len(b2) > cap:
                    b2.popitem(last=False)

    def miss(self, key: str) -> None:
        if key in self._b1:
            ghosts, from_b1 = self._b1, True
        elif key in self._b2:
            ghosts, from_b1 = self._b2, False
        else:
            return
        if not ghosts[key]:
            self._adapt(from_b1)
            ghosts[key] = True
        ghosts.move_to_end(key)  # keep it until the store inserts it

    def remove(self, key: str) -> None:
        for d in (self._t1, self._t2, self._b1, self._b2):
            if key in d:  # the four are disjoint
                del d[key]
                return

    def _adapt(self, from_b1: bool) -> None:
        b1, b2 = len(self._b1), len(self._b2)
        if from_b1:
            self.p = min(float(self.capacity), self.p + max(1.0, b2 / b1))
        else:
            self.p = max(0.0, self.p - max(1.0, b1 / b2))

    # ------------------------------------------------------------------ order

    def victims(self, skip: Skip | None = None) -> Iterator[str]:
        t1 = iter(self._t1) if skip is None else filterfalse(skip, self._t1)
        t2 = iter(self._t2) if skip is None else filterfalse(skip, self._t2)
        # T1 while |T1| > p (each key taken shrinks it), then T2, then the rest of T1
        yield from islice(t1, max(0, len(self._t1) - math.floor(self.p)))
        yield from t2
        yield from t1

    def sizes(self) -> tuple[int, int, int, int]:
        """``(|T1|, |T2|, |B1|, |B2|)``: for invariant checks and diagnostics."""
        return len(self._t1), len(self._t2), len(self._b1), len(self._b2)

    def clear(self) -> None:
        for d in (self._t1, self._t2, self._b1, self._b2):
            d.clear()
        self.p = 0.0

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2


_POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}

#: the names ``eviction`` accepts
EVICTION_POLICIES: tuple[str, ...] = tuple(_POLICIES)


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """The policy called ``name`` for a store of ``capacity`` objects."""
    cls = _POLICIES.get(name)
    if cls is None:
        raise ValueError(f"eviction must be one of {sorted(_POLICIES)}, got {name!r}")
    return cls(capacity)
