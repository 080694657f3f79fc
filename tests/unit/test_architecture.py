"""The rules of docs/architecture.md that a machine can check, on the sources.

Every check parses files with ``ast`` (nothing is imported, so no vLLM and no torch):
import rules, where platform differences may live, environment reads, and that the
layout table of docs/architecture.md lists exactly the modules that exist.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "ascend_offload"
ARCH_DOC = ROOT / "docs" / "architecture.md"

DOMAIN = ("layerwise", "store", "transfer", "pd", "sparse")
PLATFORM = ("device", "native", "native_build", "kv_layout", "config", "errors")
ADAPTERS_AND_TOOLS = ("connectors", "models", "integrations", "plugin", "bench", "harness", "demo",
                      "cli", "check_config")
VLLM_ROOTS = ("vllm", "vllm_ascend")


# ----------------------------------------------------------------------------- sources


def _modules() -> list[Path]:
    return sorted([*PKG.rglob("*.py"), *(ROOT / "proxy").rglob("*.py")])


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _dotted(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _tree(path: Path) -> ast.Module:
    return _parse(path.read_text(encoding="utf-8"))


@functools.cache
def _parse(source: str) -> ast.Module:
    """Cached by text: the failure checks' copies of the sources reuse the trees."""
    return ast.parse(source)


