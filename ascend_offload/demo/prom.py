"""Prometheus text exposition parsing for the demo: a server's ``/metrics`` into totals.

The demo reads everything it reports from the servers' own ``/metrics`` (the
same numbers an operator's scraper sees), as per-request deltas. Only the
families the table needs are kept, summed over their label sets (one engine per
server here, so a sum is the engine's value). A line that does not parse is
skipped, not fatal: the page comes from another process.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

Metrics = dict[str, float]

_SUFFIXES = ("_total",)


def family_of(sample: str) -> str:
    """The metric family a sample name belongs to (``..._total`` counters map to their family)."""
    for suffix in _SUFFIXES:
        if sample.endswith(suffix):
            return sample[: -len(suffix)]
    return sample


def parse(text: str, prefixes: Iterable[str] = ("vllm:",)) -> Metrics:
    """``{family: value summed over label sets}`` of the samples whose name starts with
    one of ``prefixes``; ``_created`` timestamps and non-finite values are left out."""
    wanted = tuple(prefixes)
    out: Metrics = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if name_end <= 0:
            continue
        name = line[:name_end]
        if not name.startswith(wanted) or name.endswith("_created"):
            continue
        rest = line[name_end:]
        if rest.startswith("{"):
            close = rest.rfind("}")
            if close < 0:
                continue
            rest = rest[close + 1:]
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if not math.isfinite(value):
            continue
        fam = family_of(name)
        out[fam] = out.get(fam, 0.0) + value
    return out


def delta(before: Mapping[str, float], after: Mapping[str, float]) -> Metrics:
    """``after - before`` per family present in ``after`` (a family new in ``after`` counts from 0)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}
