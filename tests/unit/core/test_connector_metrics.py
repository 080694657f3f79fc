from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from ascend_offload.connectors.metrics import CounterDeltas, StoreConnectorStats


def test_deltas_and_aggregate() -> None:
    d = CounterDeltas(StoreConnectorStats)
    first = d.take({"saved_blocks": 3, "loaded_blocks": 0})
    assert first is not None and first.data == {"saved_blocks": 3}
    assert d.take({"saved_blocks": 3, "loaded_blocks": 0}) is None
    second = d.take({"saved_blocks": 5, "loaded_blocks": 2})
    assert second is not None and second.data == {"saved_blocks": 2, "loaded_blocks": 2}
    agg = first.aggregate(second)
    assert isinstance(agg, StoreConnectorStats)
    assert agg.reduce() == {"saved_blocks": 5, "loaded_blocks": 2}
    assert not agg.is_empty() and StoreConnectorStats().is_empty()


def test_every_connector_class_builds_its_own_stats_and_metrics() -> None:
    """vLLM keys connector stats by class: each connector answers with its own."""
    from ascend_offload.connectors.metrics import RD2HConnectorStats
    from ascend_offload.connectors.remote_d2h import SfaRemoteD2HConnector
    from ascend_offload.connectors.sparse_decode.connector import AscendSparseDecodeConnector
    from ascend_offload.connectors.sparse_decode.metrics import SparseDecodeStats
    from ascend_offload.connectors.store import AscendStoreConnector

    for cls, stats in ((AscendStoreConnector, StoreConnectorStats),
                       (SfaRemoteD2HConnector, RD2HConnectorStats),
                       (AscendSparseDecodeConnector, SparseDecodeStats)):
        built = cls.build_kv_connector_stats({"x": 1})
        assert type(built) is stats and built.data == {"x": 1}
        assert type(built.aggregate(stats(data={"x": 2}))) is stats


def test_gauges_keep_the_latest_value_counters_sum() -> None:
    from ascend_offload.connectors.sparse_decode.metrics import SparseDecodeStats

    a = SparseDecodeStats(data={"miss_rows": 3, "pool_rows_used": 10})
    b = SparseDecodeStats(data={"miss_rows": 4, "pool_rows_used": 7})
    assert a.aggregate(b).data == {"miss_rows": 7, "pool_rows_used": 7}
