"""Sparse tests use tiny tensors: one intra-op thread avoids pointless
synchronisation on shared CI cores (it changes no result). Restored after each
test so other areas keep their setting."""

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
