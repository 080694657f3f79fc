"""AscendMultiConnector in any order: who loads a prefix, and the order children run in.

Real ``AscendStoreConnector`` children (scheduler role, their real store indices)
inside a real ``AscendMultiConnector``; only vLLM's config objects are reduced to
the fields the connectors read. Both children can claim the same prefix: exactly
one gets the load (the largest offer, ties in config order), the other drops its
offer (no pin left, no load job), and the result is the same with the children
listed either way. The layer-sharing pairing in both orders runs end to end in
tests/e2e/test_joint_sparse_e2e.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

from ascend_offload.connectors.multi import AscendMultiConnector, canonical_order, choose_loader
from ascend_offload.connectors.store import AscendStoreConnector

BLOCK = 16
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
SPEC = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=__import__("torch").float32)
PAGE = SPEC.page_size_bytes * len(LAYERS)
STORE = "ascend_offload.connectors.store"


def _child(tag: str, capacity_pages: int) -> dict[str, Any]:
    return {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both", "kv_connector_module_path": STORE,
            "kv_connector_extra_config": {"model_tag": tag, "local": {"capacity_bytes": capacity_pages * PAGE}}}


def _multi(children: list[dict[str, Any]]) -> AscendMultiConnector:
    tc = KVTransferConfig(kv_connector="AscendMultiConnector", kv_role="kv_both",
                          kv_connector_module_path="ascend_offload.connectors.multi",
                          kv_connector_extra_config={"connectors": children})
    vc = SimpleNamespace(
        kv_transfer_config=tc,
        cache_config=SimpleNamespace(block_size=BLOCK, enable_prefix_caching=False),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=True),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        model_config=SimpleNamespace(model="tiny"),
    )
    kcc = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS, SPEC)])
    return AscendMultiConnector(vc, KVConnectorRole.SCHEDULER, kcc)  # type: ignore[arg-type]


def _request(rid: str, n_tokens: int) -> Request:
    init_none_hash(sha256)
    return Request(rid, list(range(3, 3 + n_tokens)), SamplingParams(max_tokens=1), None,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


def _hold(store: AscendStoreConnector, request: Request, n_blocks: int) -> None:
    """Commit the request's first ``n_blocks`` objects in the child's store index."""
    sched = store.scheduler
    keys = sched._keys(request, n_blocks)
    handles = sched.index.allocate(keys, [PAGE] * n_blocks)
    assert handles is not None and all(h is not None for h in handles)
    sched.index.commit([h for h in handles if h is not None])


def _stores(multi: AscendMultiConnector) -> dict[str, AscendStoreConnector]:
    out = {}
    for c in multi.sub_connectors:
        assert isinstance(c, AscendStoreConnector)
        out[c.cfg.model_tag] = c
    return out


def _claim(children: list[dict[str, Any]], held: dict[str, int], n_tokens: int = 6 * BLOCK + 5
           ) -> tuple[int | None, dict[str, list[tuple[int, ...]]], dict[str, int]]:
    """Tokens the multi offers, each child's load jobs (pages) and pinned objects afterwards."""
    multi = _multi(children)
    stores = _stores(multi)
    req = _request("r1", n_tokens)
    for tag, n in held.items():
        _hold(stores[tag], req, n)
    toks, load_async = multi.get_num_new_matched_tokens(req, 0)
    assert load_async is False
    blocks = list(range(10, 10 + (n_tokens + BLOCK - 1) // BLOCK))
    multi.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (blocks,)), toks or 0)
    out = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={},
                          scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]))
    meta = multi.build_connector_meta(out)  # type: ignore[arg-type]
    loads: dict[str, list[tuple[int, ...]]] = {}
    for c, m in zip(multi.sub_connectors, meta.metadata, strict=True):
        assert isinstance(c, AscendStoreConnector)
        loads[c.cfg.model_tag] = [job.pages for job in m.loads]
    pinned = {tag: s.scheduler.index.stats().pinned_objects for tag, s in stores.items()}
    # Both children report their counts under one key: the request still finishes.
    async_save, params = multi.request_finished(req, blocks)
    assert async_save is False and params is not None and set(params) == {"ascend_store"}
    return toks, loads, pinned


def test_choose_loader_takes_the_largest_offer_then_delivery_then_first() -> None:
    assert choose_loader([0, 0], [False, False]) is None
    assert choose_loader([64, 128], [False, False]) == 1
    assert choose_loader([128, 64], [False, False]) == 0
    assert choose_loader([96, 96], [False, True]) == 1  # a P/D pull over a cache
    assert choose_loader([96, 96], [False, False]) == 0


def test_canonical_order_puts_the_slot_release_provider_first() -> None:
    assert canonical_order([False, True]) == [1, 0]
    assert canonical_order([True, False]) == [0, 1]
    assert canonical_order([False, False, True, False]) == [2, 0, 1, 3]


@pytest.mark.parametrize("swap", [False, True], ids=["small-first", "big-first"])
def test_two_stores_claim_one_prefix_the_larger_loads_in_either_order(swap: bool) -> None:
    children = [_child("small", 8), _child("big", 32)]
    if swap:
        children.reverse()
    toks, loads, pinned = _claim(children, {"small": 2, "big": 5})
    assert toks == 5 * BLOCK
    assert loads["small"] == [] and pinned["small"] == 0  # offered 2 blocks, told 0: offer dropped
    assert len(loads["big"]) == 1 and len(loads["big"][0]) == 5  # 5 pages = 5 * PAGE bytes
    assert pinned["big"] == 5  # pinned until the load job reports done


@pytest.mark.parametrize("swap", [False, True], ids=["a-first", "b-first"])
def test_equal_offers_exactly_one_loads(swap: bool) -> None:
    children = [_child("a", 16), _child("b", 16)]
    if swap:
        children.reverse()
    first = children[0]["kv_connector_extra_config"]["model_tag"]
    other = "b" if first == "a" else "a"
    toks, loads, pinned = _claim(children, {"a": 4, "b": 4})
    assert toks == 4 * BLOCK
    assert [len(p) for p in loads[first]] == [4] and pinned[first] == 4
    assert loads[other] == [] and pinned[other] == 0


def test_nobody_holds_it_nobody_loads() -> None:
    toks, loads, pinned = _claim([_child("a", 16), _child("b", 16)], {})
    assert toks == 0 and loads == {"a": [], "b": []} and pinned == {"a": 0, "b": 0}
