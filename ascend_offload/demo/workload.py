"""The demo's workload: prompts with shared prefixes, some streamed, most beyond the hot buffer.

Deterministic (seeded token ids; the tiny model has no meaningful text). Three
prefix groups share their first 160-384 tokens; the lengths span shorter than
the sparse top-k (every position attended), shorter than the decode hot
buffer, and many times longer than it (decode steps that miss).
"""

from __future__ import annotations

import dataclasses
import random

# (prefix group, suffix tokens, streamed); groups' prefix lengths below
SPEC: tuple[tuple[str, int, bool], ...] = (
    ("A", 40, False), ("A", 200, True), ("B", 100, False), ("A", 350, True),
    ("-", 40, False), ("B", 16, True), ("C", 300, False), ("-", 700, True),
    ("C", 64, False), ("B", 500, True), ("A", 8, False), ("-", 20, True),
    ("C", 600, True), ("B", 250, False), ("-", 900, False), ("A", 120, True),
)
PREFIX_TOKENS = {"A": 256, "B": 384, "C": 160}
TOKEN_RANGE = (3, 512)


@dataclasses.dataclass(frozen=True)
class Request:
    """One prompt of the workload."""

    index: int
    prompt: tuple[int, ...]
    prefix: str
    stream: bool


def workload(n: int | None = None, seed: int = 7) -> list[Request]:
    """The first ``n`` requests (all by default) of the fixed workload."""
    rng = random.Random(seed)
    prefixes = {g: [rng.randrange(*TOKEN_RANGE) for _ in range(k)] for g, k in PREFIX_TOKENS.items()}
    out = []
    for i, (group, suffix, stream) in enumerate(SPEC[: len(SPEC) if n is None else n]):
        tail = [rng.randrange(*TOKEN_RANGE) for _ in range(suffix)]
        out.append(Request(i + 1, tuple(prefixes.get(group, []) + tail), group, stream))
    return out
