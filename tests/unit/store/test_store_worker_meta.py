"""Worker -> scheduler completions of the store connector: vLLM sums them across ranks,
so a fetch settles only when every rank's result is in."""

from __future__ import annotations

from collections import Counter


def test_fetch_results_sum_across_ranks() -> None:
    from ascend_offload.connectors.store.metadata import StoreWorkerMetadata

    r0 = StoreWorkerMetadata(done=Counter({1: 1}), fetched=Counter({7: 1}))
    r1 = StoreWorkerMetadata(done=Counter({1: 1}), fetch_failed=Counter({7: 1}),
                             fetch_unsafe=Counter({7: 1}))
    both = r0.aggregate(r1)
    assert isinstance(both, StoreWorkerMetadata)
    assert both.done == Counter({1: 2})
    assert both.fetched == Counter({7: 1}) and both.fetch_failed == Counter({7: 1})
    assert both.fetch_unsafe == Counter({7: 1})
    assert not both.empty()
    assert StoreWorkerMetadata().empty()
    assert not StoreWorkerMetadata(fetch_failed=Counter({3: 1})).empty()
