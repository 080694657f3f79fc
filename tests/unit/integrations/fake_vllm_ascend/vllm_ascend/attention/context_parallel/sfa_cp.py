"""Fake of ``vllm_ascend/attention/context_parallel/sfa_cp.py`` (vllm-ascend main 182b75ea):
only ``resolve_sfa_impl``, which picks the DSA/SFA context-parallel impl when one of the
two CP switches is on; here always the plain ``AscendSFAImpl`` (tests patch it to
pretend a CP impl was chosen)."""

from __future__ import annotations

from vllm_ascend.attention.sfa_v1 import AscendSFAImpl


def resolve_sfa_impl() -> type[AscendSFAImpl]:
    return AscendSFAImpl
