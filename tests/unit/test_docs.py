"""The docs point at things that exist: links, anchors, module paths, invariants."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "configs").rglob("README.md")])

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_CODE = re.compile(r"`([^`\s]+)`")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
# A code span naming a path under one of these is taken as a path of this repository,
# relative to its root or to ascend_offload/ (the docs' two conventions).
_PATH_ROOTS = ("ascend_offload/", "proxy/", "tests/", "csrc_npu/", "configs/", "docs/", "store/",
               "layerwise/", "pd/", "sparse/", "transfer/", "connectors/", "bench/", "harness/",
               "integrations/", "models/", "demo/")
_INVARIANT = re.compile(r"\bI(\d+)\b")


def _prose(path: Path) -> str:
    """The page without its fenced code blocks (shell examples, tables of output)."""
    return _FENCE.sub("", path.read_text(encoding="utf-8"))


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", _prose(path), re.M)}


def broken_links() -> list[str]:
    bad = []
    for doc in DOCS:
        for m in _LINK.finditer(_prose(doc)):
            target = m.group(1)
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path) if path else doc
            where = f"{doc.relative_to(ROOT)}: ({target})"
            if not dest.exists():
                bad.append(f"{where} no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{where} no such heading")
    return bad


def test_relative_links_point_to_existing_files_and_headings():
    assert broken_links() == []


def missing_paths() -> list[str]:
    bad = []
    for doc in DOCS:
        for m in _CODE.finditer(_prose(doc)):
            span = m.group(1).rstrip(".,;")
            path = re.split(r"::|:(?=\w)", span)[0]
            if not path.startswith(_PATH_ROOTS) or any(c in path for c in "*<>{}|$"):
                continue
            if not re.search(r"\.(py|md|json|cpp|h|conf|args)$|/$", path):
                continue
            if not any((base / path).exists() for base in (ROOT, ROOT / "ascend_offload")):
                bad.append(f"{doc.relative_to(ROOT)}: `{span}`")
    return bad


def test_module_paths_named_in_the_docs_exist():
    """`store/book/tier_waits.py`, `tests/unit/...`: relative to the repository or the package."""
    assert missing_paths() == []


def _defined_invariants() -> set[str]:
    text = (ROOT / "docs" / "invariants.md").read_text(encoding="utf-8")
    return set(re.findall(r"^## (I\d+):", text, re.M))


def cited_invariants() -> dict[str, list[str]]:
    cited: dict[str, list[str]] = {}
    files = [*(ROOT / "docs").glob("*.md"), ROOT / "README.md", *(ROOT / "ascend_offload").rglob("*.py")]
    for path in files:
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for m in _INVARIANT.finditer(line):
                cited.setdefault(f"I{m.group(1)}", []).append(f"{path.relative_to(ROOT)}:{n}")
    return cited


def test_every_cited_invariant_is_defined():
    defined = _defined_invariants()
    assert defined == {f"I{n}" for n in range(1, 8)}
    undefined = {k: v for k, v in cited_invariants().items() if k not in defined}
    assert undefined == {}, "define these in docs/invariants.md"


def test_architecture_links_the_invariants():
    assert "(invariants.md)" in (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
