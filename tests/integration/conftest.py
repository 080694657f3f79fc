"""Shared fixtures for the multi-process integration tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest


@pytest.fixture
def ranks() -> Iterator[Callable[[Any], Any]]:
    """Start P/D rank processes (``ranks(RankConfig)``); every one is closed afterwards."""
    from tests.support.pd_ranks import RankConfig, RankProcess

    made: list[RankProcess] = []

    def start(cfg: RankConfig) -> RankProcess:
        made.append(RankProcess(cfg))
        return made[-1]

    yield start
    for r in made:
        r.close()
