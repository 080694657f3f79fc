"""``SfaRemoteD2HConnector``'s startup: its extra config, role checks and the values both
of its sides (scheduler and workers, prefill and decode) read from vLLM's config.

Every refusal happens here, at construction, naming the key (invariant I7).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import TYPE_CHECKING

from ascend_offload.config import ConfigError, RemoteD2HConfig, parse_extra_config
from ascend_offload.pd.auth import AuthError, ControlKeys, load_keys
from ascend_offload.pd.decode_requests import DecodeEndpoint
from ascend_offload.pd.topology import Topology, TopologyError
from ascend_offload.transfer.base import transfer_protocol

if TYPE_CHECKING:
    from vllm.config import VllmConfig

NAME = "SfaRemoteD2HConnector"


@dataclasses.dataclass(frozen=True)
class Settings:
    """What one connector instance is, parsed once and shared by its role objects."""

    cfg: RemoteD2HConfig
    is_producer: bool  # prefill: publishes its KV to decode
    is_consumer: bool  # decode: pulls the prompt's KV from prefill
    engine_id: str
    kv_port: int
    block_size: int
    tp_size: int
    dp_rank: int
    host: str  # the endpoint IP advertised to peers
    topology: Topology | None  # decode: prefill TP as seen from here
    keys: ControlKeys | None = None  # control-plane authentication (control_secret_file)

    @property
    def sparse(self) -> bool:
        """Decode pulls main KV into the host pool (sparse decode offload)."""
        return self.cfg.sparse_offload.enabled

    @property
    def endpoint(self) -> DecodeEndpoint:
        return DecodeEndpoint(self.engine_id, self.host, self.kv_port, self.tp_size, self.dp_rank,
                              transfer_protocol(self.cfg))


def check_sparse_role(cfg: RemoteD2HConfig, *, is_producer: bool, is_consumer: bool) -> None:
    """Sparse offload is decode-only; refuse it anywhere else at startup (I7)."""
    if not cfg.sparse_offload.enabled:
        return
    if is_producer:
        raise ConfigError(
            "key 'sparse_offload.enabled'=True on a kv_producer (prefill): sparse offload is a "
            "decode-side feature (accepted here: False; set it in the kv_consumer's config)")
    if not is_consumer:
        raise ConfigError("key 'sparse_offload.enabled'=True needs kv_role 'kv_consumer' (accepted: False)")


def check_debug_role(cfg: RemoteD2HConfig, *, is_producer: bool) -> None:
    """``debug.pd_faults`` is injected by the prefill's producers; refuse it where nothing
    would inject it, so a fault test cannot pass without its faults (I7)."""
    if cfg.debug.pd_faults is not None and not is_producer:
        raise ConfigError(f"key 'debug.pd_faults'={cfg.debug.pd_faults!r} needs kv_role 'kv_producer' "
                          "(the prefill injects the faults; accepted here: None)")


def _host_ip(configured: str = "") -> str:
    """The advertised endpoint IP: the ``host`` key when set, else vLLM's choice."""
    if configured:
        return configured
    from vllm.utils.network_utils import get_ip

    return get_ip()


def replicated_kv(vllm_config: VllmConfig) -> bool:
    """Every TP rank caches the same KV: an MLA latent (one row per token for all heads).

    vLLM's ``use_mla`` names only the DeepSeek family; any model whose config has a
    ``kv_lora_rank`` caches the latent (our sparse-MLA model), not per-head keys."""
    mc = vllm_config.model_config
    return bool(mc.use_mla) or getattr(getattr(mc, "hf_config", None), "kv_lora_rank", None) is not None


def parse_config(vllm_config: VllmConfig) -> RemoteD2HConfig:
    """The connector's extra config, with its role checked against sparse offload."""
    tc = vllm_config.kv_transfer_config
    assert tc is not None  # vLLM builds a connector only from a kv_transfer_config
    cfg: RemoteD2HConfig = parse_extra_config(NAME, tc.kv_connector_extra_config)
    check_sparse_role(cfg, is_producer=bool(tc.is_kv_producer), is_consumer=bool(tc.is_kv_consumer))
    check_debug_role(cfg, is_producer=bool(tc.is_kv_producer))
    return cfg


def build_settings(vllm_config: VllmConfig, cfg: RemoteD2HConfig) -> Settings:
    """The rest of the startup checks (backend, unequal TP) and the shared values."""
    if cfg.transfer_backend == "memfabric" and importlib.util.find_spec("memfabric_hybrid") is None:
        raise ConfigError("key 'transfer_backend'='memfabric': needs memfabric_hybrid "
                          "(pip install 'ascend-offload[ascend]') and the Ascend driver (accepted: 'mooncake')")
    tc = vllm_config.kv_transfer_config
    assert tc is not None
    pc = vllm_config.parallel_config
    tp_size = pc.tensor_parallel_size
    topology = None
    if tc.is_kv_consumer:
        p_tp = cfg.prefill_tp_size or tp_size
        try:
            topology = Topology(p_tp, tp_size)
        except TopologyError as exc:
            raise ConfigError(f"key 'prefill_tp_size'={p_tp}: {exc}") from None
        if topology.ratio > 1 and not replicated_kv(vllm_config):
            raise ConfigError(
                f"key 'prefill_tp_size'={p_tp} with decode tp={tp_size}: a prefill TP larger "
                "than decode's needs replicated (MLA) KV; this model shards KV by head "
                f"(accepted: {tp_size})"
            )
    try:
        keys = load_keys(cfg.control_secret_file)
    except AuthError as exc:
        raise ConfigError(f"key 'control_secret_file': {exc}") from None
    return Settings(cfg=cfg, keys=keys, is_producer=bool(tc.is_kv_producer), is_consumer=bool(tc.is_kv_consumer),
                    engine_id=str(tc.engine_id), kv_port=int(tc.kv_port),
                    block_size=vllm_config.cache_config.block_size, tp_size=tp_size,
                    dp_rank=getattr(pc, "data_parallel_rank", 0) or 0, host=_host_ip(cfg.host),
                    topology=topology)
