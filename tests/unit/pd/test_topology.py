from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ascend_offload.pd.topology import Topology, TopologyError, decode_port


@pytest.mark.parametrize(("p", "d"), [(1, 2), (3, 2), (4, 3), (0, 1)])
def test_unsupported_names_both_sizes(p, d):
    with pytest.raises(TopologyError, match=rf"prefill tp={p}, decode tp={d}"):
        Topology(p, d)


def test_groups():
    t = Topology(4, 2)
    assert t.ratio == 2
    assert [t.d_rank_of(p) for p in range(4)] == [0, 0, 1, 1]
    assert [t.member_of(p) for p in range(4)] == [0, 1, 0, 1]
    assert list(t.contributors(1)) == [2, 3]
    assert [t.sends_main(p) for p in range(4)] == [True, False, True, False]
    with pytest.raises(TopologyError):
        t.d_rank_of(4)
    with pytest.raises(TopologyError):
        t.contributors(2)


@given(st.sampled_from([(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (8, 2), (16, 4)]), st.integers(0, 100))
def test_index_ranges_disjoint_and_complete(sizes, n):
    t = Topology(*sizes)
    for d in range(t.d_tp):
        covered: list[int] = []
        for p in t.contributors(d):
            lo, hi = t.index_range(p, n)
            assert 0 <= lo <= hi <= n
            covered += range(lo, hi)
        assert covered == list(range(n))  # disjoint, ordered, complete


def test_empty_member_range():
    t = Topology(4, 1)
    assert [t.index_range(p, 2) for p in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]


def test_decode_port():
    assert decode_port(14579, dp_rank=0, d_tp=2, tp_rank=1) == 14580
    assert decode_port(14579, dp_rank=3, d_tp=2, tp_rank=1) == 14579 + 7
    with pytest.raises(TopologyError, match="tp_rank=2"):
        decode_port(14579, dp_rank=0, d_tp=2, tp_rank=2)
    with pytest.raises(TopologyError, match="not a valid TCP port"):
        decode_port(65535, dp_rank=1, d_tp=1, tp_rank=0)
