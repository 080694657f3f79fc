"""Adapters into other vLLM platforms' code (each imports its platform lazily).

``vllm_ascend``: our sparse decode path inside vllm-ascend's SFA attention and our
layerwise layout in its NPU model runner (docs/vllm-ascend.md).
"""
