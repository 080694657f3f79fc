"""Planner formula, assignment, prefetch map and error messages."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ascend_offload.config import ConfigError
from ascend_offload.layerwise.plan import (
    KEY_B,
    KEY_I,
    LayerSpec,
    PlanError,
    normalize_independent,
    plan_layers,
    plan_uniform,
)


def test_default_independent_layer0_round_robin() -> None:
    plan = plan_uniform(8, 2)
    assert plan.num_physical == 1 + 2
    assert plan.assignment() == [0, 1, 2, 1, 2, 1, 2, 1]
    assert plan.independent == frozenset({"layers.0"})
    assert plan.footprint_ratio() == pytest.approx(3 / 8)
    assert not plan.is_shared("layers.0") and plan.is_shared("layers.1")


@pytest.mark.parametrize("b", [1, 2, 3])
def test_formula_i_plus_min_b_r(b: int) -> None:
    plan = plan_uniform(8, b, [0])
    assert plan.num_physical == 1 + min(b, 7)
    # Round-robin: the k-th shared layer goes to shared buffer k mod B.
    shared = [s for i, s in enumerate(plan.assignment()) if i != 0]
    assert shared == [1 + (k % b) for k in range(7)]


def test_b_larger_than_r_caps_at_r() -> None:
    plan = plan_uniform(4, 10, [0])
    assert plan.num_physical == 4
    assert plan.assignment() == [0, 1, 2, 3]
    assert all(plan.prev_owner[n] is None for n in plan.layers)
    assert plan.footprint_ratio() == 1.0


def test_negative_indices_and_mtp() -> None:
    plan = plan_uniform(6, 2, [0, -1], mtp_layers=1)
    # 7 logical layers, -1 is the MTP layer (it takes the index after the base layers).
    assert plan.layers[-1] == "mtp.0"
    assert plan.independent == frozenset({"layers.0", "mtp.0"})
    assert plan.num_physical == 2 + 2
    assert plan.assignment() == [0, 1, 2, 1, 2, 1, 3]


def test_mtp_layers_join_round_robin() -> None:
    plan = plan_uniform(3, 2, [0], mtp_layers=2)
    assert plan.layers == ("layers.0", "layers.1", "layers.2", "mtp.0", "mtp.1")
    assert plan.assignment() == [0, 1, 2, 1, 2]


def test_mtp_order_from_arbitrary_input_order() -> None:
    specs = [LayerSpec("mtp"), LayerSpec("a"), LayerSpec("b")]
    specs[0] = LayerSpec("mtp", mtp=True)
    plan = plan_layers(specs, num_shared_buffers=1, independent=[0])
    assert plan.layers == ("a", "b", "mtp")
    assert plan.assignment() == [0, 1, 1]


def test_all_means_no_sharing_and_ignores_b() -> None:
    plan = plan_uniform(5, 0, "all")
    assert not plan.sharing
    assert plan.num_physical == 5
    assert plan.assignment() == [0, 1, 2, 3, 4]
    assert plan.footprint_ratio() == 1.0


def test_empty_independent_shares_everything() -> None:
    plan = plan_uniform(4, 1, [])
    assert plan.num_physical == 1
    assert plan.assignment() == [0, 0, 0, 0]
    assert plan.prev_owner["layers.0"] == "layers.3"  # cyclic: inherits from the previous step


def test_prefetch_map_names_previous_owner() -> None:
    plan = plan_uniform(8, 2, [0])
    assert plan.prev_owner["layers.0"] is None
    assert plan.prev_owner["layers.3"] == "layers.1"
    assert plan.prev_owner["layers.4"] == "layers.2"
    assert plan.prev_owner["layers.1"] == "layers.7"
    assert plan.to_json()["prefetch_from"][3] == 1


def test_incompatible_specs_never_share() -> None:
    specs = [
        LayerSpec("l0", compat="full", nbytes=100),
        LayerSpec("l1", compat="full", nbytes=100),
        LayerSpec("l2", compat="swa", nbytes=50),
        LayerSpec("l3", compat="full", nbytes=100),
        LayerSpec("l4", compat="swa", nbytes=50),
        LayerSpec("l5", compat="swa", nbytes=50),
    ]
    plan = plan_layers(specs, num_shared_buffers=1, independent=[0])
    # full: I=1 (l0) + min(1, 2); swa: I=0 + min(1, 3)
    assert plan.num_physical == 3
    a = dict(zip(plan.layers, plan.assignment(), strict=True))
    assert a["l1"] == a["l3"] != a["l0"]
    assert a["l2"] == a["l4"] == a["l5"]
    assert len({a["l1"], a["l2"]}) == 2
    for buf in plan.buffers:
        assert len({s.compat for s in specs if s.name in buf.layers}) == 1
    assert plan.footprint_ratio() == pytest.approx((100 + 100 + 50) / (300 + 150))


def test_indexer_follows_main_buffer() -> None:
    specs = []
    for i in range(4):
        specs.append(LayerSpec(f"l{i}", compat="mla", nbytes=1152))
        specs.append(LayerSpec(f"l{i}.indexer", compat="idx", nbytes=256, follows=f"l{i}"))
    plan = plan_layers(specs, num_shared_buffers=1, independent=[0])
    assert plan.layers == ("l0", "l1", "l2", "l3")
    assert plan.num_main_physical == 2
    assert plan.num_physical == 4  # each main buffer has its indexer buffer
    for i in range(4):
        fslot = plan.slot_of[f"l{i}.indexer"]
        assert plan.buffers[fslot].follows == plan.slot_of[f"l{i}"]
        assert plan.gate_slot_of[f"l{i}.indexer"] == plan.slot_of[f"l{i}"]
    assert plan.slot_of["l1.indexer"] == plan.slot_of["l3.indexer"]
    assert plan.to_json()["follower_assignment"] == [plan.slot_of[f"l{i}.indexer"] for i in range(4)]


@pytest.mark.parametrize(
    ("kwargs", "key", "fragment"),
    [
        ({"num_layers": 8, "num_shared_buffers": 0}, KEY_B, "must be an integer >= 1"),
        ({"num_layers": 8, "num_shared_buffers": 2, "independent": [8]}, KEY_I, "out of range"),
        ({"num_layers": 8, "num_shared_buffers": 2, "independent": [-9]}, KEY_I, "out of range"),
        ({"num_layers": 8, "num_shared_buffers": 2, "independent": [1, 1]}, KEY_I, "same layer"),
        ({"num_layers": 8, "num_shared_buffers": 2, "independent": [7, -1]}, KEY_I, "same layer"),
        ({"num_layers": 8, "num_shared_buffers": 2, "independent": "some"}, KEY_I, "'all'"),
        ({"num_layers": 8, "num_shared_buffers": 2, "independent": [1.5]}, KEY_I, "not an integer"),
    ],
)
def test_invalid_inputs_name_the_key(kwargs: dict, key: str, fragment: str) -> None:
    with pytest.raises(PlanError) as err:
        plan_uniform(**kwargs)
    assert err.value.key == key
    assert key in str(err.value) and fragment in str(err.value)
    assert isinstance(err.value, ConfigError)


def test_structural_errors() -> None:
    with pytest.raises(PlanError, match="no cache-bearing layers"):
        plan_layers([], num_shared_buffers=1)
    with pytest.raises(PlanError, match="duplicate layer names"):
        plan_layers([LayerSpec("a"), LayerSpec("a")], num_shared_buffers=1)
    with pytest.raises(PlanError, match="not a main cache-bearing layer"):
        plan_layers([LayerSpec("a"), LayerSpec("x", follows="zz")], num_shared_buffers=1)
    with pytest.raises(PlanError, match="different sizes"):
        plan_layers(
            [LayerSpec("a", nbytes=1), LayerSpec("b", nbytes=1), LayerSpec("c", nbytes=2)],
            num_shared_buffers=1,
            independent=[0],
        )


def test_normalize_independent_sorted() -> None:
    assert normalize_independent([-1, 0, 3], 5) == [0, 3, 4]
    assert normalize_independent("all", 3) == [0, 1, 2]


@given(
    n=st.integers(1, 40),
    b=st.integers(1, 12),
    mtp=st.integers(0, 3),
    data=st.data(),
)
def test_plan_properties(n: int, b: int, mtp: int, data: st.DataObject) -> None:
    total = n + mtp
    indep = data.draw(st.sets(st.integers(0, total - 1), max_size=total))
    plan = plan_uniform(n, b, sorted(indep), mtp)
    r = total - len(indep)
    assert plan.num_physical == len(indep) + min(b, r)
    a = plan.assignment()
    assert len(a) == total and set(a) == set(range(plan.num_physical))
    # Independent layers own their slot; no slot mixes independent and shared layers.
    for i in indep:
        assert a.count(a[i]) == 1
    # Layers of one slot follow each other cyclically in the prefetch map.
    for buf in plan.buffers:
        for j, name in enumerate(buf.layers):
            expected = None if len(buf.layers) == 1 else buf.layers[j - 1]
            assert plan.prev_owner[name] == expected
    # Shared slots are balanced (round-robin): sizes differ by at most one.
    sizes = [len(buf.layers) for buf in plan.buffers if not buf.independent]
    if sizes:
        assert max(sizes) - min(sizes) <= 1
    assert plan.footprint_ratio() == pytest.approx(plan.num_physical / total)
