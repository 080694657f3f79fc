"""A tiny random-weight Llama generated locally (no downloads), for tests, demo and benches.

Why ``initializer_range=0.2``: with the default 0.02 a random Llama repeats one
or two tokens, which makes a token-parity test weak; 0.2 gives varied greedy
output. Float32 weights because bf16 greedy decoding flips on near-ties.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ascend_offload.harness.generated import generated_dir

VOCAB = 512


def make_tiny_llama(
    path: str | os.PathLike[str],
    *,
    num_layers: int = 4,
    hidden_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = VOCAB,
    max_position: int = 4096,
    seed: int = 0,
) -> Path:
    """Write a deterministic random Llama (+ a WordLevel tokenizer) to ``path``; idempotent."""
    out = Path(path)
    spec = {
        "num_layers": num_layers,
        "hidden_size": hidden_size,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "vocab_size": vocab_size,
        "max_position": max_position,
        "seed": seed,
    }
    return generated_dir(out, ".tiny-llama.json", spec, lambda d: _write_llama(d, spec))


def _write_llama(out: Path, spec: dict[str, int]) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(spec["seed"])
    config = LlamaConfig(
        vocab_size=spec["vocab_size"],
        hidden_size=spec["hidden_size"],
        intermediate_size=spec["hidden_size"] * 2,
        num_hidden_layers=spec["num_layers"],
        num_attention_heads=spec["num_heads"],
        num_key_value_heads=spec["num_kv_heads"],
        max_position_embeddings=spec["max_position"],
        initializer_range=0.2,
        tie_word_embeddings=False,
        torch_dtype="float32",  # type: ignore[call-arg]  # accepted alias transformers' types omit
        bos_token_id=1,
        eos_token_id=2,
    )
    # transformers' decorator on .to() types its first argument as the model
    model = LlamaForCausalLM(config).to(torch.float32)  # type: ignore[arg-type]
    model.save_pretrained(out, safe_serialization=True)
    _write_tokenizer(out, spec["vocab_size"])


def _write_tokenizer(out: Path, vocab_size: int) -> None:
    """Whitespace WordLevel tokenizer: token ``t<i>`` is id ``i`` (enough for the OpenAI server)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(3, vocab_size):
        vocab[f"t{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": 1 << 20,
            }
        )
    )


def random_prompts(n: int, lengths: list[int] | tuple[int, ...], *, seed: int = 0) -> list[list[int]]:
    """Deterministic token-id prompts (ids >= 3 so no special tokens appear)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(lengths[i % len(lengths)])] for i in range(n)]
