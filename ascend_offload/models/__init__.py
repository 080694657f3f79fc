"""Our sparse-attention model (DeepSeek-V3.2 semantics) for vLLM; see docs/models.md.

Importing this package imports neither vLLM, transformers nor torch: the plugin calls
:func:`register_models` in every vLLM process, and the model module is only
imported when an engine actually loads the architecture.
"""

from __future__ import annotations

MODEL_TYPE = "ascend_offload_sparse_mla"
ARCHITECTURE = "SparseMLAForCausalLM"
MODEL_CLASS = "ascend_offload.models.sparse_mla:SparseMLAForCausalLM"

__all__ = ["ARCHITECTURE", "MODEL_CLASS", "MODEL_TYPE", "register_models"]


def register_models() -> None:
    """Make ``model_type`` :data:`MODEL_TYPE` loadable by transformers' AutoConfig and
    the architecture :data:`ARCHITECTURE` by vLLM's model registry (lazily)."""
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from ascend_offload.models.config import SparseMLAConfig

    AutoConfig.register(MODEL_TYPE, SparseMLAConfig, exist_ok=True)
    ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
