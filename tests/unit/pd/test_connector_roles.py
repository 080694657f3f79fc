"""SfaRemoteD2HConnector carries only its role's state: the scheduler process gets the
scheduler bookkeeping, a decode rank the decode worker, a prefill rank the prefill worker
(kv_both: both workers over one KV region)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from ascend_offload.connectors.remote_d2h import SfaRemoteD2HConnector
from ascend_offload.pd.decode_requests import DecodeRequests
from ascend_offload.pd.prefill_requests import PrefillRequests


def _config(producer: bool, consumer: bool):
    tc = SimpleNamespace(kv_connector_extra_config={"host": "127.0.0.1"}, is_kv_producer=producer,
                         is_kv_consumer=consumer, engine_id="E0", kv_port=1)
    return SimpleNamespace(kv_transfer_config=tc, cache_config=SimpleNamespace(block_size=16),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_rank=0),
                           model_config=SimpleNamespace(use_mla=False))


@pytest.mark.parametrize(("producer", "consumer"), [(True, False), (False, True), (True, True)])
def test_each_process_holds_only_its_roles(monkeypatch, producer: bool, consumer: bool) -> None:
    monkeypatch.setattr("vllm.distributed.parallel_state.get_tensor_model_parallel_rank", lambda: 0)
    sched = SfaRemoteD2HConnector(_config(producer, consumer), KVConnectorRole.SCHEDULER)
    worker = SfaRemoteD2HConnector(_config(producer, consumer), KVConnectorRole.WORKER,
                                   SimpleNamespace(num_blocks=4, kv_cache_groups=[]))
    try:
        assert sched.decode is None and sched.prefill is None and sched.scheduler is not None
        assert isinstance(sched.scheduler.decode, DecodeRequests) is consumer
        assert isinstance(sched.scheduler.prefill, PrefillRequests) is producer
        assert worker.scheduler is None
        assert (worker.decode is not None) is consumer and (worker.prefill is not None) is producer
        assert worker.get_finished(set()) == (None, None)
        assert worker.get_block_ids_with_load_errors() == set()
    finally:
        sched.shutdown()
        worker.shutdown()
