"""Eviction policies (store/eviction.py) alone and inside LocalStore's index path."""

from __future__ import annotations

import random

import pytest

from ascend_offload.config import ConfigError, StoreConnectorConfig
from ascend_offload.store.eviction import (
    EVICTION_POLICIES,
    ARCPolicy,
    EvictionPolicy,
    LRUPolicy,
    make_policy,
)
from ascend_offload.store.local import LocalStore

# ---------------------------------------------------------------- the index path


def request(store: LocalStore, keys: list[str]) -> int:
    """One request as the connector makes it: lookup; pin + unpin the hit prefix (the
    load); allocate + commit the missing tail (the save). Returns the blocks hit."""
    n = store.lookup_prefix(keys)
    if n:
        pin = store.pin(keys[:n])
        assert pin is not None
        store.unpin(pin)
    if n < len(keys):
        handles = store.allocate(keys[n:], [1] * (len(keys) - n))
        if handles is not None:
            store.commit([h for h in handles if h is not None])
    return n


def scan_plus_loop(rounds: int) -> list[tuple[bool, list[str]]]:
    """4 hot prefixes of 4 blocks (16 blocks) requested in a loop, each hot request
    followed by 4 one-off scan prefixes of 4 blocks: 64 scan blocks per round, as many
    as the 64-block store below, so the scan between two requests of one hot prefix
    (48-64 blocks) plus the other hot prefixes (12) overflows it."""
    hot = [[f"h{p}:{b}" for b in range(4)] for p in range(4)]
    trace, scans = [], 0
    for _ in range(rounds):
        for p in range(4):
            trace.append((True, hot[p]))
            for _ in range(4):
                trace.append((False, [f"s{scans}:{b}" for b in range(4)]))
                scans += 1
    return trace


def hot_hits(eviction: str, rounds: int) -> tuple[int, int]:
    """(hot blocks hit, hot blocks requested after the first round) on the trace above."""
    store = LocalStore(64, 1, eviction, with_data=False)
    hits = wanted = 0
    for i, (hot, keys) in enumerate(scan_plus_loop(rounds)):
        n = request(store, keys)
        if hot and i >= 4 * 5:  # the first round is cold for every policy
            hits += n
            wanted += len(keys)
    return hits, wanted


def test_arc_keeps_a_looped_working_set_through_a_scan_that_lru_loses() -> None:
    """Same trace, same store size: LRU evicts every hot prefix before it comes back
    (the scan between two uses is larger than the store), ARC keeps them all in T2
    once they were seen twice (round 2 re-fetches them; every later round hits)."""
    rounds = 10
    lru_hits, wanted = hot_hits("lru", rounds)
    arc_hits, wanted_arc = hot_hits("arc", rounds)
    assert wanted == wanted_arc == (rounds - 1) * 16
    assert lru_hits == 0
    assert arc_hits == (rounds - 2) * 16  # everything after the second round


def test_both_policies_keep_a_working_set_that_fits() -> None:
    for eviction in EVICTION_POLICIES:
        store = LocalStore(64, 1, eviction, with_data=False)
        loop = [[f"h{p}:{b}" for b in range(4)] for p in range(8)]  # 32 blocks of 64
        hits = [request(store, keys) for _ in range(5) for keys in loop]
        assert hits == [0] * 8 + [4] * 32, eviction


def test_arc_adapts_to_recency_when_reuse_follows_soon() -> None:
    """Every prefix twice, the second time two requests later, then never: the reused
    ones pile up in T2 and T1 is starved until ghost hits in B1 grow its target; from
    then on ARC hits like LRU, which hits every reuse."""
    results = {}
    for eviction in EVICTION_POLICIES:
        store = LocalStore(32, 1, eviction, with_data=False)
        hits = 0
        for t in range(300):
            hits += request(store, [f"r{t}:{b}" for b in range(4)])
            if t >= 2:
                hits += request(store, [f"r{t - 2}:{b}" for b in range(4)])
        results[eviction] = hits
    assert results["lru"] == 298 * 4
    assert results["lru"] - results["arc"] <= 4 * 4, results  # learning p costs <= 4 reuses


