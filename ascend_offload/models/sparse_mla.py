"""Our DeepSeek-V3.2-style sparse-attention decoder for vLLM (plain torch math).

Per layer: MLA with a low-rank query (``q_a_proj`` -> norm -> ``q_b_proj``), a
latent KV (``kv_a_proj_with_mqa`` -> ``kv_lora_rank`` latent + a shared rope
key), absorbed into an MQA over one cached row per token; a lightning indexer
(``indexer.wq_b``/``wk``/``k_norm``/``weights_proj``) picks ``index_topk``
positions per query; attention runs over those rows only (prefill and decode
alike). Dense gated-SiLU MLP instead of MoE, fp32/bf16 caches instead of FP8,
no multi-token-prediction layer: none of them changes what the KV caches hold
or how attention reads them, which is what the offload works on.

Weight names follow DeepSeek-V3.2 checkpoints where the module exists.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from vllm.config import VllmConfig

from ascend_offload.models.attention import IndexerCache, SparseMLACache
from ascend_offload.models.config import SparseMLAConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(positions: torch.Tensor, dim: int, theta: float, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[T, dim // 2]`` of neox-style rotary embedding at ``positions``."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, ..., dim]`` (neox halves); cos/sin ``[T, dim // 2]``."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def _model_dtype(vllm_config: VllmConfig) -> torch.dtype:
    """The model's dtype: vLLM types the field as the requested name or dtype, and has
    resolved it to a ``torch.dtype`` by the time a model is built."""
    return cast(torch.dtype, vllm_config.model_config.dtype)


def _linear(n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False)


class Indexer(nn.Module):
    """DeepSeek-V3.2's lightning indexer: per-token keys (cached) and per-query
    multi-head queries with per-head gates."""

    def __init__(self, config: SparseMLAConfig, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.wq_b = _linear(config.q_lora_rank, self.n_heads * self.head_dim)
        self.wk = _linear(config.hidden_size, self.head_dim)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = _linear(config.hidden_size, self.n_heads)
        self.gate_scale = self.n_heads**-0.5 * self.head_dim**-0.5
        self.k_cache = IndexerCache(f"{prefix}.k_cache", self.head_dim,
                                    _model_dtype(vllm_config), vllm_config.cache_config)

    def forward(self, x: torch.Tensor, qr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = self.wq_b(qr).view(-1, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(x))
        r = self.rope_dim
        q = torch.cat((apply_rope(q[..., :r], cos, sin), q[..., r:]), dim=-1)
        k = torch.cat((apply_rope(k[..., :r], cos, sin), k[..., r:]), dim=-1)
        return q, k, self.weights_proj(x) * self.gate_scale


class SparseMLAAttention(nn.Module):
    def __init__(self, config: SparseMLAConfig, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.nope = config.qk_nope_head_dim
        self.rope = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.rank = config.kv_lora_rank
        h = config.hidden_size
        self.q_a_proj = _linear(h, config.q_lora_rank)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = _linear(config.q_lora_rank, self.n_heads * (self.nope + self.rope))
        self.kv_a_proj_with_mqa = _linear(h, self.rank + self.rope)
        self.kv_a_layernorm = RMSNorm(self.rank, config.rms_norm_eps)
        self.kv_b_proj = _linear(self.rank, self.n_heads * (self.nope + self.v_dim))
        self.o_proj = _linear(self.n_heads * self.v_dim, h)
        self.indexer = Indexer(config, vllm_config, f"{prefix}.indexer")
        topk = config.index_topk if config.use_sparse_attention else None
        self.attn = SparseMLACache(
            f"{prefix}.attn", num_heads=self.n_heads, kv_lora_rank=self.rank, rope_dim=self.rope,
            scale=(self.nope + self.rope) ** -0.5, index_topk=topk, indexer=self.indexer.k_cache,
            dtype=_model_dtype(vllm_config), cache_config=vllm_config.cache_config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        qr = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(qr).view(t, self.n_heads, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        kv_a = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(kv_a[:, : self.rank])
        k_pe = apply_rope(kv_a[:, self.rank :], cos, sin)
        # absorb kv_b_proj: queries score the latent row directly, values come out latent
        w_kv = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w_kv.split([self.nope, self.v_dim], dim=1)
        q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)
        q_full = torch.cat((q_latent, apply_rope(q_pe, cos, sin)), dim=-1)
        index_q, index_k, index_w = self.indexer(x, qr, cos, sin)
        out_latent = self.attn(q_full, torch.cat((latent, k_pe), dim=-1), index_q, index_k, index_w)
        out = torch.einsum("thr,hvr->thv", out_latent, w_uv).reshape(t, self.n_heads * self.v_dim)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = _linear(hidden, inter)
        self.up_proj = _linear(hidden, inter)
        self.down_proj = _linear(inter, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: SparseMLAConfig, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SparseMLAAttention(config, vllm_config, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class SparseMLAModel(nn.Module):
    def __init__(self, config: SparseMLAConfig, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, vllm_config, f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        x = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
        cos, sin = rope_tables(positions, self.config.qk_rope_head_dim, self.config.rope_theta,
                               x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class SparseMLAForCausalLM(nn.Module):
    """vLLM entry class (architecture ``SparseMLAForCausalLM``)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        # the registered architecture's config class (models/config.py)
        config = cast(SparseMLAConfig, vllm_config.model_config.hf_config)
        # Tensor parallelism: every rank holds all weights and computes the whole model
        # (no collective, so no all-reduce at the end). MLA's latent KV is one row per
        # token shared by all heads, so it is replicated across TP ranks in real
        # deployments too; what the offload moves per rank is the same either way.
        self.config = config
        self.model = SparseMLAModel(config, vllm_config, "model")
        self.lm_head = _linear(config.hidden_size, config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: object = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} in the checkpoint")
            param = params[name]
            if param.shape != tensor.shape:
                raise ValueError(f"weight {name!r}: checkpoint shape {tuple(tensor.shape)}, "
                                 f"model shape {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(name)
        return loaded
