"""Unequal TP at the connector's startup: prefill TP above decode TP needs replicated (MLA) KV."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ascend_offload.config import ConfigError
from ascend_offload.connectors.remote_d2h.settings import build_settings, parse_config


def _config(*, d_tp: int, p_tp: int | None, mla: bool, kv_lora_rank: int | None = None):
    extra = {"host": "127.0.0.1", **({"prefill_tp_size": p_tp} if p_tp is not None else {})}
    tc = SimpleNamespace(kv_connector_extra_config=extra, is_kv_producer=False, is_kv_consumer=True,
                         engine_id="E0", kv_port=1)
    return SimpleNamespace(kv_transfer_config=tc, cache_config=SimpleNamespace(block_size=16),
                           parallel_config=SimpleNamespace(tensor_parallel_size=d_tp, data_parallel_rank=0),
                           model_config=SimpleNamespace(use_mla=mla, hf_config=SimpleNamespace(
                               kv_lora_rank=kv_lora_rank)))


def _settings(**kw):
    vc = _config(**kw)
    return build_settings(vc, parse_config(vc))


def test_mla_prefill_tp2_feeds_decode_tp1() -> None:
    topo = _settings(d_tp=1, p_tp=2, mla=True).topology
    assert topo is not None and (topo.p_tp, topo.d_tp, topo.ratio) == (2, 1, 2)
    assert list(topo.contributors(0)) == [0, 1] and topo.sends_main(0) and not topo.sends_main(1)


def test_a_latent_kv_outside_vllms_mla_family_is_replicated_too() -> None:
    """Our sparse-MLA model: vLLM's use_mla is False, but its config has kv_lora_rank."""
    topo = _settings(d_tp=1, p_tp=2, mla=False, kv_lora_rank=64).topology
    assert topo is not None and topo.ratio == 2


def test_head_sharded_kv_refuses_a_larger_prefill_tp() -> None:
    with pytest.raises(ConfigError, match=r"'prefill_tp_size'=2 with decode tp=1.*shards KV by head"):
        _settings(d_tp=1, p_tp=2, mla=False)
    assert _settings(d_tp=2, p_tp=None, mla=False).topology.ratio == 1  # equal TP is fine


@pytest.mark.parametrize(("d_tp", "p_tp"), [(2, 1), (2, 3)])
def test_unpairable_sizes_fail_at_startup_naming_the_key(d_tp: int, p_tp: int) -> None:
    with pytest.raises(ConfigError, match=rf"'prefill_tp_size'={p_tp}: unsupported P/D topology"):
        _settings(d_tp=d_tp, p_tp=p_tp, mla=True)
