"""Our sparse decode connectors over vllm-ascend's KV allocation (main KV paged on the device).

On the vLLM vllm-ascend targets (``KVCacheTensor(size, shared_by)``), the integration
stands our engine-core cut down and marks the engine core's configs instead
(``integrations/vllm_ascend/registration.py``); the connectors then accept the
runner's ``(k_cache, v_cache)`` pairs. Here that vLLM is simulated the way
``test_vllm_ascend_runner.py`` does (its descriptor class) and the engine core's
``get_kv_cache_configs`` returns configs of vllm-ascend's spec classes (fake
``vllm_ascend/core/kv_cache_interface.py``); vLLM's own
``generate_scheduler_kv_cache_config`` gives the scheduler its collapsed copy.
The SFA decode then runs through the real ``AscendSparseDecodeConnector``.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from ascend_offload.config import ConfigError
from ascend_offload.connectors.sparse_decode import AscendSparseDecodeConnector
from ascend_offload.connectors.sparse_decode.scheduler import SparseDecodeMetadata
from ascend_offload.connectors.sparse_decode.settings import PagedMainKV, mark_paged_main_kv
from ascend_offload.harness.servers import free_port
from ascend_offload.integrations.vllm_ascend import registration
from ascend_offload.sparse.adapter import SparseDecodeAdapter
from tests.unit.integrations.conftest import FAKE, _drop_fake_modules
from tests.unit.integrations.test_vllm_ascend import (
    DI,
    KERNEL_BS,
    LAYERS,
    NUM_SCHED_BLOCKS,
    REQUESTS,
    SCHED_BS,
    TOPK,
    P,
    R,
    _hidden,
    _impl,
    _keys,
    _meta,
    _run,
    _steps,
)

HOT = 16
INDEXERS = [n.replace(".attn", ".indexer.k_cache") for n in LAYERS]
POOL_BLOCKS = 32
ROW_BYTES = (R + P) * 4  # float32 caches
MAX_TOKENS = 40


@dataclasses.dataclass
class KVCacheTensor:
    """The descriptor of the vLLM vllm-ascend main targets (``size`` + ``shared_by``)."""

    size: int
    shared_by: list[str]


def _vcfg(connector: str = "AscendSparseDecodeConnector",
          module_path: str = "ascend_offload.connectors.sparse_decode",
          role: str = "kv_both") -> SimpleNamespace:
    gb = POOL_BLOCKS * SCHED_BS * len(LAYERS) * ROW_BYTES / 2**30
    kvt = SimpleNamespace(
        kv_connector=connector, kv_connector_module_path=module_path, kv_role=role,
        kv_connector_extra_config={"sparse_offload": {
            "enabled": True, "topk_buffer_size": HOT, "index_topk": TOPK,
            "dram_size_per_dp_GB": gb}},
        is_kv_producer=False, is_kv_consumer=True, engine_id="D0", kv_port=0)
    hf = SimpleNamespace(architectures=["DeepseekV32ForCausalLM"], index_topk=TOPK,
                         kv_lora_rank=R, qk_rope_head_dim=P)
    vcfg = SimpleNamespace(
        kv_transfer_config=kvt,
        cache_config=SimpleNamespace(block_size=SCHED_BS, enable_prefix_caching=False),
        model_config=SimpleNamespace(model="m", hf_config=hf, use_mla=True, max_model_len=64),
        scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=2048), speculative_config=None,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_rank=0),
        compilation_config=SimpleNamespace(cudagraph_mode=None),
        additional_config={"sparse_kv_offload_config": {"enabled": False}})
    if connector == "SfaRemoteD2HConnector":
        kvt.kv_connector_extra_config["host"] = "127.0.0.1"
    return vcfg


def _worker_config(num_blocks: int = NUM_SCHED_BLOCKS, main_head: int = R + P) -> Any:
    """One worker's config as vllm-ascend's runner builds it: main MLA and SFA indexer layers
    in one group (shared block ids), one ``shared_by`` descriptor per layer."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, UniformTypeKVCacheSpecs
    from vllm_ascend.core.kv_cache_interface import (
        AscendMLAAttentionSpec,
        AscendSFAIndexerCacheSpec,
    )

    main = AscendMLAAttentionSpec(block_size=SCHED_BS, num_kv_heads=1, head_size=main_head,
                                  dtype=torch.float32)
    idx = AscendSFAIndexerCacheSpec(block_size=SCHED_BS, num_kv_heads=1, head_size=DI,
                                    dtype=torch.float32)
    specs: dict[str, Any] = {}
    for m, i in zip(LAYERS, INDEXERS, strict=True):
        specs[m], specs[i] = main, idx
    group = KVCacheGroupSpec(list(specs), UniformTypeKVCacheSpecs(block_size=SCHED_BS,
                                                                  kv_cache_specs=specs))
    tensors = [KVCacheTensor(s.page_size_bytes * num_blocks, [n]) for n, s in specs.items()]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors,  # type: ignore[arg-type]
                         kv_cache_groups=[group])


