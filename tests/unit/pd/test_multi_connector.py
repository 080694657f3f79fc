"""AscendMultiConnector's start-up rules for pairing layer sharing with P/D reads.

The pairing itself (decode reads holding a shared buffer) runs end to end in
tests/e2e/test_pd_layerwise_e2e.py and, in both orders, tests/e2e/test_joint_sparse_e2e.py;
here, the configuration errors it refuses, and the lookup of a request a P/D producer
holds back (early dispatch) against a real store child and a real HTTP claim server.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")

from ascend_offload.config import ConfigError
from ascend_offload.connectors.multi import lookup_order, sharing_pair
from ascend_offload.connectors.store import AscendStoreConnector
from tests.unit.pd.test_claims import WAIT_S, ProxyStub, running_proxy


def test_no_pair_without_both_children() -> None:
    assert sharing_pair([], [1], [False, True]) is None
    assert sharing_pair([0], [], [False, True]) is None


def test_store_then_producer_is_paired() -> None:
    assert sharing_pair([0], [1], [False, True]) == (0, 1)


def test_producer_before_store_is_paired_too() -> None:
    assert sharing_pair([1], [0], [True, False]) == (1, 0)


def test_producer_must_publish_per_layer() -> None:
    with pytest.raises(ConfigError, match=r"connectors\[1\]\.kv_connector_extra_config\.use_layerwise"):
        sharing_pair([0], [1], [False, False])


def test_at_most_one_of_each() -> None:
    with pytest.raises(ConfigError, match="at most one"):
        sharing_pair([0, 1], [2], [False, False, True])


@pytest.fixture(name="proxy")
def _proxy() -> Iterator[ProxyStub]:
    yield from running_proxy()


def test_lookup_asks_a_deferring_child_first() -> None:
    assert lookup_order([False, True]) == [1, 0]
    assert lookup_order([False, False, True]) == [2, 0, 1]
    assert lookup_order([False, False]) == [0, 1]


@pytest.mark.parametrize("store_first", [True, False], ids=["store-first", "producer-first"])
def test_held_request_starts_no_store_load(proxy: ProxyStub, store_first: bool) -> None:
    """A layer-sharing-free prefill pairing (store + RD2H producer): while the producer
    holds an early-dispatched request back, the multi connector answers None and the store
    was not asked (no pin of the prefix it holds); once claimed, the store's offer wins."""
    from tests.unit.core.test_multi_order import BLOCK, _child, _hold, _multi, _request

    rd2h = {"kv_connector": "SfaRemoteD2HConnector", "kv_role": "kv_producer",
            "kv_connector_module_path": "ascend_offload.connectors.remote_d2h",
            "kv_connector_extra_config": {"host": "127.0.0.1", "claim_timeout_s": WAIT_S,
                                          "claim_in_worker": False}}
    multi = _multi([_child("s", 16), rd2h] if store_first else [rd2h, _child("s", 16)])
    try:
        store = next(c for c in multi.sub_connectors if isinstance(c, AscendStoreConnector))
        req = _request("r1", 6 * BLOCK + 5)
        _hold(store, req, 4)
        req.kv_transfer_params = {"do_remote_decode": True, "do_remote_prefill": False, "claim_url": proxy.url,
                                  "proxy_request_id": "x1", "claim_token": proxy.expect("x1")}
        assert multi.get_num_new_matched_tokens(req, 0) == (None, False)
        proxy.wait_calls(1)
        assert multi.get_num_new_matched_tokens(req, 0) == (None, False)
        assert store.scheduler.index.stats().pinned_objects == 0  # the store was not asked
        proxy.release("x1")
        deadline = time.monotonic() + WAIT_S
        while (got := multi.get_num_new_matched_tokens(req, 0))[0] is None:
            assert time.monotonic() < deadline, "claim still pending"
            time.sleep(0.01)
        assert got == (4 * BLOCK, False) and store.scheduler.index.stats().pinned_objects == 4
        assert req.kv_transfer_params["remote_request_id"] == "dec-1"
    finally:
        multi.shutdown()


@pytest.mark.parametrize("layerwise", [True, False])
def test_layer_sharing_holds_early_requests_for_the_schedulers_claim(layerwise: bool) -> None:
    """With a layer-sharing store beside it, the producer cannot compute before its decode's
    blocks are known (a shared buffer is published before reuse): claim_in_worker is off."""
    from ascend_offload.connectors.remote_d2h import SfaRemoteD2HConnector
    from tests.unit.core.test_multi_order import _child, _multi

    rd2h = {"kv_connector": "SfaRemoteD2HConnector", "kv_role": "kv_producer",
            "kv_connector_module_path": "ascend_offload.connectors.remote_d2h",
            "kv_connector_extra_config": {"host": "127.0.0.1"}}
    store = _child("s", 16)
    store["kv_connector_extra_config"]["use_layerwise"] = layerwise
    multi = _multi([store, rd2h])
    try:
        producer = next(c for c in multi.sub_connectors if isinstance(c, SfaRemoteD2HConnector))
        assert producer.cfg.claim_in_worker  # the default
        assert producer.scheduler is not None and producer.scheduler.prefill is not None
        assert producer.scheduler.prefill.claim_in_worker is not layerwise
    finally:
        multi.shutdown()
