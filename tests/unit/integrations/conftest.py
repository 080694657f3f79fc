"""Fixtures of the vllm-ascend adapter tests: the fake vllm-ascend (``fake_vllm_ascend/``,
mirroring vllm-ascend main 182b75ea84ff) importable, and the integration installed."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

FAKE = Path(__file__).parent / "fake_vllm_ascend"


def _drop_fake_modules() -> None:
    for name in [m for m in sys.modules if m == "vllm_ascend" or m.startswith("vllm_ascend.")]:
        del sys.modules[name]


@pytest.fixture
def va(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The integration installed with the fake vllm-ascend importable (not yet imported)."""
    from ascend_offload.integrations import vllm_ascend as integration

    _drop_fake_modules()
    monkeypatch.syspath_prepend(str(FAKE))
    importlib.invalidate_caches()
    assert integration.install()
    yield integration
    integration.uninstall()
    _drop_fake_modules()
