"""The patch registry (ascend_offload/patches.py) lists every monkeypatch the package applies.

Checked on the sources with ``ast`` (nothing imported but the registry): every
``apply_patch`` / ``restore_patch`` call names a registered patch with a string literal,
every registered patch is applied and restored from the module it names, and no code
outside the registry assigns a patched attribute directly.
"""

from __future__ import annotations

import ast
from pathlib import Path

from ascend_offload.patches import PATCHES

ROOT = Path(__file__).resolve().parents[3]
PKG = ROOT / "ascend_offload"
HELPERS = ("apply_patch", "restore_patch")


def _sources() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if p.name != "patches.py" or p.parent != PKG)


def _dotted(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _helper_calls() -> list[tuple[str, str, str | None]]:
    """(helper, module, patch name or None when not a string literal) of every call."""
    out = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            fn = node.func
            name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else None
            if name not in HELPERS:
                continue
            arg = node.args[0] if node.args else None
            literal = arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None
            out.append((name, _dotted(path), literal))
    return out


def test_every_patch_site_is_registered_and_every_patch_is_applied_and_undone() -> None:
    calls = _helper_calls()
    assert all(name is not None for _, _, name in calls), f"a patch name must be a literal: {calls}"
    unknown = sorted({name for _, _, name in calls if name not in PATCHES})
    assert unknown == [], f"patched but not listed in ascend_offload/patches.py: {unknown}"
    for helper in HELPERS:
        sites = {name: module for h, module, name in calls if h == helper}
        assert sorted(sites) == sorted(PATCHES), f"{helper}: {sorted(sites)} vs {sorted(PATCHES)}"
        for name, module in sites.items():
            assert module == PATCHES[name].where, f"{name} is {helper}'d in {module}"


def _module_strings(tree: ast.Module) -> dict[str, str]:
    """Module-level NAME = "string" constants (an attribute name may be spelled as one)."""
    out = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            out[node.targets[0].id] = node.value.value
    return out


def test_no_patched_attribute_is_assigned_outside_the_registry() -> None:
    attrs = {p.attr for p in PATCHES.values()}
    bad = []
    for path in _sources():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        consts = _module_strings(tree)
        for node in ast.walk(tree):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            bad += [f"{path.relative_to(ROOT)}:{node.lineno}" for t in targets
                    if isinstance(t, ast.Attribute) and t.attr in attrs]
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "setattr" and len(node.args) >= 2):
                key = node.args[1]
                value = key.value if isinstance(key, ast.Constant) else (
                    consts.get(key.id) if isinstance(key, ast.Name) else None)
                if value in attrs:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert bad == [], f"assign these through ascend_offload.patches.apply_patch: {bad}"


def test_registry_entries_say_what_why_when_and_undo() -> None:
    for name, patch in PATCHES.items():
        assert patch.target.endswith("." + patch.attr), name
        assert patch.target.split(".")[0] in ("vllm", "vllm_ascend"), name
        assert all((patch.why, patch.when, patch.undo, (PKG.parent / (patch.where.replace(".", "/") + ".py")).exists()
                    or (PKG.parent / patch.where.replace(".", "/") / "__init__.py").exists())), name
