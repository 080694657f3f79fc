"""The Ascend fakes have the real wheels' API: parameter names, order, defaults, return
kinds and enum values are read from the installed ``memcache_hybrid`` /
``memfabric_hybrid`` (pybind docstrings) and compared. A wheel whose API moved fails
here, not on an Ascend host."""

from __future__ import annotations

import pytest

from ascend_offload.store.shared import memcache as mc_backend
from tests.support import fake_ascend as fa

MEMCACHE_METHODS = ["setup", "init", "close", "register_buffer", "unregister_buffer", "batch_is_exist",
                    "batch_get_key_info", "remove_batch", "batch_put_from", "batch_get_into",
                    "batch_put_from_layers", "batch_get_into_layers"]
MEMFABRIC_METHODS = ["initialize", "get_rpc_port", "register_memory", "batch_register_memory",
                     "unregister_memory", "batch_transfer_sync_read", "transfer_sync_read",
                     "unInitialize", "destroy"]


def test_fake_memcache_client_matches_the_wheel() -> None:
    mc = pytest.importorskip("memcache_hybrid", reason="the 'ascend' extra is not installed")
    assert fa.api_mismatches(fa.FakeDistributedObjectStore, mc.DistributedObjectStore, MEMCACHE_METHODS) == []
    assert fa.api_mismatches(fa.FakeKeyInfo, mc.KeyInfo, ["size", "loc_list", "type_list", "gva_list"]) == []


def test_fake_memfabric_engine_matches_the_wheel() -> None:
    mf = pytest.importorskip("memfabric_hybrid", reason="the 'ascend' extra is not installed")
    assert fa.api_mismatches(fa.FakeTransferEngine, mf.TransferEngine, MEMFABRIC_METHODS) == []
    real = {name: int(v) for name, v in mf.TransDataOpType.__members__.items()}
    assert {m.name: m.value for m in fa.FakeTransDataOpType} == real


def test_copy_directions_are_the_wheels() -> None:
    mf = pytest.importorskip("memfabric_hybrid", reason="the 'ascend' extra is not installed")
    t = mf.bm.BmCopyType
    assert (mc_backend.H2G, mc_backend.G2H) == (int(t.H2G), int(t.G2H))
    assert (fa.H2G, fa.G2H, fa.L2G, fa.G2L) == (int(t.H2G), int(t.G2H), int(t.L2G), int(t.G2L))
    # the real defaults of the data calls are these directions
    params = dict(fa.pybind_signature(__import__("memcache_hybrid").DistributedObjectStore.batch_put_from)[0])
    assert params["direct"] == str(mc_backend.H2G)


def test_checker_reports_a_drifted_fake() -> None:
    """The comparison can fail: a renamed parameter, a lost default, a changed default
    and a changed return kind are each reported."""
    mc = pytest.importorskip("memcache_hybrid", reason="the 'ascend' extra is not installed")

    class Drifted(fa.FakeDistributedObjectStore):
        def batch_is_exist(self, names) -> list[int]:  # type: ignore[override]
            return []

        def batch_get_into(self, keys, buffer_ptrs, sizes, direct=3) -> list[int]:  # type: ignore[override]
            return []

        def init(self, device_id, init_bm) -> int:  # type: ignore[override]
            return 0

        def close(self) -> list[int]:  # type: ignore[override]
            return []

    got = fa.api_mismatches(Drifted, mc.DistributedObjectStore, ["batch_is_exist", "batch_get_into", "init", "close"])
    assert len(got) == 4, got
    assert any("batch_is_exist: parameters" in p for p in got)
    assert any("batch_get_into.direct: default" in p for p in got)
    assert any("init.init_bm: default missing" in p for p in got)
    assert any("close: returns" in p for p in got)


def test_pybind_signature_parser() -> None:
    class M:
        __name__ = "f"
        __doc__ = ("f(self: X, a: collections.abc.Sequence[typing.SupportsInt], b: int = 3, "
                   "c: R = <R object at 0x1>, d: T = <T.SDMA: 1>) -> list[int]\n\nDoc.")

    params, ret = fa.pybind_signature(M())
    assert params == [("a", None), ("b", "3"), ("c", "<R object at 0x1>"), ("d", "<T.SDMA: 1>")]
    assert ret == "list[int]"
