"""ascend-offload: KV cache offload for disaggregated prefill/decode vLLM deployments."""

__version__ = "0.1.0"
