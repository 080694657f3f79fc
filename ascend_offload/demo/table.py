"""The demo's one table: per-request latency and the servers' counters, then totals.

Every number but the latencies comes from the servers' ``/metrics`` (deltas
around each request; requests run one at a time so a delta is that request's).
A counter family a server does not export (its connector is not configured, or
no such counter exists) prints ``n/a``, never a made-up 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from ascend_offload.demo.prom import Metrics

RD2H = "vllm:ascend_offload_rd2h_"
STORE = "vllm:ascend_offload_store_"
SPARSE = "vllm:ascend_offload_sparse_"
SPEC = "vllm:spec_decode_"


@dataclasses.dataclass
class RequestResult:
    """One workload request through the proxy: what the client saw and the counter deltas."""

    index: int
    prompt_tokens: int
    prefix: str  # shared-prefix group name, "-" for none
    stream: bool
    e2e_s: float
    ttft_s: float | None  # streamed requests only
    tpot_s: float | None
    identical: bool
    prefill: Metrics  # counter deltas of the prefill server around this request
    decode: Metrics


def value(m: Mapping[str, float], family: str) -> float | None:
    """A family's value, ``None`` when the server does not export it. The sparse decode
    counters are ``vllm:ascend_offload_sparse_*`` on an ``AscendSparseDecodeConnector``
    and ``vllm:ascend_offload_rd2h_sparse_*`` on an RD2H consumer with sparse offload."""
    if family.startswith(SPARSE) and family not in m:
        return m.get(RD2H + "sparse_" + family[len(SPARSE):])
    return m.get(family)


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den


def _f(x: float | None, fmt: str, scale: float = 1.0) -> str:
    return "n/a" if x is None else format(x * scale, fmt)


def _kib(x: float | None) -> str:
    return _f(x, ".1f", 1 / 1024)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def store_hits(m: Mapping[str, float]) -> str:
    """``hits/lookups`` objects of the store's prefix lookups."""
    hit, miss = value(m, STORE + "hit_objects"), value(m, STORE + "miss_objects")
    if hit is None or miss is None:
        return "n/a"
    return f"{hit:.0f}/{hit + miss:.0f}"


def hot_hit_rate(m: Mapping[str, float]) -> float | None:
    return ratio(value(m, SPARSE + "hit_positions"), value(m, SPARSE + "resolved_positions"))


def accepted(m: Mapping[str, float]) -> str:
    """``accepted/drafted`` draft tokens of the decode's speculation (n/a: it does not
    speculate)."""
    acc, drafted = value(m, SPEC + "num_accepted_tokens"), value(m, SPEC + "num_draft_tokens")
    if acc is None or drafted is None:
        return "n/a"
    return f"{acc:.0f}/{drafted:.0f}"


def gate_waits(m: Mapping[str, float]) -> float | None:
    return value(m, STORE + "layerwise_gate_waits")


def cached_blocks(m: Mapping[str, float]) -> float | None:
    """Prompt blocks the decode served from its own prefix cache (not pulled)."""
    return value(m, SPARSE + "prefix_loaded_blocks")


COLUMNS = (("#", 3), ("prompt", 6), ("prefix", 6), ("mode", 6), ("TTFT ms", 7), ("TPOT ms", 7),
           ("E2E ms", 7), ("store hit", 9), ("D cached", 8), ("RD2H KiB", 8), ("new->pool", 9),
           ("pool->hot", 9), ("hot hit", 7), ("accept", 6), ("gate", 4), ("same", 4))


def _row(cells: Sequence[str]) -> str:
    return "  ".join(c.rjust(w) for c, (_, w) in zip(cells, COLUMNS, strict=True))


def request_row(r: RequestResult) -> str:
    return _row([
        str(r.index), str(r.prompt_tokens), r.prefix, "stream" if r.stream else "full",
        _f(r.ttft_s, ".0f", 1e3), _f(r.tpot_s, ".1f", 1e3), f"{r.e2e_s * 1e3:.0f}",
        store_hits(r.prefill), _f(cached_blocks(r.decode), ".0f"),
        _kib(value(r.decode, RD2H + "bytes_pulled")),
        _kib(value(r.decode, SPARSE + "offload_bytes")), _kib(value(r.decode, SPARSE + "miss_bytes")),
        _pct(hot_hit_rate(r.decode)), accepted(r.decode), _f(gate_waits(r.prefill), ".0f"),
        "yes" if r.identical else "NO",
    ])


