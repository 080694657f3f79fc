"""Fake of vllm-ascend (tests only); see tests/unit/integrations/test_vllm_ascend.py."""