@functools.cache
def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _in_function(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return True
    return False


def _enclosing_function(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> str:
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return node.name
    return "<module>"


def imports(path: Path) -> tuple[tuple[str, int, bool], ...]:
    dotted = _dotted(path)
    package = dotted if path.name == "__init__.py" else dotted.rpartition(".")[0]
    return _imports(package, _tree(path))


@functools.cache
def _imports(package: str, tree: ast.Module) -> tuple[tuple[str, int, bool], ...]:
    return tuple(_walk_imports(package, tree))


def _walk_imports(package: str, tree: ast.Module) -> Iterator[tuple[str, int, bool]]:
    """``(module, line, inside a function)`` for every import of ``path``: ``import``,
    ``from`` (relative ones resolved; each imported name also as ``module.name``, which
    may be a submodule) and ``importlib.import_module`` / ``__import__`` /
    ``find_spec`` of a string constant."""
    parents = _parents(tree)
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            names = [module, *(f"{module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            arg = node.args[0]
            if (fname in ("import_module", "__import__", "find_spec") and isinstance(arg, ast.Constant)
                    and isinstance(arg.value, str)):
                names = [arg.value]
        for name in names:
            yield name, node.lineno, _in_function(node, parents)


def _top(name: str) -> str:
    return name.split(".")[0]


def _group(name: str) -> str | None:
    """``layerwise``, ``device``, ``proxy``... for a module of ours; None otherwise."""
    parts = name.split(".")
    if parts[0] == "proxy":
        return "proxy"
    if parts[0] != "ascend_offload" or len(parts) < 2:
        return None
    return parts[1]


def _group_of(path: Path) -> str | None:
    return _group(_dotted(path))


def vllm_importers() -> dict[str, list[int]]:
    """Module path -> lines where it imports vLLM or vllm-ascend (anywhere in the file)."""
    found: dict[str, list[int]] = {}
    for path in _modules():
        lines = [line for name, line, _ in imports(path) if _top(name) in VLLM_ROOTS]
        if lines:
            found[_rel(path)] = sorted(set(lines))
    return found


# ----------------------------------------------------------------------------- import rules


def domain_vllm_imports() -> list[str]:
    return [f"{path}:{lines}" for path, lines in vllm_importers().items()
            if path.split("/")[1] in DOMAIN]


def test_domain_packages_never_import_vllm():
    """Module level or inside a function: a domain package runs without vLLM."""
    assert domain_vllm_imports() == []


def _doc_vllm_list() -> list[str]:
    text = ARCH_DOC.read_text(encoding="utf-8")
    m = re.search(r"Modules that import vLLM, the complete list.*?:(.*?)(?:\n\s*\n|\n\* )", text, re.S)
    assert m, "docs/architecture.md no longer states which modules import vLLM"
    # the list ends at the first sentence that is not part of it
    listed = re.split(r"\.\s", m.group(1), maxsplit=1)[0]
    entries = re.findall(r"`([^`]+)`", listed)
    assert entries, "the list of modules that import vLLM is empty"
    return entries


def vllm_list_mismatches() -> tuple[list[str], list[str]]:
    """(importers no entry covers, entries that cover no importer). Entries are paths
    under ascend_offload/; one ending in ``/`` covers every module below it."""
    entries = _doc_vllm_list()
    real = [p.removeprefix("ascend_offload/") for p in vllm_importers()]

    def covers(entry: str, module: str) -> bool:
        return module.startswith(entry) if entry.endswith("/") else module == entry

    uncovered = [m for m in real if not any(covers(e, m) for e in entries)]
    unused = [e for e in entries if not any(covers(e, m) for m in real)]
    return uncovered, unused


def test_the_documented_vllm_importers_are_the_real_ones():
    uncovered, unused = vllm_list_mismatches()
    assert uncovered == [], ("these modules import vLLM but docs/architecture.md "
                             "('Modules that import vLLM') does not list them")
    assert unused == [], ("docs/architecture.md lists these as importing vLLM; "
                          "none of their modules does")


def test_vllm_ascend_is_imported_lazily():
    """A process without vllm-ascend never imports it: only inside functions."""
    top_level = [f"{_rel(p)}:{line}" for p in _modules() for name, line, in_fn in imports(p)
                 if _top(name) == "vllm_ascend" and not in_fn]
    assert top_level == []


def test_layers_point_down():
    bad = []
    for path in _modules():
        group = _group_of(path)
        for name, line, _ in imports(path):
            target = _group(name)
            if target is None or target == group:
                continue
            if group in DOMAIN and target in ADAPTERS_AND_TOOLS:
                bad.append(f"{_rel(path)}:{line} (domain) imports {name}")
            if group in PLATFORM and (target in DOMAIN or target in ADAPTERS_AND_TOOLS):
                bad.append(f"{_rel(path)}:{line} (platform) imports {name}")
            if group == "proxy" and _top(name) == "ascend_offload":
                bad.append(f"{_rel(path)}:{line} (proxy) imports {name}")
    for path in (ROOT / "proxy").rglob("*.py"):
        bad += [f"{_rel(path)}:{line} imports {name}" for name, line, _ in imports(path)
                if _top(name) in VLLM_ROOTS]
    assert bad == []


def test_pydantic_schemas_live_in_config():
    users = sorted({_rel(p) for p in _modules() for name, _, _ in imports(p) if _top(name) == "pydantic"})
    assert users == ["ascend_offload/config.py"]


def test_shipped_code_never_imports_tests():
    bad = [f"{_rel(p)}:{line}" for p in _modules() for name, line, _ in imports(p) if _top(name) == "tests"]
    assert bad == []


# ----------------------------------------------------------------------------- platform


# (file, function) -> why it may ask torch about placement itself.
PLATFORM_EXCEPTIONS = {
    ("ascend_offload/sparse/residency.py", "_host"):
        "arguments handed to the native residency table as raw pointers; per layer call",
    ("ascend_offload/sparse/residency.py", "resolve_layer"):
        "the same check inlined on the per-layer path (docs/sparse.md: host cost per call)",
}


def platform_uses() -> list[str]:
    """Outside device.py: ``.device.type``, ``device.type``, ``.is_cuda`` / ``.is_cpu``,
    ``torch.cuda``, ``torch.npu``, ``torch_npu``."""
    bad = []
    for path in _modules():
        rel = _rel(path)
        if rel == "ascend_offload/device.py":
            continue
        tree = _tree(path)
        parents = _parents(tree)
        for node in ast.walk(tree):
            what = None
            if isinstance(node, ast.Attribute):
                value = node.value
                if node.attr == "type" and (
                        (isinstance(value, ast.Attribute) and value.attr == "device")
                        or (isinstance(value, ast.Name) and value.id == "device")):
                    what = "device.type"
                elif node.attr in ("is_cuda", "is_cpu", "is_npu"):
                    what = node.attr
                elif node.attr in ("cuda", "npu") and isinstance(value, ast.Name) and value.id == "torch":
                    what = f"torch.{node.attr}"
            elif isinstance(node, ast.Name) and node.id == "torch_npu":
                what = "torch_npu"
            if what is None:
                continue
            if (rel, _enclosing_function(node, parents)) in PLATFORM_EXCEPTIONS:
                continue
            bad.append(f"{rel}:{node.lineno} {what}")
        bad += [f"{rel}:{line} imports {name}" for name, line, _ in imports(path) if _top(name) == "torch_npu"]
    return bad


def test_platform_differences_live_in_device_py():
    """Ask ``device.is_host`` / ``device.platform()`` instead (a fake device answers
    them in tests; a comparison with ``"cpu"`` would not see it)."""
    assert platform_uses() == []


def test_platform_exceptions_are_still_needed():
    """Each exception names code that still exists (a stale one would hide a new use)."""
    for (rel, func), _why in PLATFORM_EXCEPTIONS.items():
        tree = _tree(ROOT / rel)
        assert any(isinstance(n, ast.FunctionDef) and n.name == func for n in ast.walk(tree)), (rel, func)


# ----------------------------------------------------------------------------- environment


ENV_READERS = {
    "ascend_offload/native.py",        # the native library's switches (docs/config.md)
    "ascend_offload/native_build.py",  # CXX, the -march switch
    "ascend_offload/transfer/mooncake.py",  # Mooncake's transport deadlines, which it sets
}
ENV_TOOLS = ("bench", "harness", "demo")  # they start processes and pass environments on


def environment_uses() -> list[str]:
    bad = []
    for path in _modules():
        rel = _rel(path)
        if rel in ENV_READERS or _group_of(path) in ENV_TOOLS:
            continue
        for node in ast.walk(_tree(path)):
            if (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv", "environb")
                    and isinstance(node.value, ast.Name) and node.value.id == "os"):
                bad.append(f"{rel}:{node.lineno} os.{node.attr}")
        bad += [f"{rel}:{line} imports {name}" for name, line, _ in imports(path)
                if name in ("os.environ", "os.getenv", "os.putenv")]
    return bad


def test_hooks_come_from_config_not_the_environment():
    """Test and fault hooks arrive through the connectors' typed ``debug:`` block."""
    assert environment_uses() == []


# ----------------------------------------------------------------------------- layout table


def layout_entries() -> list[str]:
    """Paths named in the layout block of docs/architecture.md (directories end in /)."""
    text = ARCH_DOC.read_text(encoding="utf-8")
    section = text[text.index("## Layout"):]
    block = section[section.index("```") + 3:]
    block = block[block.index("\n") + 1: block.index("```")]
    lines = [line for line in block.splitlines() if line.strip()]
    desc_col = min(len(line) - len(line.lstrip()) for line in lines
                   if line.startswith(" ") and len(line) - len(line.lstrip()) > 8)
    stack: list[tuple[int, str]] = []  # (indent, directory)
    out = []
    for line in lines:
        indent = len(line) - len(line.lstrip())
        if indent >= desc_col:
            continue  # a description's continuation
        field = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        prefix = "".join(d for _, d in stack)
        for name in (n.strip() for n in field.split(",")):
            out.append(prefix + name)
        if field.endswith("/"):
            stack.append((indent, field))
    return out


def layout_mismatches() -> tuple[list[str], list[str]]:
    """(modules missing from the table, table entries that do not exist)."""
    entries = layout_entries()
    named = set(entries)
    missing = []
    for path in _modules():
        rel = _rel(path)
        if path.name == "__init__.py":
            rel = rel.removesuffix("__init__.py")  # the package's own line
        if rel not in named:
            missing.append(rel)
    for path in sorted((ROOT / "csrc_npu").iterdir()):
        if path.suffix in (".cpp", ".h", ".c") and _rel(path) not in named:
            missing.append(_rel(path))
    absent = [e for e in entries if not (ROOT / e).exists()]
    return missing, absent


def test_layout_table_lists_every_module():
    missing, _ = layout_mismatches()
    assert missing == [], "add these to the layout block of docs/architecture.md"


def test_layout_table_names_only_existing_files():
    _, absent = layout_mismatches()
    assert absent == [], "the layout block of docs/architecture.md names files that do not exist"


def test_layout_parser_sees_nested_entries():
    """Guards the parser: a nested entry gets its directories' prefix."""
    entries = layout_entries()
    assert "ascend_offload/store/book/tier_waits.py" in entries
    assert "csrc_npu/residency_arc.h" in entries
    assert "proxy/app.py" in entries


def test_residency_headers_belong_to_one_translation_unit():
    includers = sorted(
        path.name for path in (ROOT / "csrc_npu").iterdir() if path.suffix in (".cpp", ".h", ".c")
        if re.search(r'#include\s+"residency_\w+\.h"', path.read_text(encoding="utf-8")))
    assert all(n == "residency.cpp" or n.startswith("residency_") for n in includers), includers


# ----------------------------------------------------------------------------- the checks fail


@pytest.fixture
def scratch_root(tmp_path, monkeypatch):
    """The checks pointed at a copy of the sources and docs (tests write into it)."""
    import shutil
    import sys

    for top in ("ascend_offload", "proxy", "csrc_npu", "docs"):
        shutil.copytree(ROOT / top, tmp_path / top,
                        ignore=shutil.ignore_patterns("_native", "__pycache__", "*.so", "*.egg-info"))
    for name in ("pyproject.toml", "setup.py", "Makefile"):
        (tmp_path / name).touch()
    for name in ("configs", "tests"):
        (tmp_path / name).mkdir()
    me = sys.modules[__name__]
    monkeypatch.setattr(me, "ROOT", tmp_path)
    monkeypatch.setattr(me, "PKG", tmp_path / "ascend_offload")
    monkeypatch.setattr(me, "ARCH_DOC", tmp_path / "docs" / "architecture.md")
    return tmp_path


def test_a_domain_module_importing_vllm_fails(scratch_root):
    (scratch_root / "ascend_offload/store/local.py").write_text(
        (scratch_root / "ascend_offload/store/local.py").read_text(encoding="utf-8")
        + "\n\ndef _late():\n    from vllm.config import VllmConfig\n    return VllmConfig\n",
        encoding="utf-8")
    assert "ascend_offload/store/local.py" in [e.split(":")[0] for e in domain_vllm_imports()]
    assert "store/local.py" in vllm_list_mismatches()[0]


def test_a_module_missing_from_the_table_fails(scratch_root):
    (scratch_root / "ascend_offload/pd/extra.py").write_text("X = 1\n", encoding="utf-8")
    doc = scratch_root / "docs/architecture.md"
    doc.write_text(doc.read_text(encoding="utf-8").replace(
        "    auth.py               optional", "    gone.py               optional"), encoding="utf-8")
    missing, absent = layout_mismatches()
    assert {"ascend_offload/pd/auth.py", "ascend_offload/pd/extra.py"} <= set(missing)
    assert "ascend_offload/pd/gone.py" in absent


def test_a_device_type_comparison_fails(scratch_root):
    (scratch_root / "ascend_offload/transfer/extra.py").write_text(
        "import torch\n\ndef f(t):\n    return t.device.type == 'cpu' or torch.cuda.is_available()\n",
        encoding="utf-8")
    found = platform_uses()
    assert "ascend_offload/transfer/extra.py:4 device.type" in found
    assert "ascend_offload/transfer/extra.py:4 torch.cuda" in found
