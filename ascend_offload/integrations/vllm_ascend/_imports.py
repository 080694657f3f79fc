"""Run a callback on a module right after it is first imported (or now, if it is loaded).

Why: our plugin loads in every vLLM process, possibly before vllm-ascend's own
plugins, and importing vllm-ascend's attention or model-runner modules there
would pull torch_npu and kernels into processes that never build a layer. The
patches are applied when vllm-ascend itself imports those modules.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

Callback = Callable[[ModuleType], None]


class _AfterImport(importlib.abc.MetaPathFinder):
    """Wraps the found loader of the watched modules so ``callback`` runs after exec."""

    def __init__(self) -> None:
        self.watched: dict[str, Callback] = {}

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> Any:
        callback = self.watched.get(fullname)
        if callback is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original_exec(module)
            self.watched.pop(fullname, None)
            callback(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_finder = _AfterImport()


def when_imported(name: str, callback: Callback) -> None:
    """``callback(module)`` now if ``name`` is loaded, else right after its first import."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    _finder.watched[name] = callback
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def forget(name: str) -> None:
    """Stop watching ``name`` (uninstall before the module was imported)."""
    _finder.watched.pop(name, None)
    if not _finder.watched and _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
