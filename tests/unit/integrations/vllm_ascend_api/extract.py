"""Write the signatures of the vllm-ascend names our adapters and fakes use, as JSON.

Why: vllm-ascend needs ``torch_npu`` and CANN, so it cannot be installed or imported
here; its sources are parsed with ``ast`` instead, and
``tests/unit/integrations/test_fake_vllm_ascend_api.py`` checks the fakes under
``fake_vllm_ascend/`` and the adapters' references against the snapshot this writes.
Only signatures are recorded (parameter names, kinds, defaults; class bases, fields
and attribute names), never code.

    python tests/unit/integrations/vllm_ascend_api/extract.py /path/to/vllm-ascend \\
        > tests/unit/integrations/vllm_ascend_api/snapshot.json

The commit is read from the checkout's git (``--commit`` for a tree without one).
A target that is missing at that commit is listed under ``missing`` and the script
exits 1 after writing the snapshot.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPOSITORY = "https://github.com/vllm-project/vllm-ascend"
COMMAND = ("python tests/unit/integrations/vllm_ascend_api/extract.py /path/to/vllm-ascend "
           "> tests/unit/integrations/vllm_ascend_api/snapshot.json")

_SFA = "vllm_ascend.attention.sfa_v1"
_SFA_OFFLOAD = "vllm_ascend.attention.sfa_kv_offload"
_MANAGER = "vllm_ascend.distributed.kv_transfer.sparse_kv_offload.sparse_kv_offload_manager"
_DEVICE = "vllm_ascend.device.device_op"
_RUNNER = "vllm_ascend.worker.model_runner_v1"
_SPECS = "vllm_ascend.core.kv_cache_interface"
_CONFIG = "vllm_ascend.ascend_config"

# ``module:Qualified.name`` of everything the adapters (ascend_offload/integrations/
# vllm_ascend/) touch and the fakes (tests/unit/integrations/fake_vllm_ascend/) define.
TARGETS: tuple[str, ...] = (
    f"{_SFA}:PreprocessType",
    f"{_SFA}:AscendSFABackend",
    f"{_SFA}:AscendSFABackend.get_name",
    f"{_SFA}:AscendSFABackend.get_kv_cache_shape",
    f"{_SFA}:AscendSFABackend.get_impl_cls",
    f"{_SFA}:AscendSFAMetadata",
    f"{_SFA}:AscendSFAImpl",
    f"{_SFA}:AscendSFAImpl.__init__",
    f"{_SFA}:AscendSFAImpl._resolve_preprocess_type",
    f"{_SFA}:AscendSFAImpl.exec_kv",
    f"{_SFA}:AscendSFAImpl._execute_sparse_flash_attention_process",
    f"{_SFA}:AscendSFAImpl.forward",
    "vllm_ascend.attention.context_parallel.sfa_cp:resolve_sfa_impl",
    f"{_SFA_OFFLOAD}:AscendSFAKVOffloadImpl",
    f"{_SFA_OFFLOAD}:AscendSFAKVOffloadImpl._resolve_preprocess_type",
    f"{_SFA_OFFLOAD}:AscendSFAKVOffloadImpl.exec_kv",
    f"{_SFA_OFFLOAD}:AscendSFAKVOffloadImpl._execute_sparse_flash_attention_process",
    f"{_MANAGER}:SparseKVOffloadManager",
    f"{_MANAGER}:SparseKVOffloadManager.__init__",
    f"{_MANAGER}:SparseKVOffloadManager.offload_new_kv",
    f"{_MANAGER}:SparseKVOffloadManager.onload_topk_kv",
    f"{_MANAGER}:get_sparse_kv_offload_manager",
    f"{_DEVICE}:BaseDeviceAdaptor",
    f"{_DEVICE}:BaseDeviceAdaptor.execute_sparse_flash_attention_process",
    f"{_DEVICE}:DeviceOperator",
    f"{_RUNNER}:apply_layerwise_kv_cache_plan",
    f"{_RUNNER}:NPUModelRunner",
    f"{_RUNNER}:NPUModelRunner.__init__",
    f"{_RUNNER}:NPUModelRunner.initialize_kv_cache",
    f"{_RUNNER}:NPUModelRunner.initialize_kv_cache_tensors",
    f"{_RUNNER}:NPUModelRunner._get_attention_kv_cache_dims",
    f"{_RUNNER}:NPUModelRunner._allocate_kv_cache_tensors",
    f"{_SPECS}:AscendMLAAttentionSpec",
    f"{_SPECS}:AscendSFAIndexerCacheSpec",
    f"{_CONFIG}:get_ascend_config",
    f"{_CONFIG}:AscendConfig",
    f"{_CONFIG}:SparseKVOffloadConfig",
    f"{_CONFIG}:SparseKVOffloadConfig.__init__",
)

_DECORATOR_KINDS = {"staticmethod": "staticmethod", "classmethod": "classmethod",
                    "property": "property", "cached_property": "property"}
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


@dataclass
class Module:
    """One parsed source module: its top-level definitions and what its imports bind."""

    name: str
    file: str
    defs: dict[str, ast.stmt] = field(default_factory=dict)
    imports: dict[str, str] = field(default_factory=dict)  # local name -> dotted origin


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """Module-level statements, including those under ``if``/``try`` (TYPE_CHECKING, fallbacks)."""
    out: list[ast.stmt] = []
    for node in body:
        out.append(node)
        if isinstance(node, ast.If):
            out += _top_level(node.body) + _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            out += _top_level(node.body) + _top_level(node.orelse)
            for handler in node.handlers:
                out += _top_level(handler.body)
    return out


def _assigned_names(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


class Source:
    """A vllm-ascend checkout, parsed module by module on demand."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._modules: dict[str, Module | None] = {}

    def module(self, name: str) -> Module | None:
        if name not in self._modules:
            self._modules[name] = self._parse(name)
        return self._modules[name]

    def _parse(self, name: str) -> Module | None:
        base = self.root.joinpath(*name.split("."))
        path = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if not path.is_file():
            return None
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        mod = Module(name, path.relative_to(self.root).as_posix())
        for node in _top_level(tree.body):
            if isinstance(node, (ast.ClassDef, *_FUNCTIONS)):
                mod.defs[node.name] = node
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    local = alias.asname or alias.name.split(".")[0]
                    mod.imports[local] = alias.name if alias.asname else local
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    mod.imports[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            for target in _assigned_names(node):
                mod.defs.setdefault(target, node)
        return mod

    def qualify(self, mod: Module, expr: ast.expr) -> str:
        """Dotted origin of a name as written in ``mod`` (``Base[T]`` -> ``Base``)."""
        if isinstance(expr, ast.Subscript):
            return self.qualify(mod, expr.value)
        if isinstance(expr, ast.Name):
            if expr.id in mod.imports:
                return mod.imports[expr.id]
            return f"{mod.name}.{expr.id}" if expr.id in mod.defs else expr.id
        if isinstance(expr, ast.Attribute):
            return f"{self.qualify(mod, expr.value)}.{expr.attr}"
        return ast.unparse(expr)

    def split(self, dotted: str) -> tuple[Module, str] | None:
        """``a.b.C`` -> (module ``a.b``, ``C``) when ``a.b`` is a module of the checkout."""
        module, _, name = dotted.rpartition(".")
        mod = self.module(module) if module.startswith("vllm_ascend") else None
        return None if mod is None else (mod, name)


def _default(node: ast.expr | None) -> dict[str, Any]:
    return {"has_default": node is not None, "default": None if node is None else ast.unparse(node)}


def parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[dict[str, Any]]:
    """Parameters in ``inspect.Parameter.kind`` vocabulary, ``self``/``cls`` included."""
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out = [{"name": p.arg, "kind": "POSITIONAL_ONLY" if i < len(a.posonlyargs)
            else "POSITIONAL_OR_KEYWORD", **_default(d)}
           for i, (p, d) in enumerate(zip(positional, defaults, strict=True))]
    if a.vararg is not None:
        out.append({"name": a.vararg.arg, "kind": "VAR_POSITIONAL", **_default(None)})
    out += [{"name": p.arg, "kind": "KEYWORD_ONLY", **_default(d)}
            for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)]
    if a.kwarg is not None:
        out.append({"name": a.kwarg.arg, "kind": "VAR_KEYWORD", **_default(None)})
    return out


