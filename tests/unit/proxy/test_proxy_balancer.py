from __future__ import annotations

import time

import pytest

from proxy.balancer import Balancer


def test_least_loaded_wins_and_ties_rotate() -> None:
    b = Balancer("decode", [("h", 1), ("h", 2), ("h", 3)])
    a, c, d = b.instances
    Balancer.acquire(a)
    Balancer.acquire(a)
    Balancer.acquire(c)
    assert b.pick() is d
    Balancer.acquire(d)
    assert b.pick() is c or b.pick() is d  # both at load 1, a at 2
    assert all(b.pick() is not a for _ in range(6))
    Balancer.release(a)
    Balancer.release(a)
    # all idle except c, d at 1 -> a every time
    assert all(b.pick() is a for _ in range(4))


def test_ties_spread_over_instances() -> None:
    b = Balancer("decode", [("h", 1), ("h", 2)])
    picks = [b.pick() for _ in range(4)]
    assert {p.port for p in picks} == {1, 2}  # type: ignore[union-attr]


def test_weighted_load_for_prefill() -> None:
    b = Balancer("prefill", [("h", 1), ("h", 2)])
    big, small = b.instances
    Balancer.acquire(big, 1000)
    for _ in range(5):
        Balancer.acquire(small, 10)
    assert b.pick() is small  # 5 small prompts weigh less than one huge one
    assert big.inflight == 1 and small.inflight == 5


def test_cooldown_and_exclude() -> None:
    b = Balancer("decode", [("h", 1), ("h", 2)], cooldown_s=60)
    x, y = b.instances
    b.mark_down(x)
    assert all(b.pick() is y for _ in range(4))
    Balancer.acquire(y)
    Balancer.acquire(y)
    assert b.pick() is y  # a cooling-down instance only when nothing else is left
    assert b.pick(exclude=[y]) is x  # ... which is the case here
    assert b.pick(exclude=[x, y]) is None
    Balancer.mark_up(x)
    assert b.pick() is x
    snap = {s["instance"]: s for s in b.snapshot()}
    assert snap["h:1"]["failures"] == 1 and snap["h:1"]["healthy"]


def test_cooldown_expires() -> None:
    b = Balancer("decode", [("h", 1), ("h", 2)], cooldown_s=0.01)
    x, y = b.instances
    b.mark_down(x)
    Balancer.acquire(y)
    time.sleep(0.02)
    assert b.pick() is x


def test_ipv6_url_and_empty() -> None:
    assert Balancer("d", [("::1", 5)]).instances[0].url == "http://[::1]:5"
    with pytest.raises(ValueError, match="no decode"):
        Balancer("decode", [])
