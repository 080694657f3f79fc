"""AscendMultiConnector's start-up rules for pairing layer sharing with P/D reads.

The pairing itself (decode reads holding a shared buffer) runs end to end in
tests/e2e/test_pd_layerwise_e2e.py and, in both orders, tests/e2e/test_joint_sparse_e2e.py;
here, the configuration errors it refuses.
"""

from __future__ import annotations

import pytest

from ascend_offload.config import ConfigError
from ascend_offload.connectors.multi import sharing_pair


def test_no_pair_without_both_children() -> None:
    assert sharing_pair([], [1], [False, True]) is None
    assert sharing_pair([0], [], [False, True]) is None


def test_store_then_producer_is_paired() -> None:
    assert sharing_pair([0], [1], [False, True]) == (0, 1)


def test_producer_before_store_is_paired_too() -> None:
    assert sharing_pair([1], [0], [True, False]) == (1, 0)


def test_producer_must_publish_per_layer() -> None:
    with pytest.raises(ConfigError, match=r"connectors\[1\]\.kv_connector_extra_config\.use_layerwise"):
        sharing_pair([0], [1], [False, False])


def test_at_most_one_of_each() -> None:
    with pytest.raises(ConfigError, match="at most one"):
        sharing_pair([0, 1], [2], [False, False, True])
