"""The parts of vLLM's ``Request`` and ``SchedulerOutput`` that our scheduler-side
bookkeeping reads, as plain objects (unit tests drive the bookkeeping without vLLM)."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace


def request(rid: str, n_tokens: int, block_size: int) -> SimpleNamespace:
    """A new request of ``n_tokens`` whose block hashes are ``<rid>-h<i>``."""
    return SimpleNamespace(request_id=rid, num_tokens=n_tokens, num_preemptions=0, num_computed_tokens=0,
                           block_hashes=[f"{rid}-h{i}" for i in range(n_tokens // block_size)])


def step(new: Sequence[tuple[str, int, int]] = (), cached: Sequence[tuple[str, int, int]] = (),
         preempted: set[str] | None = None) -> SimpleNamespace:
    """One scheduler step: (req id, computed tokens before the step, tokens scheduled) per
    new and per cached request; ``preempted``: the step's preempted request ids."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c) for r, c, _ in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _, _ in cached],
                                              num_computed_tokens=[c for _, c, _ in cached],
                                              resumed_req_ids=set()),
        num_scheduled_tokens={r: n for r, _, n in (*new, *cached)},
        preempted_req_ids=preempted)
