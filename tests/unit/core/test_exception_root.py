"""Every exception class a package defines derives from that package's root.

Why: callers catch ``AscendOffloadError`` (library) or ``AscendOffloadProxyError``
(proxy) to handle whatever the package raises on purpose; a new class outside the root
would slip through. Modules are walked with pkgutil; a module whose optional
dependency is absent here (torch_npu, vllm_ascend, ...) is skipped, and the skip
names the missing module.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import types
import warnings

import pytest

import ascend_offload
import proxy
from ascend_offload.errors import AscendOffloadError
from proxy.errors import AscendOffloadProxyError

# Modules that run something when imported (entry points), not libraries.
_NOT_IMPORTED = {"ascend_offload.__main__", "proxy.__main__"}


def _modules(package: types.ModuleType) -> tuple[list[types.ModuleType], list[str]]:
    """The package's importable modules, and 'module (missing name)' for the others."""
    found: list[types.ModuleType] = [package]
    missing: list[str] = []
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".",
                                      onerror=lambda name: missing.append(name)):
        if info.name in _NOT_IMPORTED:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                found.append(importlib.import_module(info.name))
        except ImportError as exc:  # an optional dependency, named in the report
            missing.append(f"{info.name} ({exc.name or exc})")
    return found, missing


def _exception_classes(modules: list[types.ModuleType]) -> dict[str, type[BaseException]]:
    """Exception classes defined in ``modules`` (not those they import)."""
    out: dict[str, type[BaseException]] = {}
    for mod in modules:
        for _, obj in inspect.getmembers(mod, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__ == mod.__name__:
                out[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return out


@pytest.mark.parametrize(("package", "root"), [(ascend_offload, AscendOffloadError),
                                               (proxy, AscendOffloadProxyError)])
def test_every_exception_derives_from_the_package_root(
        package: types.ModuleType, root: type[BaseException]) -> None:
    modules, missing = _modules(package)
    classes = _exception_classes(modules)
    assert root in classes.values()
    assert len(classes) > 1, f"no exception classes found in {package.__name__}"
    outside = sorted(name for name, cls in classes.items() if not issubclass(cls, root))
    assert not outside, f"not derived from {root.__name__}: {outside}"
    if missing:
        print(f"{package.__name__}: not imported here (optional dependency missing): {missing}")


def test_roots_keep_the_builtin_bases_callers_catch() -> None:
    from ascend_offload.config import ConfigError
    from ascend_offload.layerwise.steps import LoadTimeout, PipelineError
    from ascend_offload.pd.protocol import ProtocolError
    from ascend_offload.store.base import StoreError

    assert issubclass(ConfigError, ValueError) and issubclass(ProtocolError, ValueError)
    assert issubclass(StoreError, RuntimeError) and issubclass(PipelineError, RuntimeError)
    assert issubclass(LoadTimeout, TimeoutError)
    for cls in (ConfigError, ProtocolError, StoreError, PipelineError, LoadTimeout):
        assert issubclass(cls, AscendOffloadError)
