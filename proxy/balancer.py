"""Least-loaded choice among backend instances of one role.

Load is the number of requests the proxy currently has in flight on an
instance (for prefill, weighted by prompt size so one long prompt counts more
than several short ones). Ties rotate so equal instances share work evenly.
An instance that refused a connection is skipped for a short cooldown and
only used again when no healthy instance is left, so a dead backend costs one
failed connect per cooldown rather than one per request.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(eq=False)
class Instance:
    """One prefill or decode server, plus the proxy's view of its load."""

    role: str
    host: str
    port: int
    inflight: int = 0
    load: int = 0  # weighted in-flight load (see module docstring)
    requests: int = 0
    failures: int = 0
    down_until: float = 0.0
    url: str = field(init=False)

    def __post_init__(self) -> None:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        self.url = f"http://{host}:{self.port}"

    @property
    def name(self) -> str:
        return f"{self.host}:{self.port}"


class Balancer:
    """Picks the least-loaded instance of one role and tracks its load."""

    def __init__(self, role: str, addresses: Iterable[tuple[str, int]], cooldown_s: float = 2.0):
        self.role = role
        self.instances = [Instance(role, h, int(p)) for h, p in addresses]
        if not self.instances:
            raise ValueError(f"no {role} instances given")
        self.cooldown_s = cooldown_s
        self._rr = 0

    def pick(self, exclude: Iterable[Instance] = ()) -> Instance | None:
        """Least-loaded healthy instance not in ``exclude``; None if none is left.

        Instances in their cooldown are used only when every remaining one is
        cooling down (a refused connect is cheap, an unnecessary 503 is not).
        """
        now = time.monotonic()
        excluded = set(exclude) if exclude else ()
        n = len(self.instances)
        start = self._rr
        self._rr = (start + 1) % n
        best: Instance | None = None
        best_key: tuple[int, int] | None = None
        for i in range(n):
            inst = self.instances[(start + i) % n]
            if inst in excluded:
                continue
            key = (1 if inst.down_until > now else 0, inst.load)
            if best_key is None or key < best_key:
                best, best_key = inst, key
        return best

    @staticmethod
    def acquire(inst: Instance, weight: int = 1) -> None:
        inst.inflight += 1
        inst.load += weight
        inst.requests += 1

    @staticmethod
    def release(inst: Instance, weight: int = 1) -> None:
        inst.inflight -= 1
        inst.load -= weight

    def mark_down(self, inst: Instance) -> None:
        inst.failures += 1
        inst.down_until = time.monotonic() + self.cooldown_s

    @staticmethod
    def mark_up(inst: Instance) -> None:
        inst.down_until = 0.0

    def snapshot(self) -> list[dict[str, object]]:
        now = time.monotonic()
        return [
            {
                "instance": i.name,
                "inflight": i.inflight,
                "load": i.load,
                "requests": i.requests,
                "failures": i.failures,
                "healthy": i.down_until <= now,
            }
            for i in self.instances
        ]
