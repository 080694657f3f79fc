"""Our Protocols are implemented with their signatures, not only their names.

``isinstance`` against a ``runtime_checkable`` Protocol checks that the members
exist; a renamed parameter, a dropped default or a new required argument passes
it and breaks the caller at run time. Each implementation here is compared with
its Protocol parameter by parameter.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from ascend_offload.layerwise.gate import ReuseGate
from ascend_offload.layerwise.pipeline import LayerwisePipeline
from ascend_offload.pd.slot_sharing import ReadGate, SharedStepPipeline, SlotSharing
from ascend_offload.sparse.adapter import SparseDecodeAdapter
from ascend_offload.sparse.colocated import ColocatedSparseDecode


def protocol_members(proto: type) -> dict[str, Any]:
    """The callables and properties a Protocol (and its Protocol bases) declares."""
    out: dict[str, Any] = {}
    for klass in reversed(proto.__mro__):
        if klass is object or not getattr(klass, "_is_protocol", False):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_"):
                continue
            if callable(value) or isinstance(value, property):
                out[name] = value
    return out


def _set_in_init(impl: type, name: str) -> bool:
    init = getattr(impl, "__init__", None)
    try:
        src = inspect.getsource(init)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return False
    return f"self.{name} =" in src or f"self.{name}:" in src


def mismatches(impl: type, proto: type) -> list[str]:
    """Why ``impl`` does not implement ``proto`` as declared (empty: it does)."""
    problems = []
    for name, want in protocol_members(proto).items():
        got = inspect.getattr_static(impl, name, None)
        if got is None and isinstance(want, property) and _set_in_init(impl, name):
            continue  # a plain attribute the constructor sets satisfies a read-only property
        if got is None:
            problems.append(f"{name}: missing")
            continue
        if isinstance(want, property):
            if not isinstance(got, property):
                problems.append(f"{name}: a property in the protocol, {type(got).__name__} here")
            continue
        if isinstance(got, property) or not callable(got):
            problems.append(f"{name}: not a method")
            continue
        ws = list(inspect.signature(want).parameters.values())
        gs = list(inspect.signature(got).parameters.values())
        for i, w in enumerate(ws):
            if i >= len(gs):
                problems.append(f"{name}: lacks parameter {w.name!r}")
                break
            g = gs[i]
            if g.name != w.name or g.kind != w.kind:
                problems.append(f"{name}: parameter {i} is {g.name!r} ({g.kind.name}), "
                                f"the protocol has {w.name!r} ({w.kind.name})")
            elif w.default is not inspect.Parameter.empty and g.default is inspect.Parameter.empty:
                problems.append(f"{name}: parameter {w.name!r} has no default, the protocol gives one")
        extra = [g for g in gs[len(ws):] if g.default is inspect.Parameter.empty
                 and g.kind not in (g.VAR_POSITIONAL, g.VAR_KEYWORD)]
        if extra:
            problems.append(f"{name}: extra required parameters {[g.name for g in extra]}")
    return problems


def _rd2h() -> type:
    from ascend_offload.connectors.remote_d2h.connector import SfaRemoteD2HConnector

    return SfaRemoteD2HConnector


def _sparse_decode() -> type:
    from ascend_offload.connectors.sparse_decode.connector import AscendSparseDecodeConnector

    return AscendSparseDecodeConnector


IMPLEMENTATIONS = [
    (ColocatedSparseDecode, SparseDecodeAdapter),
    (_sparse_decode, SparseDecodeAdapter),
    (_rd2h, SparseDecodeAdapter),
    (ReuseGate, ReadGate),
    (LayerwisePipeline, SlotSharing),
    (LayerwisePipeline, SharedStepPipeline),
]


@pytest.mark.parametrize(("impl", "proto"), IMPLEMENTATIONS,
                         ids=lambda x: getattr(x, "__name__", str(x)).lstrip("_"))
def test_implementation_matches_its_protocol(impl: Any, proto: type) -> None:
    cls = impl if isinstance(impl, type) else impl()
    assert mismatches(cls, proto) == []


def test_a_drifted_signature_is_reported() -> None:
    class Drifted:
        def outwait(self, deadline: float, margin_s: float) -> None: ...  # renamed, default dropped

        def add_consumer(self, slot: int, generation: int, name: str, owner: str) -> Any: ...

    problems = mismatches(Drifted, ReadGate)
    assert any("outwait: parameter 1 is 'deadline'" in p for p in problems), problems
    assert any("add_consumer: extra required parameters ['owner']" in p for p in problems), problems
    assert any("release_consumer: missing" in p for p in problems), problems
