"""The vllm-ascend NPU model runner adapter (our layerwise layout in its allocation) and how
the integration attaches (plugin entry point, post-import hook).

Fakes: ``fake_vllm_ascend/vllm_ascend/worker/model_runner_v1.py`` mirrors vllm-ascend ``main``
at 182b75ea84ff13ece27b57391331ef8935410aea (``apply_layerwise_kv_cache_plan``,
``NPUModelRunner.initialize_kv_cache`` / ``initialize_kv_cache_tensors`` /
``_allocate_kv_cache_tensors``). ``KVCacheTensor`` below is the descriptor of the vLLM
that vllm-ascend targets (vLLM main cdc4824a: ``size`` + ``shared_by``).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ascend_offload.config import StoreConnectorConfig
from ascend_offload.connectors.kv_layout_hook import LayerwiseStartupError, plan_from_groups
from ascend_offload.integrations.vllm_ascend import runner

FAKE = Path(__file__).parent / "fake_vllm_ascend"

R, P, DI, SCHED_BS = 16, 8, 8, 8  # kv_lora_rank, rope, indexer dim, vLLM block size


# ------------------------------------------------------------------ the runner layout


@dataclasses.dataclass
class KVCacheTensor:
    """vLLM cdc4824a's descriptor as vllm-ascend main uses it: one allocation of ``size``
    bytes shared by the layers in ``shared_by``."""

    size: int
    shared_by: list[str]


MAINS = [f"model.layers.{i}.self_attn.attn" for i in range(6)]
INDEXERS = [f"model.layers.{i}.self_attn.indexer.k_cache" for i in range(6)]


def _groups() -> list[Any]:
    from vllm.v1.kv_cache_interface import (
        KVCacheGroupSpec,
        MLAAttentionSpec,
        SparseCacheRole,
        UniformTypeKVCacheSpecs,
    )

    main = MLAAttentionSpec(block_size=SCHED_BS, num_kv_heads=1, head_size=R + P,
                            dtype=torch.float32)
    idx = MLAAttentionSpec(block_size=SCHED_BS, num_kv_heads=1, head_size=DI,
                           dtype=torch.float32, cache_role=SparseCacheRole.INDEXER)
    specs = {**{n: main for n in MAINS}, **{n: idx for n in INDEXERS}}
    return [KVCacheGroupSpec(MAINS + INDEXERS, UniformTypeKVCacheSpecs.from_specs(specs))]


def _store_vcfg(layerwise: bool, path: str = "ascend_offload.connectors.store") -> Any:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector="AscendStoreConnector", kv_connector_module_path=path,
            kv_connector_extra_config={"use_layerwise": layerwise,
                                       "layerwise_num_shared_buffers": 2}),
        cache_config=SimpleNamespace(enable_prefix_caching=False),
        compilation_config=SimpleNamespace(cudagraph_mode=None),
        model_config=_model_config())


def _model_config() -> Any:
    return SimpleNamespace(hf_text_config=SimpleNamespace(
        num_hidden_layers=6, kv_lora_rank=R, qk_rope_head_dim=P))


def _npu_config(num_blocks: int = 10) -> Any:
    groups = _groups()
    spec = groups[0].kv_cache_spec.kv_cache_specs
    tensors = [KVCacheTensor(size=spec[n].page_size_bytes * num_blocks, shared_by=[n])
               for n in MAINS + INDEXERS]
    return SimpleNamespace(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)


def _partition(ptr_of: dict[str, int]) -> set[frozenset[str]]:
    by: dict[int, set[str]] = {}
    for name, ptr in ptr_of.items():
        by.setdefault(ptr, set()).add(name)
    return {frozenset(v) for v in by.values()}


def test_runner_allocation_follows_the_cpu_hook(va: Any) -> None:
    """The NPU runner's buffers alias exactly the layers vLLM's CPU allocator aliases after
    our engine-core rewrite, for the same cache groups and settings."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from ascend_offload.connectors.kv_layout_hook import rewrite_kv_cache_config

    mr = importlib.import_module("vllm_ascend.worker.model_runner_v1")
    vcfg = _store_vcfg(True)
    cfg = StoreConnectorConfig(use_layerwise=True, layerwise_num_shared_buffers=2)
    plan = plan_from_groups(_groups(), cfg, 6)

    lay = KVCacheLayout["LBHNC"]
    cpu_vcfg = SimpleNamespace(
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: lay,
                                     num_gpu_blocks_override=None,
                                     prefix_cache_retention_interval=None),
        attention_config=SimpleNamespace(hisparse_config=None))
    before = get_kv_cache_config_from_groups(cpu_vcfg, _groups(), 1 << 20)
    after = rewrite_kv_cache_config(cpu_vcfg, before, 1 << 20, plan)
    cpu = allocate_kv_cache(after, torch.device("cpu"), lay)
    cpu_parts = _partition({n: t.data_ptr() for n, t in cpu.items()})

    mr.ORIGINAL_PLAN_CALLS.clear()
    npu = mr.NPUModelRunner(vcfg, torch.device("cpu"))
    config = _npu_config()
    npu.initialize_kv_cache(config)
    assert not mr.ORIGINAL_PLAN_CALLS  # vllm-ascend's own plan did not run
    npu_parts = _partition({n: t[0].data_ptr() for n, t in npu.kv_caches.items()})
    assert npu_parts == cpu_parts == {frozenset(b.layers) for b in plan.buffers}
    assert len(npu_parts) < len(MAINS + INDEXERS)
    assert len(config.kv_cache_tensors) == len(MAINS + INDEXERS)  # the runner's deepcopy
    assert len(npu.kv_cache_config.kv_cache_tensors) == plan.num_physical


