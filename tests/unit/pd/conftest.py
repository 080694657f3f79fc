"""Shared fixtures for P/D unit tests: free ports and host KV tensors."""

from __future__ import annotations

import pytest
import torch

from ascend_offload.harness.servers import free_port, free_port_range
from ascend_offload.pd.layout import layer_desc
from ascend_offload.transfer.base import LoopbackEngine


def make_kv(num_layers: int, num_blocks: int, *, main_shape: tuple[int, ...] = (4, 8),
            indexer_shape: tuple[int, ...] | None = (4, 2), seed: int | None = None):
    """Per layer: K/V-style main tensors as two halves of one (2, blocks, ...) buffer, plus an indexer."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    tensors = []
    for _ in range(num_layers):
        if g is None:
            kv = torch.zeros((2, num_blocks, *main_shape), dtype=torch.float32)
            idx = torch.zeros((num_blocks, *indexer_shape)) if indexer_shape else None
        else:
            kv = torch.randn((2, num_blocks, *main_shape), generator=g)
            idx = torch.randn((num_blocks, *indexer_shape), generator=g) if indexer_shape else None
        tensors.append((kv, idx))
    descs = [layer_desc([kv[0], kv[1]], idx) for kv, idx in tensors]
    return tensors, descs


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def kv():
    return make_kv


@pytest.fixture
def port_pair() -> int:
    return free_port_range(2)


@pytest.fixture
def engines():
    """A prefill and a decode loopback transfer engine, closed after the test."""
    pe, de = LoopbackEngine(), LoopbackEngine()
    yield pe, de
    pe.close()
    de.close()


@pytest.fixture
def closing():
    """Register objects to close after the test."""
    made = []
    yield made.append
    for x in made:
        x.close()
