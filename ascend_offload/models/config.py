"""Hugging Face config of our sparse-MLA model (DeepSeek-V3.2 semantics, small).

Why a model type of our own: vLLM keys MLA handling on the model type
(``deepseek_v3``/``deepseek_v32`` select its MLA layers, V3.2 its sparse ones,
which the CPU platform refuses; MLA alone forces block 16 there and turns
chunked prefill and prefix caching off). A distinct type keeps vLLM's
MLA/sparse machinery out and leaves the attention to our layers, so the model
runs on every platform with any block size, chunked prefill and prefix caching.
Field names follow DeepSeek-V3.2's config where the concept exists.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from ascend_offload.models import ARCHITECTURE, MODEL_TYPE


class SparseMLAConfig(PretrainedConfig):
    """Dense MLP decoder with MLA attention and a lightning indexer per layer.

    ``index_topk``: positions each query attends to; ``use_sparse_attention=False``
    attends to every position (the dense baseline of the same weights).
    """

    model_type = MODEL_TYPE

    def __init__(
        self,
        vocab_size: int = 512,
        hidden_size: int = 128,
        intermediate_size: int = 256,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        q_lora_rank: int = 64,
        kv_lora_rank: int = 64,
        qk_nope_head_dim: int = 32,
        qk_rope_head_dim: int = 16,
        v_head_dim: int = 32,
        index_n_heads: int = 4,
        index_head_dim: int = 32,
        index_topk: int = 32,
        use_sparse_attention: bool = True,
        rope_theta: float = 10000.0,
        rms_norm_eps: float = 1e-6,
        max_position_embeddings: int = 4096,
        initializer_range: float = 0.2,
        tie_word_embeddings: bool = False,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        # one latent row per token: vLLM's generic code reads these as the KV shape
        self.num_key_value_heads = 1
        self.head_dim = kv_lora_rank + qk_rope_head_dim
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.index_n_heads = index_n_heads
        self.index_head_dim = index_head_dim
        self.index_topk = index_topk
        self.use_sparse_attention = use_sparse_attention
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        kwargs.setdefault("architectures", [ARCHITECTURE])
        # transformers types __init__ without the kwargs it still accepts
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)  # type: ignore[call-arg]
