"""Deliberately naive residency models (dicts, lists and an OrderedDict): exact
LRU and ARC.

They restate the semantics of ``csrc_npu/residency.cpp`` in the most direct
way, so the native table and the torch twin are checked against an
independent reading of the spec, not only against each other.
"""

from __future__ import annotations

from collections import OrderedDict


class OracleRow:
    def __init__(self, tag: int, hot_size: int) -> None:
        self.tag = tag
        self.H = hot_size
        self.pos_of: dict[int, int] = {}  # slot -> position
        self.slot_of: dict[int, int] = {}  # position -> slot
        self.lru: OrderedDict[int, None] = OrderedDict()  # first = least recently used

    def _free(self, s: int) -> None:
        del self.slot_of[self.pos_of.pop(s)]
        self.lru.pop(s)

    def resolve(self, stable: int, topk: list[int], base: int, host_row
                ) -> tuple[list[int], list[tuple[int, int]]]:
        for s in [s for s, p in self.pos_of.items() if p >= stable]:
            self._free(s)
        out = [-1] * len(topk)
        hit = [False] * len(topk)
        touched: set[int] = set()  # a position is touched once, at its first occurrence
        for i, p in enumerate(topk):
            if p >= 0 and p in self.slot_of:
                s = self.slot_of[p]
                out[i] = base + s
                hit[i] = True
                if p not in touched:
                    touched.add(p)
                    self.lru.move_to_end(s)
        misses = []
        for i, p in enumerate(topk):
            if p < 0 or hit[i]:
                continue
            if p in self.slot_of:  # installed by an earlier occurrence in this call
                out[i] = base + self.slot_of[p]
                continue
            free = [s for s in range(self.H) if s not in self.pos_of]
            if free:
                s = free[0]
            else:
                s = next(iter(self.lru))  # least recently used; never touched this call
                self._free(s)
            self.pos_of[s] = p
            self.slot_of[p] = s
            self.lru[s] = None  # appended: most recent
            misses.append((host_row(p), base + s))
            out[i] = base + s
        return out, misses

    def view(self) -> tuple[list[int], list[int], list[int], list[int], int, int]:
        """(slot -> position, slots least recent first, B1, B2, |T1|, p) as the tables
        report them (LRU: everything is T1, no ghosts)."""
        return ([self.pos_of.get(s, -1) for s in range(self.H)], list(self.lru), [], [],
                len(self.lru), 0)


class OracleArcRow:
    """ARC as the comment at the top of residency.cpp states it, one list per set."""

    def __init__(self, tag: int, hot_size: int) -> None:
        self.tag = tag
        self.H = hot_size
        self.slot_of: dict[int, int] = {}  # position -> slot
        self.t1: list[int] = []  # positions, least recent first
        self.t2: list[int] = []
        self.b1: list[int] = []
        self.b2: list[int] = []
        self.p = 0

    def resolve(self, stable: int, topk: list[int], base: int, host_row
                ) -> tuple[list[int], list[tuple[int, int]]]:
        for q in [q for q in self.slot_of if q >= stable]:
            del self.slot_of[q]
        self.t1 = [q for q in self.t1 if q < stable]
        self.t2 = [q for q in self.t2 if q < stable]
        self.b1 = [q for q in self.b1 if q < stable]
        self.b2 = [q for q in self.b2 if q < stable]
        distinct: list[int] = []
        for q in topk:
            if q >= 0 and q not in distinct:
                distinct.append(q)
        hits = [q for q in distinct if q in self.slot_of]
        misses = [q for q in distinct if q not in self.slot_of]
        g1 = [q for q in misses if q in self.b1]
        g2 = [q for q in misses if q in self.b2]
        if g1:
            self.p += len(g1) * max(1, len(self.b2) // len(self.b1))
        if g2:
            self.p -= len(g2) * max(1, len(self.b1) // len(self.b2))
        self.p = min(max(self.p, 0), self.H)
        self.b1 = [q for q in self.b1 if q not in g1]
        self.b2 = [q for q in self.b2 if q not in g2]
        kept1 = [q for q in self.t1 if q not in hits]
        kept2 = [q for q in self.t2 if q not in hits]
        free = [s for s in range(self.H) if s not in self.slot_of.values()]
        need = max(0, len(misses) - len(free))
        fresh = len(misses) - len(g1) - len(g2)
        e1 = min(len(kept1), max(need - len(kept2), min(need, max(0, len(kept1) + fresh - self.p))))
        v1, v2 = kept1[:e1], kept2[: need - e1]
        slots = (free + [self.slot_of[q] for q in v1 + v2])[: len(misses)]
        for q in v1 + v2:
            del self.slot_of[q]
        self.b1 += v1
        self.b2 += v2
        out_misses = []
        for q, s in zip(misses, slots, strict=True):
            self.slot_of[q] = s
            out_misses.append((host_row(q), base + s))
        self.t1 = kept1[e1:] + [q for q in misses if q not in g1 and q not in g2]
        self.t2 = kept2[need - e1:] + hits + [q for q in misses if q in g1 or q in g2]
        while len(self.t1) + len(self.b1) > self.H:
            self.b1.pop(0)
        while len(self.b1) + len(self.b2) > self.H:
            self.b2.pop(0)
        out = [base + self.slot_of[q] if q >= 0 else -1 for q in topk]
        return out, out_misses

    def view(self) -> tuple[list[int], list[int], list[int], list[int], int, int]:
        pos = {s: q for q, s in self.slot_of.items()}
        return ([pos.get(s, -1) for s in range(self.H)],
                [self.slot_of[q] for q in self.t1 + self.t2], list(self.b1), list(self.b2),
                len(self.t1), self.p)


class Oracle:
    def __init__(self, hot_size: int, policy: str = "lru") -> None:
        self.H = hot_size
        self.row_type = {"lru": OracleRow, "arc": OracleArcRow}[policy]
        self.rows: dict[tuple[int, int], OracleRow | OracleArcRow] = {}

    def release(self, row: int) -> None:
        for key in [k for k in self.rows if k[1] == row]:
            del self.rows[key]

    def resolve(self, layer: int, row: int, tag: int, stable: int, topk: list[int],
                block_table: list[int], block_size: int):
        st = self.rows.get((layer, row))
        if st is None or st.tag != tag:
            st = self.rows[(layer, row)] = self.row_type(tag, self.H)

        def host_row(p: int) -> int:
            return block_table[p // block_size] * block_size + p % block_size

        return st.resolve(stable, topk, row * self.H, host_row)

    def view(self, layer: int, row: int) -> tuple[list[int], list[int], list[int], list[int], int, int]:
        st = self.rows.get((layer, row))
        if st is None:
            return [-1] * self.H, [], [], [], 0, 0
        return st.view()
