"""Layout hook logic that needs no engine: when it applies, what it refuses, how it plans."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from ascend_offload.config import ConfigError
from ascend_offload.connectors import kv_layout_hook as layout
from ascend_offload.connectors.kv_layout_hook import (
    LayerwiseStartupError,
    check_engine_constraints,
    layer_specs_from_groups,
    layerwise_settings,
    plan_from_groups,
)


@pytest.fixture(autouse=True)
def _registered() -> None:
    """What vLLM's plugin loader does in every process: our connector names resolve to us."""
    from ascend_offload.plugin import register

    register()


def _vcfg(connector: str | None, extra: dict | None = None, **cache: object) -> SimpleNamespace:
    kvt = None if connector is None else SimpleNamespace(
        kv_connector=connector, kv_connector_extra_config=extra or {}
    )
    return SimpleNamespace(
        kv_transfer_config=kvt,
        cache_config=SimpleNamespace(enable_prefix_caching=cache.get("prefix", False)),
        compilation_config=SimpleNamespace(cudagraph_mode=cache.get("mode")),
    )


def test_settings_only_for_layerwise_store() -> None:
    assert layerwise_settings(_vcfg(None)) is None
    assert layerwise_settings(_vcfg("NixlConnector", {"x": 1})) is None
    assert layerwise_settings(_vcfg("AscendStoreConnector", {})) is None  # whole-prefix mode
    cfg = layerwise_settings(_vcfg("AscendStoreConnector", {
        "use_layerwise": True, "layerwise_num_shared_buffers": 3}))
    assert cfg is not None and cfg.layerwise_num_shared_buffers == 3


def test_settings_inside_multi_connector() -> None:
    extra = {"connectors": [
        {"kv_connector": "SfaRemoteD2HConnector", "kv_connector_extra_config": {}},
        {"kv_connector": "AscendStoreConnector",
         "kv_connector_extra_config": {"use_layerwise": True, "layerwise_independent_layers": "all"}},
    ]}
    for multi in ("AscendMultiConnector", "MultiConnector"):
        cfg = layerwise_settings(_vcfg(multi, extra))
        assert cfg is not None and cfg.layerwise_independent_layers == "all"


def test_bad_store_config_fails_by_key() -> None:
    with pytest.raises(ConfigError, match="layerwise_num_shared_buffers"):
        layerwise_settings(_vcfg("AscendStoreConnector", {
            "use_layerwise": True, "layerwise_num_shared_buffers": 0}))


class _Mode:
    def __init__(self, full: bool) -> None:
        self.full = full
        self.name = "FULL_AND_PIECEWISE" if full else "PIECEWISE"

    def has_full_cudagraphs(self) -> bool:
        return self.full


def test_engine_constraints() -> None:
    check_engine_constraints(_vcfg("AscendStoreConnector"))
    check_engine_constraints(_vcfg("AscendStoreConnector", mode=_Mode(False)))
    with pytest.raises(LayerwiseStartupError, match="enable_prefix_caching"):
        check_engine_constraints(_vcfg("AscendStoreConnector", prefix=True))
    with pytest.raises(LayerwiseStartupError, match="cudagraph_mode=FULL_AND_PIECEWISE"):
        check_engine_constraints(_vcfg("AscendStoreConnector", mode=_Mode(True)))


@dataclasses.dataclass(frozen=True)
class _Spec:
    kind: str
    page_size_bytes: int


def _group(names: list[str], spec: object) -> SimpleNamespace:
    return SimpleNamespace(layer_names=names, kv_cache_spec=spec)


def test_specs_from_groups_order_mtp_and_indexer() -> None:
    full = _Spec("full", 1152)
    idx = _Spec("idx", 256)
    names = [f"model.layers.{i}.self_attn.attn" for i in (10, 2, 0, 1, 3)]
    groups = [
        _group(names, full),
        _group([f"model.layers.{i}.self_attn.indexer.k_cache" for i in (0, 1, 2, 3, 10)], idx),
    ]
    specs = layer_specs_from_groups(groups, num_hidden_layers=4)
    mains = [s for s in specs if s.follows is None]
    assert [s.name for s in mains] == [f"model.layers.{i}.self_attn.attn" for i in (0, 1, 2, 3, 10)]
    assert [s.mtp for s in mains] == [False, False, False, False, True]
    f = {s.name: s.follows for s in specs if s.follows}
    assert f["model.layers.2.self_attn.indexer.k_cache"] == "model.layers.2.self_attn.attn"
    cfg = layerwise_settings(_vcfg("AscendStoreConnector", {
        "use_layerwise": True, "layerwise_num_shared_buffers": 1,
        "layerwise_independent_layers": [0, -1]}))
    assert cfg is not None
    plan = plan_from_groups(groups, cfg, num_hidden_layers=4)
    assert plan.num_main_physical == 3  # layer 0, the MTP layer, one shared
    assert plan.num_physical == 6  # each main slot has its indexer buffer
    assert plan.footprint_ratio() == pytest.approx(3 / 5)


