from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from ascend_offload.connectors.metrics import CounterDeltas, StoreConnectorStats


def test_deltas_and_aggregate() -> None:
    d = CounterDeltas()
    first = d.take({"saved_blocks": 3, "loaded_blocks": 0})
    assert first is not None and first.data == {"saved_blocks": 3}
    assert d.take({"saved_blocks": 3, "loaded_blocks": 0}) is None
    second = d.take({"saved_blocks": 5, "loaded_blocks": 2})
    assert second is not None and second.data == {"saved_blocks": 2, "loaded_blocks": 2}
    agg = first.aggregate(second)
    assert isinstance(agg, StoreConnectorStats)
    assert agg.reduce() == {"saved_blocks": 5, "loaded_blocks": 2}
    assert not agg.is_empty() and StoreConnectorStats().is_empty()