# ---------------------------------------------------------------- ARC itself


def lists(p: ARCPolicy) -> tuple[list[str], list[str], list[str], list[str]]:
    return list(p._t1), list(p._t2), list(p._b1), list(p._b2)


def test_arc_promotes_on_a_hit_and_evicts_t1_first() -> None:
    arc = ARCPolicy(4)
    for k in "abcd":
        arc.insert(k)
    arc.touch("b")
    assert lists(arc) == (["a", "c", "d"], ["b"], [], [])
    assert list(arc.victims()) == ["a", "c", "d", "b"]  # |T1| > p = 0: T1 first
    arc.insert("a")  # a store is not a use
    assert "a" in arc._t1 and len(arc) == 4 and "a" in arc and "z" not in arc


def test_arc_ghost_hits_move_the_target_once_and_readmit_into_t2() -> None:
    arc = ARCPolicy(4)
    for k in "abcd":
        arc.insert(k)
    arc.touch("d")
    arc.evict_many(["a", "b"])
    assert lists(arc) == (["c"], ["d"], ["a", "b"], [])
    arc.miss("a")  # B1 hit: T1 was too small
    assert arc.p == 1.0
    arc.miss("a")  # a waiting request looked up again: no second adaptation
    assert arc.p == 1.0
    arc.insert("b")  # readmitted without a lookup miss first: adapts now, once
    assert arc.p == 2.0
    arc.insert("a")
    assert arc.p == 2.0
    assert lists(arc) == (["c"], ["d", "b", "a"], [], [])
    arc.evict("d")  # from T2: into B2
    arc.miss("d")  # B2 hit: T2 was too small
    assert arc.p == 1.0 and lists(arc)[3] == ["d"]
    arc.miss("zz")  # never seen: nothing moves
    assert arc.p == 1.0


def test_arc_victims_follow_the_target_and_skipped_keys_do_not_count() -> None:
    arc = ARCPolicy(8)
    for k in "abc":
        arc.insert(k)
    arc.insert("x")
    arc.touch("x")
    arc.p = 1.0
    # T1 = a b c, T2 = x: T1 while |T1| > 1 (a, b), then T2 (x), then the rest (c)
    assert list(arc.victims()) == ["a", "b", "x", "c"]
    # a pinned: b and c leave T1 (the skipped a still counts in |T1|), then x
    assert list(arc.victims(lambda k: k == "a")) == ["b", "c", "x"]
    assert list(arc.victims(lambda k: True)) == []


def test_arc_remove_keeps_no_history_and_clear_forgets_all() -> None:
    arc = ARCPolicy(4)
    arc.insert("a")
    arc.insert("b")
    arc.evict("a")
    arc.remove("b")
    arc.remove("a")  # a ghost can be forgotten too
    arc.remove("never")
    assert lists(arc) == ([], [], [], [])
    arc.insert("c")
    arc.p = 3.0
    arc.clear()
    assert lists(arc) == ([], [], [], []) and arc.p == 0.0 and len(arc) == 0


@pytest.mark.parametrize("seed", range(5))
def test_arc_ghost_lists_stay_bounded(seed: int) -> None:
    """Random events (as a store of ``capacity`` objects reports them): the lists stay
    disjoint, each ghost list and the resident keys never exceed the capacity, and
    ``p`` stays in [0, capacity]."""
    rng = random.Random(seed)
    cap = 16
    arc = ARCPolicy(cap)
    for step in range(4000):
        key = f"k{rng.randrange(64)}"
        op = rng.random()
        if op < 0.4 and key not in arc:
            if len(arc) == cap:  # full: evict the first victim, as a store would
                arc.evict(next(arc.victims()))
            arc.insert(key)
        elif op < 0.7:
            arc.touch(key)
        elif op < 0.85:
            arc.miss(key)
        elif op < 0.95:
            arc.evict(key)
        else:
            arc.remove(key)
        t1, t2, b1, b2 = (set(x) for x in lists(arc))
        assert not (t1 & t2 or t1 & b1 or t1 & b2 or t2 & b1 or t2 & b2 or b1 & b2), step
        assert len(b1) <= cap and len(b2) <= cap, step
        assert 0.0 <= arc.p <= cap
        assert len(arc) == len(t1) + len(t2) <= cap
        assert arc.sizes() == (len(t1), len(t2), len(b1), len(b2))