def _decorator_name(node: ast.expr) -> str:
    node = node.func if isinstance(node, ast.Call) else node
    return node.attr if isinstance(node, ast.Attribute) else ast.unparse(node)


def function_entry(fn: ast.FunctionDef | ast.AsyncFunctionDef, *, in_class: bool) -> dict[str, Any]:
    kind = "method" if in_class else "function"
    for dec in fn.decorator_list:
        kind = _DECORATOR_KINDS.get(_decorator_name(dec), kind)
    return {"kind": kind, "params": parameters(fn)}


def _dataclass_options(cls: ast.ClassDef) -> dict[str, bool] | None:
    for dec in cls.decorator_list:
        if _decorator_name(dec) != "dataclass":
            continue
        kw = {k.arg: k.value for k in dec.keywords} if isinstance(dec, ast.Call) else {}
        return {opt: isinstance(kw.get(opt), ast.Constant) and kw[opt].value is True  # type: ignore[union-attr]
                for opt in ("frozen", "kw_only")}
    return None


def _is_classvar(annotation: ast.expr) -> bool:
    return "ClassVar" in ast.unparse(annotation)


def _self_attrs(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """Names assigned as ``self.X`` anywhere in ``fn`` (nested functions included)."""
    names: set[str] = set()
    for node in ast.walk(fn):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for t in targets:
            for sub in ast.walk(t):
                if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                        and sub.value.id == "self" and isinstance(sub.ctx, ast.Store)):
                    names.add(sub.attr)
    return names


