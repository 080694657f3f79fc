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


class _CallbackLoader(importlib.abc.Loader):
    """Delegates to the module's own loader; runs the callback once the module executed."""

    def __init__(self, loader: Any, callback: Callback) -> None:
        self._loader = loader
        self._callback = callback

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._callback(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... of the real loader
        return getattr(self._loader, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds a watched module with the other finders and wraps its loader."""

    def __init__(self) -> None:
        self.watched: dict[str, Callback] = {}

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> Any:
        callback = self.watched.pop(fullname, None)
        if callback is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            self.watched[fullname] = callback  # not importable (yet): keep watching
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _CallbackLoader(spec.loader, callback)
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