def test_a_long_scan_leaves_no_more_history_than_the_store() -> None:
    arc = ARCPolicy(8)
    for i in range(1000):
        if len(arc) == 8:
            arc.evict(next(arc.victims()))
        arc.insert(f"s{i}")
    assert arc.sizes() == (8, 0, 8, 0)
    assert list(arc._b1) == [f"s{i}" for i in range(984, 992)]  # the last 8 evicted


# ---------------------------------------------------------------- LRU, names, config


def test_lru_order_and_skip() -> None:
    lru = LRUPolicy(4)
    lru.insert_many(["a", "b", "c"])
    lru.touch("a")
    assert list(lru.victims()) == ["b", "c", "a"]
    # LRU's order does not depend on what is taken: it leaves skipping to the caller
    assert list(lru.victims(lambda k: k == "b")) == ["b", "c", "a"]
    lru.insert("b")  # a store is not a use: keeps its place
    lru.evict_many(["c", "absent"])
    assert list(lru.victims()) == ["b", "a"] and len(lru) == 2 and "c" not in lru


def test_make_policy_names_the_choices() -> None:
    assert EVICTION_POLICIES == ("lru", "arc")
    assert isinstance(make_policy("arc", 3), ARCPolicy)
    assert isinstance(make_policy("lru", 3), LRUPolicy)
    with pytest.raises(ValueError, match=r"one of \['arc', 'lru'\]"):
        make_policy("lfu", 3)
    with pytest.raises(ValueError, match=">= 1"):
        make_policy("arc", 0)
    with pytest.raises(ValueError, match="eviction must be one of"):
        LocalStore(4, 1, "fifo")


def test_config_accepts_arc_and_refuses_other_names() -> None:
    cfg = StoreConnectorConfig.model_validate({"local": {"eviction": "arc"}})
    assert cfg.local.eviction == "arc"
    with pytest.raises((ConfigError, ValueError), match="eviction"):
        StoreConnectorConfig.model_validate({"local": {"eviction": "lfu"}})


# ---------------------------------------------------------------- LocalStore + policy


@pytest.mark.parametrize("eviction", EVICTION_POLICIES)
def test_store_skips_pinned_objects_in_policy_order(eviction: str) -> None:
    store = LocalStore(4, 1, eviction, with_data=False)
    request(store, ["a", "b", "c", "d"])
    held = store.pin(["a"])  # pinned, and the first victim under either policy's order
    assert held is not None
    request(store, ["x", "y"])  # evicts two, never a
    assert store.lookup_prefix(["a"]) == 1
    assert sorted(k for k in "abcd" if store.lookup_prefix([k])) == ["a", "d"]
    assert store.stats().stored_objects == 4 and store.evictable_pages() == 3
    assert store.take_freed() == ["b", "c"]
    store.unpin(held)


def test_store_reports_lookup_misses_and_discards_to_arc() -> None:
    store = LocalStore(4, 1, "arc", with_data=False)
    policy = store._policy
    assert isinstance(policy, ARCPolicy)
    request(store, ["a", "b", "c", "d"])
    assert request(store, ["d"]) == 1  # the pin of a hit promotes d to T2
    request(store, ["e"])  # evicts a (T1 first) into B1
    assert lists(policy) == (["b", "c", "e"], ["d"], ["a"], [])
    assert request(store, ["a", "z"]) == 0  # the lookup stops at a: a ghost hit
    assert policy.p == 1.0  # so T1 keeps 1; b and c made room
    assert lists(policy) == (["e", "z"], ["d", "a"], ["b", "c"], [])  # a came back frequent
    store.discard(["a"])  # request-private data: gone, no ghost either
    assert "a" not in policy and policy.sizes()[3] == 0


def test_the_policy_is_an_eviction_policy() -> None:
    for name in EVICTION_POLICIES:
        assert isinstance(make_policy(name, 1), EvictionPolicy)
