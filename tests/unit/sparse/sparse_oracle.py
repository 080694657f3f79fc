"""A deliberately naive exact-LRU residency model (dicts and an OrderedDict).

It restates the semantics of ``csrc_npu/residency.cpp`` in the most direct
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


class Oracle:
    def __init__(self, hot_size: int) -> None:
        self.H = hot_size
        self.rows: dict[tuple[int, int], OracleRow] = {}

    def release(self, row: int) -> None:
        for key in [k for k in self.rows if k[1] == row]:
            del self.rows[key]

    def resolve(self, layer: int, row: int, tag: int, stable: int, topk: list[int],
                block_table: list[int], block_size: int):
        st = self.rows.get((layer, row))
        if st is None or st.tag != tag:
            st = self.rows[(layer, row)] = OracleRow(tag, self.H)

        def host_row(p: int) -> int:
            return block_table[p // block_size] * block_size + p % block_size

        return st.resolve(stable, topk, row * self.H, host_row)
