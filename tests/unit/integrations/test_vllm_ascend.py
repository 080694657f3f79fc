"""The vllm-ascend SFA decode adapter against fakes shaped like vllm-ascend's classes
(the runner layout and the attachment: test_vllm_ascend_runner.py).

The fakes (``fake_vllm_ascend/vllm_ascend/``) mirror vllm-ascend ``main`` at
182b75ea84ff13ece27b57391331ef8935410aea (2026-08-22):
``attention/sfa_v1.py`` (``AscendSFABackend``, ``AscendSFAMetadata``, ``AscendSFAImpl``,
``PreprocessType``), ``attention/sfa_kv_offload.py`` (``AscendSFAKVOffloadImpl``),
``device/device_op.py`` (``DeviceOperator``, a torch reference of the sparse flash
attention kernel), ``distributed/kv_transfer/sparse_kv_offload/sparse_kv_offload_manager.py``
(vllm-ascend's own manager, a recorder) and ``worker/model_runner_v1.py``
(``apply_layerwise_kv_cache_plan``, ``NPUModelRunner`` allocation).

The offload side is the real one: ``ColocatedSparseDecode`` over a CPU
``SparseOffloadManager``, wrapped in a recorder.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ascend_offload.config import ConfigError, SparseOffloadConfig
from ascend_offload.connectors.ours import connector_is_ours
from ascend_offload.integrations.vllm_ascend import runner, settings, sfa
from ascend_offload.sparse.adapter import BatchRow, SparseStepPlan
from ascend_offload.sparse.colocated import ColocatedSparseDecode
from ascend_offload.sparse.manager import SparseOffloadManager

R, P, DI, H, TOPK, HOT = 16, 8, 8, 2, 8, 16  # kv_lora_rank, rope, indexer dim, heads, top-k, hot
SCHED_BS, KERNEL_BS = 8, 4  # vLLM block size; SFA kernel block size (vllm-ascend splits blocks)
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]


def _vcfg(*, ours: bool = True, theirs: bool = False, connector: str = "AscendSparseDecodeConnector",
          module_path: str | None = "ascend_offload.connectors.sparse_decode",
          mode: Any = None) -> SimpleNamespace:
    kvt = SimpleNamespace(
        kv_connector=connector, kv_connector_module_path=module_path,
        kv_connector_extra_config={"sparse_offload": {
            "enabled": ours, "topk_buffer_size": HOT, "index_topk": TOPK}})
    return SimpleNamespace(
        kv_transfer_config=kvt, cache_config=SimpleNamespace(block_size=SCHED_BS),
        compilation_config=SimpleNamespace(cudagraph_mode=mode),
        additional_config={"sparse_kv_offload_config": {"enabled": theirs}})


def _use_config(monkeypatch: pytest.MonkeyPatch, vcfg: Any) -> None:
    import vllm.config

    monkeypatch.setattr(vllm.config, "get_current_vllm_config", lambda: vcfg)


# ------------------------------------------------------------------ the adapter side


class Recorder:
    """Implements SparseDecodeAdapter by delegating to the real colocated decode; records."""

    def __init__(self, decode: ColocatedSparseDecode) -> None:
        self.decode = decode
        self.plans: list[tuple[tuple[BatchRow, ...], SparseStepPlan]] = []
        self.offloads: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self.onloads: list[tuple[int, torch.Tensor]] = []
        self.layer_queries: list[str] = []

    def sparse_layer_index(self, layer_name: str) -> int | None:
        self.layer_queries.append(layer_name)
        return self.decode.sparse_layer_index(layer_name)

    def plan_step(self, rows: Sequence[BatchRow]) -> SparseStepPlan:
        plan = self.decode.plan_step(rows)
        if not self.plans or self.plans[-1][1] is not plan:
            self.plans.append((tuple(rows), plan))
        return plan

    def offload_new_kv(self, layer: int, new_kv: torch.Tensor, positions: torch.Tensor) -> None:
        self.offloads.append((layer, new_kv.clone(), positions.clone()))
        self.decode.offload_new_kv(layer, new_kv, positions)

    def onload_topk(self, layer: int, topk: torch.Tensor) -> torch.Tensor:
        self.onloads.append((layer, topk.clone()))
        return self.decode.onload_topk(layer, topk)

    def hot_buffer(self, layer: int) -> torch.Tensor:
        return self.decode.hot_buffer(layer)

    def context_rows(self, layer: int, batch_index: int, positions: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.decode.context_rows(layer, batch_index, positions)


def _adapter() -> Recorder:
    cfg = SparseOffloadConfig(enabled=True, topk_buffer_size=HOT, index_topk=TOPK)
    mgr = SparseOffloadManager(cfg, num_layers=len(LAYERS), row_shape=(R + P,),
                               dtype=torch.float32, block_size=SCHED_BS, max_requests=4,
                               index_topk=TOPK, pool_rows=512, device=torch.device("cpu"))
    return Recorder(ColocatedSparseDecode(mgr, LAYERS))


@pytest.fixture
def connector(monkeypatch: pytest.MonkeyPatch) -> Iterator[Recorder]:
    """A recorder installed as vLLM's active KV connector."""
    from vllm.distributed.kv_transfer import kv_transfer_state

    rec = _adapter()
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", rec)
    yield rec