@dataclasses.dataclass
class Footprint:
    """Device KV per token as a fraction of the full KV per token (``None``: unknown)."""

    prefill: float | None
    decode: float | None


def _sum(results: Sequence[RequestResult], side: str, family: str) -> float | None:
    vals = [value(getattr(r, side), family) for r in results]
    present = [v for v in vals if v is not None]
    return sum(present) if present else None


def render(results: Sequence[RequestResult], footprint: Footprint) -> str:
    """The whole table, ending with the ``demo: N/N requests identical`` line."""
    lines = [_row([name for name, _ in COLUMNS]), _row(["-" * w for _, w in COLUMNS])]
    lines += [request_row(r) for r in results]
    hit, miss = _sum(results, "prefill", STORE + "hit_objects"), _sum(results, "prefill", STORE + "miss_objects")
    hits = "n/a" if hit is None or miss is None else f"{hit:.0f}/{hit + miss:.0f} objects"
    loaded = _sum(results, "prefill", STORE + "loaded_blocks")
    saved = _sum(results, "prefill", STORE + "saved_blocks")
    store_bytes = ("n/a (this prefill has no store)" if loaded is None else
                   f"{loaded:.0f} blocks loaded, {saved or 0:.0f} saved (bytes: no counter exported)")
    resolved = _sum(results, "decode", SPARSE + "resolved_positions")
    hot = ratio(_sum(results, "decode", SPARSE + "hit_positions"), resolved)
    failures = _sum(results, "decode", RD2H + "read_failures")
    drafted = _sum(results, "decode", SPEC + "num_draft_tokens")
    accepted_tokens = _sum(results, "decode", SPEC + "num_accepted_tokens")
    speculation = ("n/a (the decode does not speculate)" if drafted is None else
                   f"accepted {_f(accepted_tokens, '.0f')} of {drafted:.0f} draft tokens "
                   f"({_pct(ratio(accepted_tokens, drafted))}) in "
                   f"{_f(_sum(results, 'decode', SPEC + 'num_drafts'), '.0f')} verification rows, "
                   f"{_f(_sum(results, 'decode', SPARSE + 'verify_rows'), '.0f')} of them on the hot "
                   f"buffers")
    lines += [
        "",
        f"bytes moved   RD2H prefill->decode pool {_kib(_sum(results, 'decode', RD2H + 'bytes_pulled'))} KiB "
        f"({_f(_sum(results, 'decode', RD2H + 'layers_pulled'), '.0f')} layer reads, "
        f"{_f(failures, '.0f')} failed) | decode new KV->pool "
        f"{_kib(_sum(results, 'decode', SPARSE + 'offload_bytes'))} KiB | pool->hot buffer "
        f"{_kib(_sum(results, 'decode', SPARSE + 'miss_bytes'))} KiB",
        f"store         prefix hits {hits}; {store_bytes}",
        f"decode cache  {_f(_sum(results, 'decode', SPARSE + 'prefix_loaded_blocks'), '.0f')} prompt "
        f"blocks served from the decode's prefix cache (not pulled), "
        f"{_f(_sum(results, 'decode', SPARSE + 'prefix_kept_blocks'), '.0f')} kept",
        f"gate waits    {_f(_sum(results, 'prefill', STORE + 'layerwise_gate_waits'), '.0f')} (layerwise reuse gate)"
        f" | RD2H gate holds {_f(_sum(results, 'prefill', RD2H + 'gate_holds'), '.0f')}",
        f"hot buffer    hit rate {_pct(hot)} of {_f(resolved, '.0f')} top-k positions resolved",
        f"speculation   {speculation}",
        f"device KV     per token, as a ratio of full KV: prefill {_f(footprint.prefill, '.2f')}, "
        f"decode {_f(footprint.decode, '.2f')}",
        "",
        f"demo: {sum(r.identical for r in results)}/{len(results)} requests identical",
    ]
    return "\n".join(lines)