def test_runner_off_runs_vllm_ascend_plan(va: Any) -> None:
    mr = importlib.import_module("vllm_ascend.worker.model_runner_v1")
    for vcfg in (_store_vcfg(False), _store_vcfg(True, path="vllm_ascend.distributed.x"),
                 SimpleNamespace(kv_transfer_config=None, model_config=_model_config())):
        mr.ORIGINAL_PLAN_CALLS.clear()
        npu = mr.NPUModelRunner(vcfg, torch.device("cpu"))
        npu.initialize_kv_cache(_npu_config())
        assert len(mr.ORIGINAL_PLAN_CALLS) == 1
        assert len(_partition({n: t[0].data_ptr() for n, t in npu.kv_caches.items()})) == 12


def test_runner_refuses_what_sharing_cannot_do(va: Any) -> None:
    mr = importlib.import_module("vllm_ascend.worker.model_runner_v1")
    vcfg = _store_vcfg(True)
    vcfg.cache_config.enable_prefix_caching = True
    with pytest.raises(LayerwiseStartupError, match="enable_prefix_caching"):
        mr.NPUModelRunner(vcfg, torch.device("cpu")).initialize_kv_cache(_npu_config())
    config = _npu_config()
    config.kv_cache_tensors[1] = KVCacheTensor(size=1, shared_by=[MAINS[1]])
    with pytest.raises(LayerwiseStartupError, match="sizes differ"):
        mr.NPUModelRunner(_store_vcfg(True), torch.device("cpu")).initialize_kv_cache(config)


def test_vllm032_descriptors_are_checked_not_rewritten() -> None:
    """With vLLM 0.32 descriptors (``layers`` + offsets) the engine core aliased already."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from ascend_offload.connectors.kv_layout_hook import rewrite_kv_cache_config

    lay = KVCacheLayout["LBHNC"]
    cpu_vcfg = SimpleNamespace(
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: lay,
                                     num_gpu_blocks_override=None,
                                     prefix_cache_retention_interval=None),
        attention_config=SimpleNamespace(hisparse_config=None))
    plan = plan_from_groups(_groups(), StoreConnectorConfig(
        use_layerwise=True, layerwise_num_shared_buffers=2), 6)
    before = get_kv_cache_config_from_groups(cpu_vcfg, _groups(), 1 << 20)
    after = rewrite_kv_cache_config(cpu_vcfg, before, 1 << 20, plan)
    tensors = list(after.kv_cache_tensors)
    assert not runner.uses_shared_by(tensors)
    runner.apply_our_plan(after, _store_vcfg(True))
    assert after.kv_cache_tensors == tensors
    with pytest.raises(LayerwiseStartupError, match="did not run in the engine core"):
        runner.apply_our_plan(before, _store_vcfg(True))


def test_plugin_entry_point_registers_the_integration() -> None:
    """vLLM's general-plugin loading with vllm-ascend importable leaves the patches pending;
    vllm-ascend's own import of its SFA module applies them."""
    import os
    import subprocess

    code = (
        "import sys\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "print('LOADED', 'vllm_ascend.attention.sfa_v1' in sys.modules)\n"
        "from vllm_ascend.attention import sfa_v1\n"
        "from ascend_offload.integrations.vllm_ascend import sfa\n"
        "print('PATCHED', sfa._MARK in sfa_v1.AscendSFABackend.__dict__)\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(FAKE), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=False, env=env)
    assert "LOADED False" in proc.stdout and "PATCHED True" in proc.stdout, proc.stderr[-3000:]


def test_when_imported_runs_after_first_import(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import inspect

    from ascend_offload.integrations.vllm_ascend import _imports

    pkg = tmp_path / "ao_watch_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[Any] = []
    try:
        _imports.when_imported("ao_watch_pkg.mod", seen.append)
        assert not seen
        mod = importlib.import_module("ao_watch_pkg.mod")
        assert seen == [mod] and mod.VALUE == 1
        assert "VALUE = 1" in inspect.getsource(mod)  # the real loader still answers
        _imports.when_imported("ao_watch_pkg.mod", seen.append)  # loaded: at once
        assert seen == [mod, mod]
        _imports.when_imported("ao_watch_pkg.other", seen.append)
        _imports.forget("ao_watch_pkg.other")
        (pkg / "other.py").write_text("")
        importlib.import_module("ao_watch_pkg.other")
        assert len(seen) == 2
    finally:
        for name in ("ao_watch_pkg", "ao_watch_pkg.mod", "ao_watch_pkg.other"):
            sys.modules.pop(name, None)
