"""The vllm-ascend fakes and our adapters against vllm-ascend's published API.

Why: vllm-ascend runs only on NPU, so the adapters are tested against fakes
(``fake_vllm_ascend/``). A fake whose signatures drifted from vllm-ascend, or an adapter
reaching for a name vllm-ascend does not have, would pass every other test here and fail
on an Ascend host. ``vllm_ascend_api/snapshot.json`` holds the signatures read from
vllm-ascend's source at the commit the adapters target (``vllm_ascend_api/extract.py``,
``ast`` only); this file holds both sides to it.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import importlib
import inspect
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from ascend_offload.integrations import vllm_ascend as integration
from ascend_offload.integrations.vllm_ascend import registration, runner, sfa
from tests.unit.integrations.conftest import FAKE, _drop_fake_modules
from tests.unit.integrations.vllm_ascend_api import extract

SNAPSHOT: dict[str, Any] = json.loads(
    (Path(__file__).parent / "vllm_ascend_api" / "snapshot.json").read_text(encoding="utf-8"))
NAMES: dict[str, dict[str, Any]] = SNAPSHOT["names"]

SFA = sfa.SFA_MODULE
SPECS = registration.SPEC_MODULE
CONFIG = "vllm_ascend.ascend_config"

# What the fakes add for the tests; none of it is vllm-ascend API.
FAKE_ONLY = {
    f"{CONFIG}:set_sparse_kv_offload",  # stands for additional_config
    f"{SFA}:AscendSFAImpl._write_main",  # the nope/rope cache write of exec_kv and fused kernels
    f"{SFA}:AscendSFAImpl._indexer_topk",  # torch reference of the indexer
    "vllm_ascend.device.device_op:BaseDeviceAdaptor.calls",  # what each kernel call got
    "vllm_ascend.worker.model_runner_v1:ORIGINAL_PLAN_CALLS",  # vllm-ascend's plan, recorded
}
# Fake classes standing in for a vLLM base vllm-ascend derives from.
STAND_INS = {"vllm_ascend.core.kv_cache_interface._MLASpec":
             "vllm.v1.kv_cache_interface.MLAAttentionSpec"}

# vllm-ascend names and attributes the adapters use beyond what is derived from sfa.py
# below (the patch points come from the adapters' own constants).
ADAPTER_NAMES = [
    f"{SFA}:AscendSFABackend.get_impl_cls",  # sfa.patch_backend wraps it
    f"{SFA}:AscendSFAImpl",  # base of AscendOffloadSFAImpl
    f"{SFA}:PreprocessType",
    f"{runner.RUNNER_MODULE}:{runner.PLAN_FN}",  # runner.patch_runner wraps it
    f"{runner.RUNNER_MODULE}:NPUModelRunner.initialize_kv_cache",  # calls it
    f"{SPECS}:{registration.INDEXER_SPEC}",  # registration: not a main-KV layer
    f"{SPECS}:AscendMLAAttentionSpec",  # registration: a main-KV layer
    f"{CONFIG}:SparseKVOffloadConfig.__init__",  # settings reads its key the same way
]
ADAPTER_ATTRS = [
    (f"{SFA}:PreprocessType", "NATIVE"),  # sfa: forced preprocessing
    # registration reads these of a main spec (head_size, dtype, compress_ratio: vLLM's base)
    (f"{SPECS}:AscendMLAAttentionSpec", "scale_dim"),
    (f"{SPECS}:AscendMLAAttentionSpec", "cache_sparse_sfa_c8"),
    (f"{CONFIG}:SparseKVOffloadConfig", "enabled"),  # settings.ascend_sparse_kv_offload_enabled
    (f"{CONFIG}:AscendConfig", "sparse_kv_offload_config"),  # the fake backend's switch
]

Param = tuple[str, str, bool, Any]
_NO_LITERAL = object()


# ------------------------------------------------------------------ comparison


def _literal(text: str | None) -> Any:
    try:
        return _NO_LITERAL if text is None else ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return _NO_LITERAL


def _params(fn: Callable[..., Any]) -> list[Param]:
    return [(p.name, p.kind.name, p.default is not p.empty, p.default)
            for p in inspect.signature(fn).parameters.values()]


def signature_mismatches(key: str, fn: Callable[..., Any], kind: str) -> list[str]:
    """``fn`` (raw function, ``self``/``cls`` included) against snapshot entry ``key``:
    decorator kind, parameter names and kinds, which have defaults, literal defaults."""
    entry = NAMES[key]
    if entry["kind"] != kind:
        return [f"{key}: {kind}, published {entry['kind']}"]
    if kind == "property":
        return []
    got = _params(fn)
    want = entry["params"]
    shape = [(n, k, d) for n, k, d, _ in got]
    if shape != [(p["name"], p["kind"], p["has_default"]) for p in want]:
        return [f"{key}: parameters {shape}, published "
                f"{[(p['name'], p['kind'], p['has_default']) for p in want]}"]
    return [f"{key}.{n}: default {v!r}, published {p['default']}"
            for (n, _, has, v), p in zip(got, want, strict=True)
            if has and _literal(p["default"]) is not _NO_LITERAL and v != _literal(p["default"])]


def _qualname(cls: type) -> str:
    name = f"{cls.__module__}.{cls.__qualname__}"
    return STAND_INS.get(name, name)


def class_mismatches(key: str, cls: type) -> list[str]:
    """Bases (vllm-ascend ones must match; vLLM ones may be left out), dataclass fields the
    class declares itself (order, defaults, kw_only), enum members and values."""
    entry = NAMES[key]
    if entry["kind"] != "class":
        return [f"{key}: class, published {entry['kind']}"]
    out = []
    bases = [_qualname(b) for b in cls.__bases__ if b is not object]
    real = entry["bases"]
    if any(b not in real for b in bases) or any(
            b.startswith("vllm_ascend.") and b not in bases for b in real):
        out.append(f"{key}: bases {bases}, published {real}")
    is_dc = "__dataclass_fields__" in cls.__dict__
    if is_dc != ("dataclass" in entry):
        out.append(f"{key}: dataclass {is_dc}, published {'dataclass' in entry}")
    elif is_dc:
        if cls.__dataclass_params__.frozen != entry["dataclass"]["frozen"]:  # type: ignore[attr-defined]
            out.append(f"{key}: frozen {cls.__dataclass_params__.frozen}")  # type: ignore[attr-defined]
        fields = [cls.__dataclass_fields__[n]  # type: ignore[attr-defined]
                  for n in inspect.get_annotations(cls)]
        got = [(f.name, f.default is not dataclasses.MISSING
                or f.default_factory is not dataclasses.MISSING, f.kw_only) for f in fields]
        want = [(f["name"], f["has_default"], f["kw_only"]) for f in entry["fields"]]
        if got != want:
            out.append(f"{key}: fields {got}, published {want}")
        else:
            out += [f"{key}.{f.name}: default {f.default!r}, published {p['default']}"
                    for f, p in zip(fields, entry["fields"], strict=True)
                    if f.default is not dataclasses.MISSING
                    and _literal(p["default"]) is not _NO_LITERAL
                    and f.default != _literal(p["default"])]
    if issubclass(cls, enum.Enum):
        got_values = {m.name: m.value for m in cls}
        want_values = {n: _literal(v) for n, v in entry.get("enum_values", {}).items()}
        if got_values != want_values:
            out.append(f"{key}: members {got_values}, published {want_values}")
    return out


def _method_kind(attr: Any) -> tuple[str, Callable[..., Any]] | None:
    if isinstance(attr, staticmethod):
        return "staticmethod", attr.__func__
    if isinstance(attr, classmethod):
        return "classmethod", attr.__func__
    if isinstance(attr, property):
        return "property", attr.fget  # type: ignore[return-value]
    if inspect.isfunction(attr):
        return "method", attr
    return None


def fake_api(modules: list[ModuleType]) -> dict[str, tuple[str, Any]]:
    """Everything the fake modules define: ``module:Qualified.name`` -> (kind, object)."""
    out: dict[str, tuple[str, Any]] = {}
    for mod in modules:
        for name, obj in vars(mod).items():
            if name.startswith("_") or isinstance(obj, ModuleType) or name == "annotations":
                continue
            key = f"{mod.__name__}:{name}"
            if inspect.isclass(obj) or inspect.isfunction(obj):
                if obj.__module__ != mod.__name__:
                    continue  # imported
                if obj.__qualname__ != name:
                    out[key] = ("variable", obj)  # an alias, like DeviceOperator
                    continue
                out[key] = ("class" if inspect.isclass(obj) else "function", obj)
                if inspect.isclass(obj):
                    out.update(_members(key, obj))
            else:
                out[key] = ("variable", obj)
    return out


def _members(key: str, cls: type) -> dict[str, tuple[str, Any]]:
    out: dict[str, tuple[str, Any]] = {}
    is_dc = "__dataclass_fields__" in cls.__dict__
    for name, attr in cls.__dict__.items():
        method = _method_kind(attr)
        if name.startswith("__") and (name != "__init__" or is_dc):
            continue  # dunders; a dataclass __init__ is compared as its fields
        if method is not None:
            if getattr(method[1], "__module__", None) == cls.__module__:  # not enum machinery
                out[f"{key}.{name}"] = method
        elif not name.startswith("_") and not (is_dc and name in cls.__dataclass_fields__):  # type: ignore[attr-defined]
            if not (isinstance(attr, enum.Enum) and type(attr) is cls):
                out[f"{key}.{name}"] = ("class_attr", attr)
    return out


def api_mismatches(fakes: dict[str, tuple[str, Any]]) -> list[str]:
    """Every fake definition against the snapshot (or declared test-only)."""
    out = []
    for key, (kind, obj) in fakes.items():
        if key in FAKE_ONLY:
            continue
        owner, _, member = key.rpartition(".")
        if kind == "class_attr":
            attrs = NAMES.get(owner, {}).get("class_attrs", [])
            if member not in attrs:
                out.append(f"{key}: class attribute not published ({owner} has {attrs})")
        elif key not in NAMES:
            out.append(f"{key}: not in the snapshot (add it to extract.TARGETS and regenerate, "
                       "or to FAKE_ONLY if it is a test hook)")
        elif kind == "class":
            out += class_mismatches(key, obj)
        elif kind == "variable":
            if NAMES[key]["kind"] != "variable":
                out.append(f"{key}: variable, published {NAMES[key]['kind']}")
        else:
            out += signature_mismatches(key, obj, kind)
    return out


# ------------------------------------------------------------------ fixtures


@pytest.fixture
def fake_modules(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[ModuleType]]:
    """Every module of the fake vllm-ascend, imported without our patches."""
    _drop_fake_modules()
    monkeypatch.syspath_prepend(str(FAKE))
    importlib.invalidate_caches()
    names = [".".join(p.relative_to(FAKE).with_suffix("").parts).removesuffix(".__init__")
             for p in sorted(FAKE.rglob("*.py"))]
    yield [importlib.import_module(n) for n in names]
    _drop_fake_modules()


# ------------------------------------------------------------------ tests


def test_snapshot_is_complete_and_names_the_targeted_commit() -> None:
    assert SNAPSHOT["missing"] == []
    assert list(NAMES) == list(extract.TARGETS), "extract.TARGETS changed: regenerate the snapshot"
    assert SNAPSHOT["source"]["commit"] in integration.VERSION


def test_fakes_match_the_published_signatures(fake_modules: list[ModuleType]) -> None:
    fakes = fake_api(fake_modules)
    assert len([k for k in fakes if k not in FAKE_ONLY]) >= 30  # the walk found the fakes
    assert api_mismatches(fakes) == []


def test_adapter_names_are_published() -> None:
    for key in ADAPTER_NAMES:
        assert key in NAMES, key
    for key, attr in ADAPTER_ATTRS:
        entry = NAMES[key]
        known = {*entry["class_attrs"], *entry["instance_attrs"], *entry["methods"],
                 *(f["name"] for f in entry.get("fields", []))}
        assert attr in known, (key, attr)


def _sfa_reads() -> tuple[set[str], set[str], set[str], set[str]]:
    """What sfa.py reads of vllm-ascend: ``module.X`` (the patched module), ``super().X`` and
    ``self.X`` in the mixin (not ``_ao_*``, which are ours), ``meta.X``/``attn_metadata.X``."""
    tree = ast.parse(Path(sfa.__file__).read_text(encoding="utf-8"))
    module: set[str] = set()
    supers: set[str] = set()
    selfs: set[str] = set()
    meta: set[str] = set()
    mixin = next(n for n in tree.body
                 if isinstance(n, ast.ClassDef) and n.name == "SparseOffloadSFAMixin")
    in_mixin = {id(n) for n in ast.walk(mixin)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "module":
                module.add(node.attr)
            elif node.value.id in {"meta", "attn_metadata"}:
                meta.add(node.attr)
            elif node.value.id == "self" and id(node) in in_mixin:
                selfs.add(node.attr)
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Call)
              and isinstance(node.value.func, ast.Name) and node.value.func.id == "super"):
            supers.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "getattr" and id(node) in in_mixin
              and isinstance(node.args[0], ast.Name) and node.args[0].id == "self"
              and isinstance(node.args[1], ast.Constant)):
            selfs.add(node.args[1].value)
    return module, supers, {s for s in selfs if not s.startswith("_ao_")}, meta


def test_sfa_adapter_reads_are_published() -> None:
    module, supers, selfs, meta = _sfa_reads()
    assert {"AscendSFABackend", "AscendSFAImpl"} <= module and "forward" in supers  # found
    for name in module:
        assert f"{SFA}:{name}" in NAMES, name
    for name in supers:
        assert f"{SFA}:AscendSFAImpl.{name}" in NAMES, name
    impl = NAMES[f"{SFA}:AscendSFAImpl"]
    for name in selfs:
        assert name in {*impl["instance_attrs"], *impl["class_attrs"], *impl["methods"]}, name
    fields = {f["name"] for f in NAMES[f"{SFA}:AscendSFAMetadata"]["fields"]}
    assert meta and meta <= fields, meta - fields


def test_sfa_adapter_overrides_have_the_published_signatures() -> None:
    overrides = {n: a for n, a in vars(sfa.SparseOffloadSFAMixin).items()
                 if inspect.isfunction(a) and not n.startswith("_ao_")
                 and (n == "__init__" or not n.startswith("__"))}
    assert {"forward", "exec_kv", "_execute_sparse_flash_attention_process",
            "_resolve_preprocess_type"} <= set(overrides)
    init = overrides.pop("__init__")
    assert [k for _, k, _, _ in _params(init)] == [
        "POSITIONAL_OR_KEYWORD", "VAR_POSITIONAL", "VAR_KEYWORD"]  # passes everything on
    problems = [p for name, fn in overrides.items()
                for p in signature_mismatches(f"{SFA}:AscendSFAImpl.{name}", fn, "method")]
    assert problems == []


def test_patched_functions_keep_the_published_signatures(va: Any) -> None:
    sfa_v1 = importlib.import_module(SFA)
    mr = importlib.import_module(runner.RUNNER_MODULE)
    assert sfa._MARK in sfa_v1.AscendSFABackend.__dict__
    patched = _method_kind(sfa_v1.AscendSFABackend.__dict__["get_impl_cls"])
    assert patched is not None
    kind, fn = patched
    assert signature_mismatches(f"{SFA}:AscendSFABackend.get_impl_cls", fn, kind) == []
    plan_fn = getattr(mr, runner.PLAN_FN)
    assert getattr(plan_fn, runner._MARK, None) is not None
    assert signature_mismatches(f"{runner.RUNNER_MODULE}:{runner.PLAN_FN}", plan_fn,
                                "function") == []


def test_checker_reports_drift() -> None:
    """The comparison can fail: a renamed parameter, a lost default, a changed kind, a
    changed literal default, a wrong decorator and a wrong dataclass field are reported."""
    key = f"{SFA}:AscendSFAImpl._execute_sparse_flash_attention_process"

    def renamed(self, ql_nope, q_pe, kv_cache, topk, attn_metadata,  # type: ignore[no-untyped-def]
                actual_seq_lengths_query, actual_seq_lengths_key, block_table=None): ...

    def no_default(self, ql_nope, q_pe, kv_cache, topk_indices,  # type: ignore[no-untyped-def]
                   attn_metadata, actual_seq_lengths_query, actual_seq_lengths_key,
                   block_table): ...

    def kw_only(self, ql_nope, q_pe, kv_cache, topk_indices,  # type: ignore[no-untyped-def]
                attn_metadata, actual_seq_lengths_query, actual_seq_lengths_key, *,
                block_table=None): ...

    def other_default(self, ql_nope, q_pe, kv_cache, topk_indices,  # type: ignore[no-untyped-def]
                      attn_metadata, actual_seq_lengths_query, actual_seq_lengths_key,
                      block_table=0): ...

    for fn in (renamed, no_default, kw_only, other_default):
        assert signature_mismatches(key, fn, "method"), fn.__name__
    assert signature_mismatches(key, no_default, "staticmethod")

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class AscendMLAAttentionSpec:
        scale_dim: int = 0
        scale_dtype: Any = None
        cache_sparse_sfa_c8: bool = True  # published False
        store_on_host: bool = False

    got = class_mismatches(f"{SPECS}:AscendMLAAttentionSpec", AscendMLAAttentionSpec)
    assert got == [f"{SPECS}:AscendMLAAttentionSpec.cache_sparse_sfa_c8: default True, "
                   "published False"]


@pytest.mark.skipif(not os.environ.get("VLLM_ASCEND_SRC"),
                    reason="VLLM_ASCEND_SRC (a vllm-ascend checkout) not set")
def test_snapshot_matches_a_checkout() -> None:
    """With a checkout at the snapshot's commit: the checked-in snapshot is what
    extract.py writes from it."""
    root = Path(os.environ["VLLM_ASCEND_SRC"])
    fresh = extract.snapshot(root, SNAPSHOT["source"]["commit"])
    assert fresh["names"] == NAMES
