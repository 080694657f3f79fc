"""A tiny random-weight sparse-MLA checkpoint (our DeepSeek-V3.2-style model),
generated locally for tests, demo and benches; see docs/models.md.

Same conventions as :mod:`ascend_offload.harness.tiny_model`: float32 weights,
``initializer_range=0.2`` (varied greedy output), a WordLevel tokenizer over
``t<i>`` tokens. Weights are drawn in a fixed order from one seeded generator,
so a directory is reproducible from its spec alone.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ascend_offload.harness.generated import generated_dir
from ascend_offload.harness.tiny_model import VOCAB, _write_tokenizer

DEFAULTS: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    q_lora_rank=64,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    index_n_heads=4,
    index_head_dim=32,
    index_topk=32,
    use_sparse_attention=True,
    max_position_embeddings=4096,
    initializer_range=0.2,
)

# Weights small enough that the model's greedy text repeats itself, so vLLM's n-gram
# drafts are sometimes accepted and sometimes rejected (the defaults' acceptance is ~0):
# the speculative-decoding tests, bench and demo use it.
NGRAM_INITIALIZER_RANGE = 0.02


def weight_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every parameter of the model and its shape, in generation order."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    heads, nope, rope = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
    qr, kr, vd = cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["v_head_dim"]
    ih, idim, inter = cfg["index_n_heads"], cfg["index_head_dim"], cfg["intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_a_proj.weight": (qr, h),
            p + "self_attn.q_a_layernorm.weight": (qr,),
            p + "self_attn.q_b_proj.weight": (heads * (nope + rope), qr),
            p + "self_attn.kv_a_proj_with_mqa.weight": (kr + rope, h),
            p + "self_attn.kv_a_layernorm.weight": (kr,),
            p + "self_attn.kv_b_proj.weight": (heads * (nope + vd), kr),
            p + "self_attn.o_proj.weight": (h, heads * vd),
            p + "self_attn.indexer.wq_b.weight": (ih * idim, qr),
            p + "self_attn.indexer.wk.weight": (idim, h),
            p + "self_attn.indexer.k_norm.weight": (idim,),
            p + "self_attn.indexer.k_norm.bias": (idim,),
            p + "self_attn.indexer.weights_proj.weight": (ih, h),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (v, h)
    return shapes


def make_tiny_sparse_model(path: str | os.PathLike[str], *, seed: int = 0, **overrides: Any) -> Path:
    """Write a deterministic random sparse-MLA model (+ tokenizer) to ``path``; idempotent.

    ``overrides`` replace entries of :data:`DEFAULTS` (e.g. ``index_topk=64``,
    ``num_hidden_layers=8``). Norm weights are 1 and the LayerNorm bias 0;
    every matrix is ``N(0, initializer_range)``.
    """
    unknown = set(overrides) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown tiny sparse model settings: {sorted(unknown)}")
    cfg = {**DEFAULTS, **overrides}
    out = Path(path)
    spec = {**cfg, "seed": seed}
    return generated_dir(out, ".tiny-sparse-model.json", spec, lambda d: _write_model(d, cfg, seed))


def _write_model(out: Path, cfg: dict[str, Any], seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    from ascend_offload.models.config import SparseMLAConfig

    g = torch.Generator().manual_seed(seed)
    std = cfg["initializer_range"]
    tensors = {}
    for name, shape in weight_shapes(cfg).items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape)
        elif name.endswith("norm.bias"):
            tensors[name] = torch.zeros(shape)
        else:
            tensors[name] = torch.randn(shape, generator=g) * std
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = SparseMLAConfig(**cfg, torch_dtype="float32", bos_token_id=1, eos_token_id=2)
    config.save_pretrained(out)
    _write_tokenizer(out, cfg["vocab_size"])
