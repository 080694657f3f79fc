"""Device-KV footprint of each engine, from the KV-layout lines its start-up log prints.

No metric exports the footprint yet; the layout hooks log it once, when the
engine plans its KV cache: sparse decode offload ("device KV X -> Y MiB ...,
blocks A -> B") and layerwise sharing ("KV blocks A -> B", same memory). The
ratio is device KV bytes per token slot after the cut over before it (full KV):
``(Y / B) / (X / A)``. An engine without a cut keeps the full KV (1.0).
"""

from __future__ import annotations

import re

_DECODE = re.compile(r"device KV ([0-9.]+) -> ([0-9.]+) MiB .*?blocks (\d+) -> (\d+)")
_LAYERWISE = re.compile(r"ascend-offload layerwise: .*?KV blocks (\d+) -> (\d+)")


def footprint_ratio(log: str) -> float:
    """Device KV per token slot as a fraction of the full KV, from an engine's log (the last
    layout line wins: one engine plans once); 1.0 when the log shows no cut."""
    ratio = 1.0
    for line in log.splitlines():
        m = _DECODE.search(line)
        if m:
            before_mib, after_mib, before_blocks, after_blocks = (float(g) for g in m.groups())
            if before_mib > 0 and after_blocks > 0 and before_blocks > 0:
                ratio = (after_mib / after_blocks) / (before_mib / before_blocks)
            continue
        m = _LAYERWISE.search(line)
        if m:
            before_blocks, after_blocks = (float(g) for g in m.groups())
            if after_blocks > 0:
                ratio = before_blocks / after_blocks
    return ratio