# ------------------------------------------------------------------ a small SFA workload

# request -> (scheduler blocks, prompt length, first step it runs in)
REQUESTS = {"A": ([5, 2, 9, 11], 21, 0), "B": ([7, 3, 1, 12], 13, 0), "C": ([4, 6, 0], 9, 3)}
NUM_STEPS = 9
NUM_SCHED_BLOCKS = 16


def _kernel_row(blocks: list[int]) -> list[int]:
    ratio = SCHED_BS // KERNEL_BS
    return [b * ratio + j for b in blocks for j in range(ratio)]


def _steps() -> list[list[tuple[str, int, int]]]:
    """Per step: (request, tokens before, new tokens), decodes first (vllm-ascend's order)."""
    steps = []
    done = {r: 0 for r in REQUESTS}
    for s in range(NUM_STEPS):
        dec, pre = [], []
        for r, (_, prompt, first) in REQUESTS.items():
            if s == first:
                pre.append((r, 0, prompt))
            elif s > first:
                dec.append((r, done[r], 1))
        for r, before, n in dec + pre:
            done[r] = before + n
        steps.append(dec + pre)
    return steps


def _meta(step: list[tuple[str, int, int]]) -> Any:
    from vllm_ascend.attention.sfa_v1 import AscendSFAMetadata

    seq = [before + n for _, before, n in step]
    ends = torch.cumsum(torch.tensor([n for _, _, n in step]), 0).to(torch.int32)
    width = max(len(_kernel_row(REQUESTS[r][0])) for r, _, _ in step)
    table = torch.zeros((len(step), width), dtype=torch.int32)
    slots = []
    for i, (r, before, n) in enumerate(step):
        row = _kernel_row(REQUESTS[r][0])
        table[i, : len(row)] = torch.tensor(row)
        slots += [row[p // KERNEL_BS] * KERNEL_BS + p % KERNEL_BS for p in range(before, before + n)]
    return AscendSFAMetadata(
        num_actual_tokens=int(ends[-1]), slot_mapping=torch.tensor(slots),
        seq_lens=torch.tensor(seq, dtype=torch.int32), seq_lens_cpu=torch.tensor(seq),
        cum_query_lens=ends, block_table=table, sin=None, cos=None,
        num_input_tokens=int(ends[-1]), block_size=KERNEL_BS)


def _keys(step: list[tuple[str, int, int]]) -> dict[int, str]:
    """What the connector's scheduler side sends: block of the newest position -> request."""
    return {REQUESTS[r][0][(before + n - 1) // SCHED_BS]: r for r, before, n in step}


def _weights(layer: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + layer)
    d = 12
    return {"kv": torch.randn(d, R + P, generator=g), "qn": torch.randn(d, H * R, generator=g),
            "qp": torch.randn(d, H * P, generator=g), "iq": torch.randn(d, DI, generator=g),
            "ik": torch.randn(d, DI, generator=g)}


def _impl(cls: type, layer: int, **extra: Any) -> Any:
    return cls(H, R + P, 0.25, 1, None, None, "auto", None, "decoder", None,
               kv_lora_rank=R, qk_rope_head_dim=P, index_topk=TOPK, weights=_weights(layer),
               layer_name=LAYERS[layer], **extra)


def _caches() -> list[tuple[torch.Tensor, ...]]:
    n = NUM_SCHED_BLOCKS * SCHED_BS // KERNEL_BS
    return [(torch.zeros(n, KERNEL_BS, 1, R), torch.zeros(n, KERNEL_BS, 1, P),
             torch.zeros(n, KERNEL_BS, 1, DI)) for _ in LAYERS]


def _hidden(s: int, tokens: int) -> torch.Tensor:
    return torch.randn(tokens, 12, generator=torch.Generator().manual_seed(s))


def _run(cls: type, adapter: Recorder | None, wipe_after_first: bool = False
         ) -> list[torch.Tensor]:
    """All steps through two layers of ``cls``; with ``adapter``, the scheduler's per-step
    facts go to it first (as the connector does). Returns each step's outputs."""
    impls = [_impl(cls, i) for i in range(len(LAYERS))]
    caches = _caches()
    outs = []
    for s, step in enumerate(_steps()):
        if adapter is not None:
            for r, before, _ in step:
                if before == 0:
                    adapter.decode.admit(r, 40)
            adapter.decode.begin(object(), _keys(step))
        meta = _meta(step)
        x = _hidden(s, meta.num_actual_tokens)
        for i, impl in enumerate(impls):
            out = torch.zeros(x.shape[0], H * R)
            impl.forward(LAYERS[i], x, caches[i], meta, out)
            outs.append(out)
        if wipe_after_first and s == 0:
            for c in caches:  # the paged main KV of the prompts is gone: only the pool has it
                c[0].zero_()
                c[1].zero_()
    return outs


# ------------------------------------------------------------------ install / selection


def test_patches_apply_on_import_and_uninstall_restores(va: Any) -> None:
    assert "vllm_ascend.attention.sfa_v1" not in sys.modules  # install imported nothing
    sfa_v1 = importlib.import_module("vllm_ascend.attention.sfa_v1")
    mr = importlib.import_module("vllm_ascend.worker.model_runner_v1")
    assert sfa._MARK in sfa_v1.AscendSFABackend.__dict__
    assert getattr(mr.apply_layerwise_kv_cache_plan, runner._MARK, None) is not None
    va.uninstall()
    assert sfa._MARK not in sfa_v1.AscendSFABackend.__dict__
    assert not hasattr(mr.apply_layerwise_kv_cache_plan, runner._MARK)
    assert va.install()  # fixture teardown uninstalls again
    assert sfa._MARK in sfa_v1.AscendSFABackend.__dict__  # already imported: patched at once


def test_config_off_runs_vllm_ascend_path_untouched(va: Any, connector: Recorder,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_ascend.ascend_config import set_sparse_kv_offload
    from vllm_ascend.attention.sfa_kv_offload import AscendSFAKVOffloadImpl
    from vllm_ascend.attention.sfa_v1 import AscendSFABackend, AscendSFAImpl
    from vllm_ascend.distributed.kv_transfer.sparse_kv_offload import (
        sparse_kv_offload_manager as their,
    )

    _use_config(monkeypatch, _vcfg(ours=False))
    assert AscendSFABackend.get_impl_cls() is AscendSFAImpl
    set_sparse_kv_offload(True)
    try:
        assert AscendSFABackend.get_impl_cls() is AscendSFAKVOffloadImpl
        their.get_sparse_kv_offload_manager().calls.clear()
        _run(AscendSFAKVOffloadImpl, None)
    finally:
        set_sparse_kv_offload(False)
    names = [c for c, _ in their.get_sparse_kv_offload_manager().calls]
    assert names.count("offload_new_kv") == NUM_STEPS * len(LAYERS)
    assert names.count("onload_topk_kv") == NUM_STEPS * len(LAYERS)
    assert not connector.plans and not connector.offloads and not connector.onloads
    # no kv_transfer_config at all: same
    _use_config(monkeypatch, SimpleNamespace(kv_transfer_config=None))
    assert AscendSFABackend.get_impl_cls() is AscendSFAImpl


def test_ours_on_selects_our_impl_and_refuses_conflicts(va: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_ascend.attention.sfa_v1 import AscendSFABackend, AscendSFAImpl, PreprocessType

    _use_config(monkeypatch, _vcfg())
    cls = AscendSFABackend.get_impl_cls()
    assert issubclass(cls, AscendSFAImpl) and issubclass(cls, sfa.SparseOffloadSFAMixin)
    assert AscendSFABackend.get_impl_cls() is cls  # one class per (base, block size)
    assert _impl(cls, 0).preprocess_type is PreprocessType.NATIVE  # exec_kv must run
    with pytest.raises(ConfigError, match="enable_sparse_sfa_c8"):
        _impl(cls, 0, enable_sparse_sfa_c8=True)
    _use_config(monkeypatch, _vcfg(theirs=True))
    with pytest.raises(ConfigError, match=r"sparse_kv_offload_config\.enabled"):
        AscendSFABackend.get_impl_cls()

    class Full:
        name = "FULL"

        def has_full_cudagraphs(self) -> bool:
            return True

    _use_config(monkeypatch, _vcfg(mode=Full()))
    with pytest.raises(ConfigError, match="FULL"):
        AscendSFABackend.get_impl_cls()

    from vllm_ascend.attention.context_parallel import sfa_cp

    cp_impl = type("AscendSFACPImpl", (AscendSFAImpl,), {})
    monkeypatch.setattr(sfa_cp, "resolve_sfa_impl", lambda: cp_impl)
    _use_config(monkeypatch, _vcfg())
    with pytest.raises(ConfigError, match="AscendSFACPImpl"):
        AscendSFABackend.get_impl_cls()
    _use_config(monkeypatch, _vcfg(ours=False))
    assert AscendSFABackend.get_impl_cls() is cp_impl  # off: vllm-ascend's choice


def test_connector_ownership(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    assert connector_is_ours("AscendStoreConnector", "ascend_offload.connectors.store")
    assert not connector_is_ours(
        "AscendStoreConnector", "vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store")
    theirs = type("AscendStoreConnector", (), {"__module__": "vllm_ascend.distributed.x"})
    monkeypatch.setitem(KVConnectorFactory._registry, "AscendStoreConnector", lambda: theirs)
    assert not connector_is_ours("AscendStoreConnector", None)
    # vllm-ascend's own store keys are never parsed by our strict schema
    vcfg = SimpleNamespace(kv_transfer_config=SimpleNamespace(
        kv_connector="AscendStoreConnector", kv_connector_module_path=None,
        kv_connector_extra_config={"backend": "memcache", "use_layerwise": True,
                                   "lookup_rpc_port": 1}))
    assert settings.layerwise_store_settings(vcfg) is None
    multi = SimpleNamespace(kv_transfer_config=SimpleNamespace(
        kv_connector="MultiConnector", kv_connector_module_path=None,
        kv_connector_extra_config={"connectors": [
            {"kv_connector": "SfaRemoteD2HConnector",
             "kv_connector_module_path": "ascend_offload.connectors.remote_d2h",
             "kv_role": "kv_consumer",
             "kv_connector_extra_config": {"sparse_offload": {"enabled": True}}}]}))
    cfg = settings.sparse_offload_settings(multi)
    assert cfg is not None and cfg.enabled


# ------------------------------------------------------------------ the SFA decode path


def test_sfa_decode_goes_through_our_adapter(va: Any, connector: Recorder,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Same outputs as vllm-ascend's paged path, every step, with the prompts' paged main KV
    wiped after prefill: decode rows read the host pool through the hot buffers."""
    from vllm_ascend.attention import sfa_v1

    ref_topk: list[torch.Tensor] = []
    original_topk = sfa_v1.AscendSFAImpl._indexer_topk

    def recording_topk(self: Any, x: torch.Tensor, kv_cache: Any, meta: Any) -> torch.Tensor:
        out = original_topk(self, x, kv_cache, meta)
        ref_topk.append(out)
        return out

    monkeypatch.setattr(sfa_v1.AscendSFAImpl, "_indexer_topk", recording_topk)
    reference = _run(sfa_v1.AscendSFAImpl, None)
    ref_topk_of_run = list(ref_topk)

    _use_config(monkeypatch, _vcfg())
    cls = sfa_v1.AscendSFABackend.get_impl_cls()
    got = _run(cls, connector, wipe_after_first=True)
    for a, b in zip(got, reference, strict=True):
        torch.testing.assert_close(a, b)

    steps = _steps()
    # one plan per step; rows named by the scheduler block of the newest position
    assert len(connector.plans) == NUM_STEPS
    for (rows, plan), step in zip(connector.plans, steps, strict=True):
        assert rows == tuple(BatchRow(REQUESTS[r][0][(before + n - 1) // SCHED_BS], before + n, n)
                             for r, before, n in step)
        assert plan.decode == tuple(n == 1 for _, _, n in step)
    # offload: per step and layer exactly the new positions, as [nope | rope] rows
    per_step = [connector.offloads[i:i + 2] for i in range(0, len(connector.offloads), 2)]
    assert len(per_step) == NUM_STEPS
    for s, (step, pair) in enumerate(zip(steps, per_step, strict=True)):
        want = [(b, p) for b, (_, before, n) in enumerate(step) for p in range(before, before + n)]
        for layer, (lay, rows, pos) in enumerate(pair):
            assert lay == layer
            assert [tuple(x) for x in pos.tolist()] == want
            x = _hidden(s, sum(n for _, _, n in step))
            torch.testing.assert_close(rows, x @ _weights(layer)["kv"])
    # onload: the indexer's top-k of each one-token row, in the adapter's batch order
    dec_steps = [s for s, step in enumerate(steps) if any(n == 1 for _, _, n in step)]
    assert len(connector.onloads) == len(dec_steps) * len(LAYERS)
    onloads = iter(connector.onloads)
    for s in dec_steps:
        tok = 0
        starts = []
        for _, _, n in steps[s]:
            starts.append(tok)
            tok += n
        for layer in range(len(LAYERS)):
            lay, topk = next(onloads)
            assert lay == layer
            ref = ref_topk_of_run[s * len(LAYERS) + layer]
            for b, (_, _, n) in enumerate(steps[s]):
                if n == 1:
                    assert topk[b].tolist() == ref[starts[b], 0].tolist()
    st = connector.decode.manager.stats
    assert st.miss_rows > 0 and st.hits > 0  # hot rows were reused and refilled


def test_decode_kernel_reads_hot_rows_paged(va: Any, connector: Recorder,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel call for decode rows gets a paged view of the selected hot rows."""
    from vllm_ascend.attention import sfa_v1
    from vllm_ascend.device.device_op import DeviceOperator

    _use_config(monkeypatch, _vcfg())
    DeviceOperator.calls.clear()
    _run(sfa_v1.AscendSFABackend.get_impl_cls(), connector)
    pages = TOPK // KERNEL_BS
    hot_calls = [c for c in DeviceOperator.calls if c["key_shape"][0] != NUM_SCHED_BLOCKS * 2]
    assert hot_calls
    for c in hot_calls:
        n = c["tokens"]
        assert c["key_shape"] == (n * pages, KERNEL_BS, 1, R)
        assert c["block_table"].tolist() == torch.arange(n * pages).view(n, pages).tolist()
        assert c["cum_q"].tolist() == list(range(1, n + 1))
        assert c["kv_lens"].tolist() == [TOPK] * n


def test_layer_not_offloaded_runs_paged_kernel(va: Any, connector: Recorder,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_ascend.attention import sfa_v1

    monkeypatch.setattr(connector.decode, "sparse_layer_index", lambda name: None)
    _use_config(monkeypatch, _vcfg())
    reference = _run(sfa_v1.AscendSFAImpl, None)
    got = _run(sfa_v1.AscendSFABackend.get_impl_cls(), connector)
    for a, b in zip(got, reference, strict=True):
        torch.testing.assert_close(a, b)
    assert connector.layer_queries and not connector.plans and not connector.onloads


def test_adapter_found_inside_multi_connector(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.distributed.kv_transfer import kv_transfer_state

    rec = _adapter()
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT",
                        SimpleNamespace(sub_connectors=[object(), rec]))
    assert sfa.find_sparse_adapter() is rec
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", None)
    assert sfa.find_sparse_adapter() is None


def test_hot_view_pads_topk_to_whole_pages() -> None:
    """K not a multiple of the kernel block: the view pads with -1 indices; every valid
    index names exactly the hot row the adapter returned, split into nope / rope."""
    impl = object.__new__(sfa.SparseOffloadSFAMixin)  # the view needs only the two dims
    impl.kv_lora_rank, impl.qk_rope_head_dim = R, P  # type: ignore[attr-defined]
    hot = torch.randn(40, R + P)
    slots = torch.tensor([[3, 17, -1, 5, 9, 0], [39, -1, -1, 2, 2, 11]], dtype=torch.int32)
    (nope, rope), idx = impl._ao_hot_view(hot, slots, KERNEL_BS)
    pages = 2  # ceil(6 / 4)
    assert nope.shape == (2 * pages, KERNEL_BS, 1, R) and rope.shape == (2 * pages, KERNEL_BS, 1, P)
    assert idx.shape == (2, 1, pages * KERNEL_BS)
    table = impl._ao_hot_table(2, 6, SimpleNamespace(kernel_block_size=KERNEL_BS),  # type: ignore[arg-type]
                               hot.device)
    for i in range(2):
        for j in range(pages * KERNEL_BS):
            pos = int(idx[i, 0, j])
            if j >= 6 or int(slots[i, j]) < 0:
                assert pos == -1
                continue
            page = int(table[i, pos // KERNEL_BS])
            row = torch.cat((nope[page, pos % KERNEL_BS, 0], rope[page, pos % KERNEL_BS, 0]))
            assert torch.equal(row, hot[int(slots[i, j])])
    with pytest.raises(ValueError, match="kv_lora_rank"):
        impl._ao_hot_view(torch.zeros(4, R), slots, KERNEL_BS)