def class_entry(src: Source, mod: Module, cls: ast.ClassDef) -> dict[str, Any]:
    bases = [src.qualify(mod, b) for b in cls.bases]
    dc = _dataclass_options(cls)
    fields: list[dict[str, Any]] = []
    class_attrs: set[str] = set()
    declared: set[str] = set()
    methods: list[str] = []
    enum_values: dict[str, str] = {}
    kw_only = bool(dc and dc["kw_only"])
    for node in cls.body:
        if isinstance(node, _FUNCTIONS):
            methods.append(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name = node.target.id
            if name == "_" and "KW_ONLY" in ast.unparse(node.annotation):
                kw_only = True
            elif dc is not None and not _is_classvar(node.annotation):
                fields.append({"name": name, "kw_only": kw_only, **_default(node.value)})
            elif node.value is not None:
                class_attrs.add(name)
            else:  # ``x: T`` in a plain class declares an instance attribute
                declared.add(name)
        elif isinstance(node, ast.Assign):
            for name in _assigned_names(node):
                class_attrs.add(name)
                enum_values[name] = ast.unparse(node.value)
    init = next((n for n in cls.body if isinstance(n, _FUNCTIONS) and n.name == "__init__"), None)
    entry: dict[str, Any] = {"kind": "class", "bases": bases, "methods": sorted(methods),
                             "class_attrs": sorted(class_attrs),
                             "instance_attrs": sorted(declared | (_self_attrs(init) if init else set()))}
    if dc is not None:
        entry["dataclass"] = {"frozen": dc["frozen"]}
        entry["fields"] = fields
    if any(b.rpartition(".")[2] in {"Enum", "IntEnum", "StrEnum", "Flag", "IntFlag"} for b in bases):
        entry["enum_values"] = dict(sorted(enum_values.items()))
    return entry


def _member(src: Source, mod: Module, cls: ast.ClassDef, name: str
            ) -> tuple[Module, ast.ClassDef, ast.FunctionDef | ast.AsyncFunctionDef] | None:
    """Method ``name`` of ``cls``, or of its nearest vllm-ascend base that defines it."""
    for node in cls.body:
        if isinstance(node, _FUNCTIONS) and node.name == name:
            return mod, cls, node
    for base in cls.bases:
        where = src.split(src.qualify(mod, base))
        if where is not None:
            found = _lookup(src, *where)
            if found is not None and isinstance(found[1], ast.ClassDef):
                hit = _member(src, found[0], found[1], name)
                if hit is not None:
                    return hit
    return None


def _lookup(src: Source, mod: Module, name: str, depth: int = 0
            ) -> tuple[Module, ast.stmt] | None:
    """Top-level definition ``name`` of ``mod``, following re-exports into vllm-ascend."""
    if name in mod.defs:
        return mod, mod.defs[name]
    origin = mod.imports.get(name)
    where = src.split(origin) if origin is not None and depth < 8 else None
    return None if where is None else _lookup(src, *where, depth=depth + 1)


def extract(src: Source, target: str) -> dict[str, Any] | None:
    """Snapshot entry of one ``module:Qualified.name`` target (None: not found)."""
    module, _, qual = target.partition(":")
    mod = src.module(module)
    head, _, member = qual.partition(".")
    found = None if mod is None else _lookup(src, mod, head)
    if found is None:
        return None
    where, node = found
    if member:
        if not isinstance(node, ast.ClassDef):
            return None
        hit = _member(src, where, node, member)
        if hit is None:
            return None
        owner_mod, owner, fn = hit
        entry = function_entry(fn, in_class=True)
        defined_in = f"{owner_mod.name}:{owner.name}.{member}"
    elif isinstance(node, ast.ClassDef):
        entry, defined_in = class_entry(src, where, node), f"{where.name}:{node.name}"
    elif isinstance(node, _FUNCTIONS):
        entry, defined_in = function_entry(node, in_class=False), f"{where.name}:{node.name}"
    else:
        annotation = node.annotation if isinstance(node, ast.AnnAssign) else None
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        entry = {"kind": "variable",
                 "annotation": None if annotation is None else ast.unparse(annotation),
                 "value": None if value is None else ast.unparse(value)}
        defined_in = f"{where.name}:{head}"
    entry["file"] = src.module(defined_in.partition(":")[0]).file  # type: ignore[union-attr]
    if defined_in != target:
        entry["defined_in"] = defined_in
    return entry


def _git(root: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                             check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


def snapshot(root: Path, commit: str | None = None, targets: tuple[str, ...] = TARGETS
             ) -> dict[str, Any]:
    """The whole snapshot of ``targets`` in the checkout at ``root``."""
    src = Source(root)
    commit = commit or _git(root, "rev-parse", "HEAD")
    if commit is None:
        raise SystemExit(f"{root}: not a git checkout; name the source commit with --commit")
    names: dict[str, Any] = {}
    missing: list[str] = []
    for target in targets:
        entry = extract(src, target)
        if entry is None:
            missing.append(target)
        else:
            names[target] = entry
    return {"source": {"repository": REPOSITORY, "commit": commit,
                       "commit_date": _git(root, "log", "-1", "--format=%cI", commit)},
            "regenerate": COMMAND, "names": names, "missing": missing}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", type=Path, help="vllm-ascend source tree (holds vllm_ascend/)")
    parser.add_argument("--commit", help="source commit, when the tree has no git metadata")
    args = parser.parse_args(argv)
    if not (args.checkout / "vllm_ascend").is_dir():
        parser.error(f"{args.checkout} has no vllm_ascend/ package")
    snap = snapshot(args.checkout, args.commit)
    json.dump(snap, sys.stdout, indent=1, sort_keys=False)
    sys.stdout.write("\n")
    for target in snap["missing"]:
        print(f"missing at {snap['source']['commit']}: {target}", file=sys.stderr)
    return 1 if snap["missing"] else 0


if __name__ == "__main__":
    sys.exit(main())
