"""Prefill-first in the connector's workers: a prefill rank whose send waits for its decode's
registration, and a decode rank pulling over real ZMQ (loopback engines, host KV).

The registration arrives during the forward, after it (the finished request's blocks
held, every layer then published at once), or never (expired: the blocks are freed,
nothing is published). Decode's KV must equal the prefill's blocks byte for byte.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from test_prefill_first import FakeFetcher
from test_rd2h_device_kv import D_BLOCKS, DST, NAMES, P_BLOCKS, SRC, _config, _Engines, _kv
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from ascend_offload.connectors.remote_d2h import SfaRemoteD2HConnector, kv_region
from ascend_offload.connectors.remote_d2h.metadata import RecvJob, RemoteD2HMetadata, SendJob
from ascend_offload.harness.servers import free_port
from ascend_offload.pd.prefill_first import AwaitingSends
from ascend_offload.pd.registration import DecodeRegistration
from ascend_offload.pd.registration_fetch import FetchFailed, FetchTicket
from tests.support.fake_device import installed

TICKET = FetchTicket(metaserver="http://127.0.0.1:9/v1/metaserver", proxy_request_id="px", registration_token="t")


def _until(pred: Any, what: str) -> None:
    end = time.monotonic() + 20  # a hang guard, not a timing threshold
    while not pred():
        assert time.monotonic() < end, what
        time.sleep(0.01)


@pytest.mark.parametrize("arrives", ["during", "after", "never"])
def test_registration_during_after_or_never(monkeypatch: pytest.MonkeyPatch, arrives: str) -> None:
    monkeypatch.setattr("vllm.distributed.parallel_state.get_tensor_model_parallel_rank", lambda: 0)
    src, dst = _kv(P_BLOCKS, seed=5), _kv(D_BLOCKS, seed=None)
    with installed() as fake:
        monkeypatch.setattr(kv_region, "_engine", _Engines(fake, device_memory=False))
        port = free_port()
        dec = SfaRemoteD2HConnector(_config(producer=False, port=port, layerwise=True),
                                    KVConnectorRole.WORKER, SimpleNamespace(num_blocks=D_BLOCKS, kv_cache_groups=[]))
        pre = SfaRemoteD2HConnector(_config(producer=True, port=port, layerwise=True),
                                    KVConnectorRole.WORKER, SimpleNamespace(num_blocks=P_BLOCKS, kv_cache_groups=[]))
        try:
            dec.register_kv_caches(dict(zip(NAMES, dst, strict=True)))
            pre.register_kv_caches(dict(zip(NAMES, src, strict=True)))
            assert dec.decode is not None and pre.prefill is not None
            fetcher = FakeFetcher()
            pre.prefill._awaiting = AwaitingSends(fetcher, wait_s=30.0)  # type: ignore[arg-type]
            reg = DecodeRegistration(remote_host="127.0.0.1", remote_port=port, remote_request_id="r1",
                                     remote_block_ids=list(DST))
            # the prefill's forward: the request's blocks (all of them, offset 0) and its ticket
            pre.prefill.apply(RemoteD2HMetadata(send=[SendJob("p1", "", tuple(SRC), "", 0, 0, 0, ticket=TICKET)]))
            assert "p1" in fetcher.submitted
            for i, n in enumerate(NAMES):
                if arrives == "during" and i == 1:
                    fetcher.results["p1"] = reg  # after layer 0 was written
                pre.prefill.save_kv_layer(n)
            pre.prefill.wait_for_save()
            # vLLM finished the request (max_tokens 1): its blocks are held, nothing freed yet
            assert pre.prefill.get_finished({"p1"}) == set()
            assert pre.prefill.gauges()["awaiting_registrations"] == (0 if arrives == "during" else 1)
            if arrives == "after":
                fetcher.results["p1"] = reg
            elif arrives == "never":
                fetcher.results["p1"] = FetchFailed("no registration within the deadline", expired=True)
            sent: set[str] = set()
            if arrives == "never":  # freed, nothing published
                _until(lambda: sent.update(pre.prefill.get_finished(set())) or "p1" in sent,
                       "prefill never freed p1")
                totals = pre.prefill.totals()
                assert totals["registrations_expired"] == 1 and totals["layers_published"] == 0
                return
            dec.decode.apply(RemoteD2HMetadata(recv=[RecvJob("r1", tuple(DST))]))
            received: set[str] = set()


            def step() -> bool:  # both engines keep stepping (vLLM: a held request keeps it stepping)
                sent.update(pre.prefill.get_finished(set()))
                received.update(dec.decode.get_finished(set())[1])
                return "r1" in received

            _until(step, "decode never received r1")
            _until(lambda: sent.update(pre.prefill.get_finished(set())) or "p1" in sent,
                   "prefill never freed p1")
            assert dec.decode.take_load_errors() == set()
            for d, s in zip(dst, src, strict=True):
                assert torch.equal(d[:, list(DST)], s[:, list(SRC)])
            totals = pre.prefill.totals()
            assert totals["registrations_fetched"] == 1 and totals["layers_published"] == len(NAMES)
            assert totals["registrations_held"] == (1 if arrives == "after" else 0)
            assert pre.prefill.gauges()["awaiting_registrations"] == 0
        finally:
            dec.shutdown()
            pre.shutdown()