def test_plan_for_engine_matches_hook_inputs() -> None:
    groups = [_group([f"model.layers.{i}.attn" for i in range(5)], _Spec("full", 64))]
    kvc = SimpleNamespace(kv_cache_groups=groups)
    vcfg = _vcfg("AscendStoreConnector", {"use_layerwise": True, "layerwise_num_shared_buffers": 1,
                                          "layerwise_independent_layers": [-1]})
    vcfg.model_config = SimpleNamespace(hf_text_config=SimpleNamespace(num_hidden_layers=4))
    plan = layout.plan_for_engine(vcfg, kvc)
    assert plan is not None
    assert plan.layers[-1] == "model.layers.4.attn"  # the MTP layer, independent via -1
    assert plan.independent == frozenset({"model.layers.4.attn"})
    assert plan.num_physical == 2
    assert layout.plan_for_engine(_vcfg(None), kvc) is None


def test_uniform_type_specs_per_layer() -> None:
    a, b = _Spec("a", 100), _Spec("b", 200)
    spec = SimpleNamespace(kv_cache_specs={"l.0.attn": a, "l.1.attn": b, "l.2.attn": a})
    specs = layer_specs_from_groups([_group(["l.0.attn", "l.1.attn", "l.2.attn"], spec)])
    assert [s.nbytes for s in specs] == [100, 200, 100]
    assert specs[0].compat != specs[1].compat and specs[0].compat == specs[2].compat


def test_install_is_idempotent_and_reversible() -> None:
    core = pytest.importorskip("vllm.v1.engine.core")
    before = core.get_kv_cache_configs  # as this process has it (the plugin may have hooked it)
    layout.uninstall_layout_hook()
    original = core.get_kv_cache_configs
    try:
        layout.install_layout_hook()
        wrapped = core.get_kv_cache_configs
        assert wrapped is not original
        layout.install_layout_hook()
        assert core.get_kv_cache_configs is wrapped
        layout.uninstall_layout_hook()
        assert core.get_kv_cache_configs is original
    finally:
        # what the process had before: an engine a later test starts in-process needs the hook
        core.get_kv_cache_configs = before


def test_wrapper_off_is_identity_on_checks_constraints() -> None:
    sentinel = [object()]
    wrapped = layout._wrap(lambda *a: sentinel)
    assert wrapped(_vcfg(None), [], []) is sentinel
    assert wrapped(_vcfg("AscendStoreConnector", {"use_layerwise": False}), [], []) is sentinel
    with pytest.raises(LayerwiseStartupError, match="enable_prefix_caching"):
        wrapped(_vcfg("AscendStoreConnector", {"use_layerwise": True}, prefix=True), [], [])


def test_plugin_entry_point_installs_the_hook() -> None:
    """vLLM's general-plugin loading (every vLLM process) ends with the hook installed."""
    pytest.importorskip("vllm")
    import subprocess
    import sys

    code = (
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "import vllm.v1.engine.core as core\n"
        "from ascend_offload.connectors import kv_layout_hook as layout\n"
        "print('HOOKED', getattr(core.get_kv_cache_configs, layout._MARK, None) is not None)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=False)
    assert "HOOKED True" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("layout_name", ["LBHNC", "BLHNC", "LBNHC"])
def test_rewrite_with_vllm_allocator_hybrid_groups(layout_name: str) -> None:
    """vLLM's own planner + allocator on a rewritten config: slot layers share memory,
    num_blocks grows by the saved pages, for layer- and block-outermost layouts."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from ascend_offload.config import StoreConnectorConfig
    from ascend_offload.connectors.kv_layout_hook import rewrite_kv_cache_config

    lay = KVCacheLayout[layout_name]
    vcfg = SimpleNamespace(
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: lay,
                                     num_gpu_blocks_override=None,
                                     prefix_cache_retention_interval=None),
        attention_config=SimpleNamespace(hisparse_config=None),
    )
    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=16, dtype=torch.float32)
    swa = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=16, dtype=torch.float32,
                            sliding_window=64)
    groups = [
        KVCacheGroupSpec([f"model.layers.{i}.attn" for i in (0, 2, 4, 6, 8, 10)], full),
        KVCacheGroupSpec([f"model.layers.{i}.attn" for i in (1, 3, 5, 7, 9, 11)], swa),
    ]
    mem = 6 << 20
    before = get_kv_cache_config_from_groups(vcfg, groups, mem)
    cfg = StoreConnectorConfig(use_layerwise=True, layerwise_num_shared_buffers=2)
    plan = plan_from_groups(groups, cfg)
    # full: layer 0 independent + 2 shared slots; sliding: 2 shared slots
    assert plan.num_physical == 5
    after = rewrite_kv_cache_config(vcfg, before, mem, plan)
    # vLLM overlays groups, so a block costs the largest group's pages: 6 -> 3
    assert after.num_blocks == before.num_blocks * 2
    assert after.kv_cache_groups == before.kv_cache_groups
    kv = allocate_kv_cache(after, torch.device("cpu"), lay)
    assert set(kv) == {n for g in groups for n in g.layer_names}
    for buf in plan.buffers:
        assert len({kv[n].data_ptr() for n in buf.layers}) == 1
        assert all(kv[n].shape[0] == after.num_blocks for n in buf.layers)
    # slots of one group never overlap
    for g in groups:
        slots = {plan.slot_of[n] for n in g.layer_names}
        reps = [kv[plan.buffers[s].layers[0]] for s in slots]
        for i, a in enumerate(reps):
            for b in reps[i + 1:]:
                a[0].fill_(1.0)
                b[0].fill_(2.0)
                assert torch.all(a[0] == 1.0)
