"""The sparse decode cut with vLLM's own planner and allocator: no main KV on the device,
indexer blocks over the memory left after the hot buffers, hot regions that vLLM's views
of the main-KV layers point into; when it applies and what it refuses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from ascend_offload.config import ConfigError, SparseOffloadConfig  # noqa: E402
from ascend_offload.connectors.ours import our_connectors  # noqa: E402
from ascend_offload.connectors.sparse_decode.kv_cut import (  # noqa: E402
    cut_facts,
    cut_kv_cache_config,
    device_kv_bytes,
    hot_buffer_view,
    is_cut,
    sparse_decode_settings,
)

BLOCK, LAYERS, MAIN, INDEX, SEQS, HOT = 16, 3, 80, 32, 4, 64
MAINS = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
INDEXERS = [f"model.layers.{i}.self_attn.indexer.k_cache" for i in range(LAYERS)]


def _vcfg(prefix: bool = False, kvt: object = None) -> SimpleNamespace:
    return SimpleNamespace(
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: KVCacheLayout["LBNHC"],
                                     num_gpu_blocks_override=None, block_size=BLOCK,
                                     prefix_cache_retention_interval=None,
                                     enable_prefix_caching=prefix),
        attention_config=SimpleNamespace(hisparse_config=None),
        scheduler_config=SimpleNamespace(max_num_seqs=SEQS), kv_transfer_config=kvt)


def _groups(with_indexer: bool = True) -> list[KVCacheGroupSpec]:
    def spec(head: int, role: SparseCacheRole) -> MLAAttentionSpec:
        return MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=head, dtype=torch.float32,
                                cache_role=role)

    specs = {n: spec(MAIN, SparseCacheRole.SPARSE) for n in MAINS}
    if with_indexer:
        specs.update({n: spec(INDEX, SparseCacheRole.INDEXER) for n in INDEXERS})
    return [KVCacheGroupSpec(list(specs), UniformTypeKVCacheSpecs(block_size=BLOCK, kv_cache_specs=specs))]


CFG = SparseOffloadConfig(enabled=True, topk_buffer_size=HOT, index_topk=32)


@pytest.mark.parametrize("mem", [8 << 20, 256 << 20])
def test_cut_keeps_indexer_blocks_and_hot_regions_only(mem: int) -> None:
    vcfg, groups = _vcfg(), _groups()
    before = get_kv_cache_config_from_groups(vcfg, groups, mem)
    after = cut_kv_cache_config(vcfg, before, mem, CFG)
    hot = SEQS * HOT * MAIN * 4
    # the main KV's bytes became indexer blocks (less the hot buffers and the views' slack)
    per_block = LAYERS * INDEX * 4 * BLOCK
    assert (mem - LAYERS * hot) // per_block - 64 <= after.num_blocks <= (mem - LAYERS * hot) // per_block
    assert after.num_blocks > 3 * before.num_blocks
    # with many blocks vLLM's overlapping main-KV views outgrow a hot region: the slack
    # they need is added once, not per layer
    span = (after.num_blocks - 1) * 4 + MAIN * 4 * BLOCK
    slack = after.kv_cache_tensors[0].size - (after.kv_cache_tensors[-1].offset + hot)
    assert slack == max(0, -(-(span - hot) // 4096) * 4096)
    assert after.kv_cache_groups == before.kv_cache_groups  # block tables stay vLLM's
    facts = cut_facts(after)
    assert facts is not None and list(facts.layers) == MAINS and facts.row_bytes == MAIN * 4
    bytes_ = device_kv_bytes(after)
    assert bytes_["main"] == LAYERS * facts.region_bytes and facts.region_bytes == hot
    assert device_kv_bytes(before)["main"] == LAYERS * MAIN * 4 * BLOCK * before.num_blocks
    assert bytes_["total"] <= mem
    kv = allocate_kv_cache(after, torch.device("cpu"), KVCacheLayout["LBNHC"])
    rows = SEQS * HOT
    hots = [hot_buffer_view(kv[n], rows) for n in MAINS]
    for n in MAINS:
        assert is_cut(kv[n]) and kv[n].shape[0] == after.num_blocks
    for n in INDEXERS:
        assert not is_cut(kv[n]) and kv[n].shape[0] == after.num_blocks
    # hot regions and indexer blocks never overlap
    for i, h in enumerate(hots):
        h.fill_(float(i + 1))
    for n in INDEXERS:
        assert not kv[n].any()
    for i, h in enumerate(hots):
        assert torch.all(h == float(i + 1))


def test_cut_refusals_name_the_key() -> None:
    mem = 8 << 20
    before = get_kv_cache_config_from_groups(_vcfg(), _groups(with_indexer=False), mem)
    with pytest.raises(ConfigError, match="no indexer cache"):
        cut_kv_cache_config(_vcfg(), before, mem, CFG)
    before = get_kv_cache_config_from_groups(_vcfg(), _groups(), mem)
    big = SparseOffloadConfig(enabled=True, topk_buffer_size=HOT * 256, index_topk=32)
    with pytest.raises(ConfigError, match="topk_buffer_size"):
        cut_kv_cache_config(_vcfg(), before, mem, big)
    from ascend_offload.connectors.sparse_decode.kv_cut import cut_kv_cache_configs

    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        cut_kv_cache_configs(_vcfg(prefix=True), [before], [mem], CFG)
    with pytest.raises(ConfigError, match="allocated main KV on the device"):
        hot_buffer_view(allocate_kv_cache(before, torch.device("cpu"), KVCacheLayout["LBNHC"])[MAINS[0]],
                        SEQS * HOT)


def _kvt(connector: str, role: str, extra: dict, path: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(kv_connector=connector, kv_role=role, kv_connector_extra_config=extra,
                           kv_connector_module_path=path)


def test_cut_applies_only_to_our_sparse_decode_connectors() -> None:
    from ascend_offload.plugin import register

    register()  # what vLLM's plugin loader does in every process: our names resolve to us
    on = {"sparse_offload": {"enabled": True}}
    assert sparse_decode_settings(_vcfg(kvt=_kvt("AscendSparseDecodeConnector", "kv_both", on)))
    assert sparse_decode_settings(_vcfg(kvt=_kvt("AscendSparseDecodeConnector", "kv_both", {}))) is None
    rd2h = "ascend_offload.connectors.remote_d2h"
    assert sparse_decode_settings(_vcfg(kvt=_kvt("SfaRemoteD2HConnector", "kv_consumer", on, rd2h)))
    assert sparse_decode_settings(_vcfg(kvt=_kvt("SfaRemoteD2HConnector", "kv_producer", on, rd2h))) is None
    # another package's connector of the same name: its keys are not ours to parse
    theirs = _kvt("SfaRemoteD2HConnector", "kv_consumer", {"whatever": 1}, "vllm_ascend.x")
    assert sparse_decode_settings(_vcfg(kvt=theirs)) is None
    multi = _kvt("MultiConnector", "kv_consumer", {"connectors": [
        {"kv_connector": "OtherConnector", "kv_connector_module_path": "elsewhere"},
        {"kv_connector": "SfaRemoteD2HConnector", "kv_connector_module_path": rd2h,
         "kv_connector_extra_config": on}]})
    assert [n for n, _, _ in our_connectors(_vcfg(kvt=multi))] == ["SfaRemoteD2HConnector"]
    assert sparse_decode_settings(_vcfg(kvt=multi))