@pytest.fixture
def older_vllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The integration installed on a vLLM whose descriptors are ``shared_by`` (our cut stands
    down, the marker wraps the engine core's config function)."""
    import vllm.v1.engine.core as core
    import vllm.v1.kv_cache_interface as kvi

    from ascend_offload.connectors import kv_layout_hook
    from ascend_offload.integrations import vllm_ascend as integration

    monkeypatch.setattr(kvi, "KVCacheTensor", KVCacheTensor)
    monkeypatch.setattr(core, "get_kv_cache_configs",
                        lambda vllm_config, specs, mem: [_worker_config()])
    kv_layout_hook.uninstall_layout_hook()  # as loaded by the plugin: then install stands it down
    kv_layout_hook.install_layout_hook()
    _drop_fake_modules()
    monkeypatch.syspath_prepend(str(FAKE))
    importlib.invalidate_caches()
    monkeypatch.setattr("vllm.distributed.parallel_state.get_tensor_model_parallel_rank",
                        lambda: 0)
    monkeypatch.setattr("vllm.distributed.parallel_state.get_tensor_model_parallel_world_size",
                        lambda: 1)
    assert integration.install()
    yield integration
    integration.uninstall()
    _drop_fake_modules()


def _engine_configs(vcfg: Any) -> tuple[Any, Any]:
    """(worker config, scheduler config) as the engine core hands them out."""
    import vllm.v1.engine.core as core
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config

    (worker,) = core.get_kv_cache_configs(vcfg, None, [1 << 30])
    return worker, generate_scheduler_kv_cache_config([worker])


def _runner_caches(kernel_bs: int = KERNEL_BS
                   ) -> tuple[dict[str, tuple[torch.Tensor, ...]], list[tuple[torch.Tensor, ...]]]:
    """What vllm-ascend's runner registers ({main: (k_cache, v_cache), indexer: (k_cache,)})
    and, per layer, the tuple the SFA layer composes from the same tensors."""
    n = NUM_SCHED_BLOCKS * SCHED_BS // kernel_bs
    registered: dict[str, tuple[torch.Tensor, ...]] = {}
    composed = []
    for m, i in zip(LAYERS, INDEXERS, strict=True):
        k, v, ik = (torch.zeros(n, kernel_bs, 1, d) for d in (R, P, DI))
        registered[m], registered[i] = (k, v), (ik,)
        composed.append((k, v, ik))
    return registered, composed


def _run_connector(cls: type, conn: AscendSparseDecodeConnector,
                   caches: list[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
    """All steps through two layers of ``cls``, the connector fed its scheduler's metadata
    as the model runner does (bind, start_load_kv, forward, wait_for_save)."""
    impls = [_impl(cls, i) for i in range(len(LAYERS))]
    outs = []
    for s, step in enumerate(_steps()):
        new = {r: MAX_TOKENS for r, before, _ in step if before == 0}
        conn.bind_connector_metadata(SparseDecodeMetadata(new, _keys(step), ()))
        conn.start_load_kv(None)  # type: ignore[arg-type]
        meta = _meta(step)
        x = _hidden(s, meta.num_actual_tokens)
        for i, impl in enumerate(impls):
            out = torch.zeros(x.shape[0], impl.num_heads * R)
            impl.forward(LAYERS[i], x, caches[i], meta, out)
            outs.append(out)
        conn.wait_for_save()
        conn.clear_connector_metadata()
        if s == 0:
            for c in caches:  # the prompts' paged main KV is gone: only the pool has it
                c[0].zero_()
                c[1].zero_()
    return outs


def test_engine_core_marks_configs_and_both_roles_count_one_pool(older_vllm: Any) -> None:
    vcfg = _vcfg()
    worker_cfg, sched_cfg = _engine_configs(vcfg)
    # the scheduler's copy has one spec per group: main and indexer layers look alike there
    assert not hasattr(sched_cfg.kv_cache_groups[0].kv_cache_spec, "kv_cache_specs")
    facts = PagedMainKV(tuple(LAYERS), ROW_BYTES)
    assert sched_cfg.ascend_offload_sparse_paged == facts
    sched = AscendSparseDecodeConnector(vcfg, KVConnectorRole.SCHEDULER, sched_cfg)
    assert sched.settings is not None and sched.settings.paged
    assert sched.settings.layers == tuple(LAYERS) and sched.settings.pool_blocks == POOL_BLOCKS
    conn = AscendSparseDecodeConnector(vcfg, KVConnectorRole.WORKER, worker_cfg)
    registered, _ = _runner_caches()
    conn.register_kv_caches(registered)  # type: ignore[arg-type]
    assert conn.worker is not None
    mgr = conn.worker.manager
    assert mgr.pool.num_blocks == sched.settings.pool_blocks  # one ledger on both sides
    assert mgr.pool.row_bytes == ROW_BYTES and mgr.pool.kv.dtype == torch.float32
    assert isinstance(conn, SparseDecodeAdapter)
    assert [conn.sparse_layer_index(n) for n in LAYERS] == [0, 1]
    assert all(conn.sparse_layer_index(n) is None for n in INDEXERS)
    # hot buffers of our own on the caches' device, not aliasing the paged main KV
    hot = conn.hot_buffer(0)
    assert hot.device == registered[LAYERS[0]][0].device and hot.shape[-1] == R + P
    paged = {t.untyped_storage().data_ptr() for kv in registered.values() for t in kv}
    assert hot.untyped_storage().data_ptr() not in paged


def test_sfa_decode_runs_through_the_registered_connector(older_vllm: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """vllm-ascend's SFA layers, our impl, the real connector registered with the runner's
    caches: same outputs as vllm-ascend's paged path, every step, with the prompts' paged
    main KV wiped after prefill (decode rows read the host pool through the hot buffers)."""
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm_ascend.attention import sfa_v1

    vcfg = _vcfg()
    reference = _run(sfa_v1.AscendSFAImpl, None)
    worker_cfg, _ = _engine_configs(vcfg)
    conn = AscendSparseDecodeConnector(vcfg, KVConnectorRole.WORKER, worker_cfg)
    registered, composed = _runner_caches()
    conn.register_kv_caches(registered)  # type: ignore[arg-type]
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", conn)
    monkeypatch.setattr("vllm.config.get_current_vllm_config", lambda: vcfg)
    cls = sfa_v1.AscendSFABackend.get_impl_cls()
    got = _run_connector(cls, conn, composed)
    for a, b in zip(got, reference, strict=True):
        torch.testing.assert_close(a, b)
    assert conn.worker is not None
    st = conn.worker.manager.stats
    assert st.miss_rows > 0 and st.hits > 0  # hot rows were reused and refilled
    # every request's positions reached the pool (the wiped paged rows were served from it)
    pool = conn.worker.manager.pool
    assert sorted(pool.admitted()) == sorted(REQUESTS)
    stats = conn.get_kv_connector_stats()
    assert stats is not None and stats.data["resolved_positions"] > 0


def test_paged_rows_must_match_the_scheduler_row(older_vllm: Any) -> None:
    vcfg = _vcfg()
    worker_cfg, _ = _engine_configs(vcfg)
    conn = AscendSparseDecodeConnector(vcfg, KVConnectorRole.WORKER, worker_cfg)
    registered, _ = _runner_caches()
    k, v = registered[LAYERS[0]]
    for bad, why in (({LAYERS[0]: k}, r"is a \(k_cache, v_cache\) pair"),
                     ({LAYERS[0]: (k.half(), v.half())}, "one host pool needs one row"),
                     ({n: (registered[n][0].half(), registered[n][1].half()) for n in LAYERS},
                      "the roles disagree")):
        with pytest.raises(ConfigError, match=why):
            conn.register_kv_caches({**registered, **bad})  # type: ignore[arg-type]


def test_engine_core_refuses_main_rows_the_pool_cannot_hold(older_vllm: Any) -> None:
    vcfg = _vcfg()
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        registration.mark_configs(vcfg, [_worker_config(main_head=R + P + 4)])
    vcfg.model_config.hf_config = SimpleNamespace(architectures=["X"], index_topk=TOPK)
    with pytest.raises(ConfigError, match="no MLA latent"):
        registration.mark_configs(vcfg, [_worker_config()])


def _uncut_config(*, paged_facts: bool) -> SimpleNamespace:
    cfg = SimpleNamespace(num_blocks=NUM_SCHED_BLOCKS, kv_cache_tensors=[object()],
                          kv_cache_groups=[SimpleNamespace(layer_names=[*LAYERS, *INDEXERS])])
    if paged_facts:
        mark_paged_main_kv(cfg, PagedMainKV(tuple(LAYERS), ROW_BYTES))
    return cfg


def test_uncut_config_refused_outside_vllm_ascend() -> None:
    """Without the integration (our own CPU/GPU path) an uncut config is refused, even one
    carrying paged facts: there our engine core cuts, or the plugin is missing."""
    from ascend_offload.connectors.remote_d2h import SfaRemoteD2HConnector
    from ascend_offload.integrations import vllm_ascend as integration

    assert not integration._state["installed"]
    for cfg in (_uncut_config(paged_facts=True), _uncut_config(paged_facts=False)):
        with pytest.raises(ConfigError, match="was not cut"):
            AscendSparseDecodeConnector(_vcfg(), KVConnectorRole.SCHEDULER, cfg)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="was not cut"):
            SfaRemoteD2HConnector(_vcfg("SfaRemoteD2HConnector",  # type: ignore[arg-type]
                                        "ascend_offload.connectors.remote_d2h", "kv_consumer"),
                                  KVConnectorRole.SCHEDULER, cfg)  # type: ignore[arg-type]


def test_installed_integration_refuses_a_config_its_engine_core_did_not_mark(
        older_vllm: Any) -> None:
    with pytest.raises(ConfigError, match="was not cut"):
        AscendSparseDecodeConnector(_vcfg(), KVConnectorRole.SCHEDULER,  # type: ignore[arg-type]
                                    _uncut_config(paged_facts=False))
    older_vllm.uninstall()  # uninstalled: the same marked config is refused again
    with pytest.raises(ConfigError, match="was not cut"):
        AscendSparseDecodeConnector(_vcfg(), KVConnectorRole.SCHEDULER,  # type: ignore[arg-type]
                                    _uncut_config(paged_facts=True))
    assert older_vllm.install()


def test_remote_d2h_decode_registers_vllm_ascend_caches(older_vllm: Any) -> None:
    """SfaRemoteD2HConnector as sparse decode (kv_consumer): the runner's pairs for the host
    pool (same ledger as its scheduler), the indexer tensors as the wire's device blocks."""
    pytest.importorskip("mooncake.engine")
    from ascend_offload.connectors.remote_d2h import SfaRemoteD2HConnector

    vcfg = _vcfg("SfaRemoteD2HConnector", "ascend_offload.connectors.remote_d2h", "kv_consumer")
    vcfg.kv_transfer_config.kv_port = free_port()
    worker_cfg, sched_cfg = _engine_configs(vcfg)
    sched = SfaRemoteD2HConnector(vcfg, KVConnectorRole.SCHEDULER, sched_cfg)  # type: ignore[arg-type]
    assert sched.sparse_settings is not None and sched.sparse_settings.paged
    conn = SfaRemoteD2HConnector(vcfg, KVConnectorRole.WORKER, worker_cfg)  # type: ignore[arg-type]
    registered, _ = _runner_caches(kernel_bs=SCHED_BS)  # wire blocks are vLLM blocks
    try:
        conn.register_kv_caches(registered)  # type: ignore[arg-type]
        assert conn.decode is not None and conn.decode.pool is not None
        assert conn.decode.pool.num_blocks == sched.sparse_settings.pool_blocks == POOL_BLOCKS
        assert [conn.sparse_layer_index(n) for n in LAYERS] == [0, 1]
        assert conn.sparse_layer_index(INDEXERS[0]) is None
        assert conn._region is not None and len(conn._region.layers) == len(LAYERS)
    finally:
        conn.shutdown()
