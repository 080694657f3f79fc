"""The development build of the native library is cached by source hash, tuned only on
request, and falls back cleanly; a package build tuned for another CPU is refused."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ascend_offload import native, native_build
from ascend_offload.config import SparseOffloadConfig
from ascend_offload.sparse.manager import SparseOffloadManager


def test_missing_compiler_returns_none_and_logs(monkeypatch, tmp_path, caplog) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    monkeypatch.setenv("ASCEND_OFFLOAD_NATIVE_CACHE", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING):
        assert native.build(native.LIB_SOURCES, "ao_sparse_t") is None
    assert "pure-torch fallbacks" in caplog.text


def test_missing_sources_returns_none(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("ASCEND_OFFLOAD_CSRC", str(tmp_path))
    monkeypatch.setenv("ASCEND_OFFLOAD_NATIVE_CACHE", str(tmp_path / "cache"))
    assert native.build(native.LIB_SOURCES, "ao_sparse_t", quiet=True) is None


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_build_is_cached_by_source_hash(monkeypatch, tmp_path) -> None:
    src = tmp_path / "src"
    shutil.copytree(native.source_dir(), src)
    monkeypatch.setenv("ASCEND_OFFLOAD_CSRC", str(src))
    monkeypatch.setenv("ASCEND_OFFLOAD_NATIVE_CACHE", str(tmp_path / "cache"))
    first = native.build(native.LIB_SOURCES, "ao_sparse_t")
    assert first is not None and first.is_file()
    assert native.build(native.LIB_SOURCES, "ao_sparse_t") == first  # cache hit
    with open(src / "rowcopy.cpp", "a") as f:
        f.write("\n// edited\n")
    second = native.build(native.LIB_SOURCES, "ao_sparse_t")
    assert second is not None and second != first  # an edit rebuilds into a new key


def test_digest_and_cache_key_cover_the_included_headers(monkeypatch, tmp_path) -> None:
    """residency.cpp is one translation unit over the residency_*.h it includes: the
    headers are part of the digest a build embeds (and the loader compares) and of the
    development cache key, so a header edit makes a build stale like a source edit."""
    src = tmp_path / "src"
    shutil.copytree(native.source_dir(), src)
    names = native.LIB_SOURCES
    files = native_build.source_files(src, names)
    assert files[:len(names)] == list(names)
    headers = sorted(p.name for p in src.glob("*.h"))
    assert headers and set(headers) <= set(files)  # every header, also those included by one
    # only what a build reads: fastcall.cpp includes none of them
    assert native_build.source_files(src, native_build.FASTCALL_SOURCES) == ["fastcall.cpp"]

    built: list[Path] = []

    def fake_compile(sources, out, **kw):  # the key, not the compiler, is under test
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(b"")
        built.append(out)
        return []

    monkeypatch.setattr(native_build, "compile_library", fake_compile)
    monkeypatch.setenv("ASCEND_OFFLOAD_CSRC", str(src))
    monkeypatch.setenv("ASCEND_OFFLOAD_NATIVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", "g++")
    digests = {native_build.source_digest(src, names)}
    keys = {native.build(names, "ao_sparse_t", quiet=True)}
    for h in headers:
        with open(src / h, "a") as f:
            f.write(f"\n// {h} edited\n")
        digests.add(native_build.source_digest(src, names))
        keys.add(native.build(names, "ao_sparse_t", quiet=True))
    assert len(digests) == len(keys) == len(headers) + 1 == len(built)
    assert {p.name for p in built} == {"libao_sparse_t.so"}


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_build_is_stale_after_a_header_edit(monkeypatch, tmp_path) -> None:
    """A build of residency.cpp embeds a digest covering its headers: after an edit of
    one of them the loader refuses that build as stale (then rebuilds, in a checkout)."""
    src = tmp_path / "src"
    shutil.copytree(native.source_dir(), src)
    monkeypatch.setenv("ASCEND_OFFLOAD_CSRC", str(src))
    lib = tmp_path / "_native" / native_build.LIB_FILE
    assert native_build.compile_library([src / "residency.cpp"], lib, march="generic",
                                        openmp=False) == []
    assert native._unusable(lib, ("residency.cpp",)) is None
    with open(src / "residency_arc.h", "a") as f:
        f.write("\n// edited\n")
    why = native._unusable(lib, ("residency.cpp",))
    assert why is not None and "is stale" in why


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_cpu_tuned_build_is_opt_in_and_keyed_by_cpu_features(monkeypatch, tmp_path) -> None:
    """Generic by default; ASCEND_OFFLOAD_NATIVE_MARCH=native tunes for this CPU, under
    another cache key that includes the CPU's feature list."""
    monkeypatch.setenv("ASCEND_OFFLOAD_NATIVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("ASCEND_OFFLOAD_NATIVE_MARCH", raising=False)
    assert native_build.tune_flags() == ((), "")
    generic = native.build(("rowcopy.cpp",), "ao_tune_t")
    monkeypatch.setenv("ASCEND_OFFLOAD_NATIVE_MARCH", "native")
    tune, features = native_build.tune_flags()
    tuned = native.build(("rowcopy.cpp",), "ao_tune_t")
    assert tuned is not None and generic is not None
    assert native.build(("rowcopy.cpp",), "ao_tune_t", march="generic") == generic
    info = native_build.read_build_info(tuned)
    assert info is not None
    if tune:
        assert features and tuned != generic
        assert info["march"] == "native" and info["cpu"] == native_build.digest(features)
    else:  # no tuning known for this machine: the same generic build
        assert tuned == generic and info["march"] == "generic"


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_tuned_package_build_is_refused_on_another_cpu_and_under_march_0(
        monkeypatch, tmp_path, caplog) -> None:
    """A package build tuned on one host (ASCEND_OFFLOAD_NATIVE_MARCH=native at install)
    is refused, before it is loaded, in a venv copied to a host whose CPU has other
    features, and under ASCEND_OFFLOAD_NATIVE_MARCH=0 at run time; loaded otherwise."""
    if not native_build.tune_flags("native")[0]:
        pytest.skip("no CPU tuning known for this machine")
    pkg = tmp_path / "_native"
    errors = native_build.compile_library(
        [native.source_dir() / s for s in native.LIB_SOURCES], pkg / native_build.LIB_FILE,
        march="native")
    assert errors == []
    monkeypatch.setattr(native, "installed_dir", lambda: pkg)
    monkeypatch.setenv("ASCEND_OFFLOAD_CSRC", str(tmp_path / "no-sources"))  # installed case
    for var in ("ASCEND_OFFLOAD_DISABLE_NATIVE", "ASCEND_OFFLOAD_NATIVE_MARCH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(native, "_logged", set())
    monkeypatch.setattr(native, "_loaded", {})
    features = native_build.cpu_features()
    monkeypatch.setattr(native_build, "cpu_features", lambda: features + " feature_of_another_cpu")
    with caplog.at_level(logging.WARNING):
        assert native.load.__wrapped__() is None  # the uncached loader; the cache stays
    assert "tuned for a CPU with other features" in caplog.text
    monkeypatch.setattr(native_build, "cpu_features", lambda: features)
    monkeypatch.setenv("ASCEND_OFFLOAD_NATIVE_MARCH", "0")
    with caplog.at_level(logging.WARNING):
        assert native.load.__wrapped__() is None
    assert "ASCEND_OFFLOAD_NATIVE_MARCH=0 asks for a generic build" in caplog.text
    monkeypatch.delenv("ASCEND_OFFLOAD_NATIVE_MARCH")
    assert native.load.__wrapped__() is not None
    assert native.loaded_build()["march"] == "native"


def test_disabled_native_falls_back_to_twin_in_a_fresh_process(tmp_path) -> None:
    code = textwrap.dedent("""
        import os, torch
        os.environ["ASCEND_OFFLOAD_DISABLE_NATIVE"] = "1"
        from ascend_offload.config import SparseOffloadConfig
        from ascend_offload.sparse.manager import SparseOffloadManager
        from ascend_offload.sparse.residency import make_residency
        assert make_residency(1, 1, 4).kind == "torch"
        try:
            make_residency(1, 1, 4, use_native="on")
        except RuntimeError as e:
            assert "use_native='on'" in str(e)
        else:
            raise SystemExit("use_native=on did not raise")
        cfg = SparseOffloadConfig(enabled=True, topk_buffer_size=8, index_topk=4)
        m = SparseOffloadManager(cfg, num_layers=1, row_shape=(2,), dtype=torch.float32,
                                 block_size=4, max_requests=1, pool_rows=8)
        assert m.residency.kind == "torch"
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=str(native.source_dir().parent))
    assert out.returncode == 0, out.stderr
    assert "ok" in out.stdout and "ASCEND_OFFLOAD_DISABLE_NATIVE" in out.stderr


@pytest.mark.skipif(not native.available(), reason="native library unavailable")
def test_native_copy_rows_matches_torch_and_checks_bounds() -> None:
    src = torch.randn(100, 7)
    dst = torch.zeros(20, 7)
    sidx = torch.tensor([5, 99, 0, 42], dtype=torch.int32)
    didx = torch.tensor([19, 0, 3, 7], dtype=torch.int32)
    native.copy_rows(src, sidx, dst, didx)
    want = torch.zeros(20, 7)
    want[didx.long()] = src[sidx.long()]
    assert torch.equal(dst, want)
    with pytest.raises(IndexError, match="index 1"):
        native.copy_rows(src, torch.tensor([0, 100], dtype=torch.int32), dst,
                         torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="row layout"):
        native.copy_rows(src, sidx, torch.zeros(20, 6), didx)
    # count=: only the first pairs of longer index buffers (the resolver's miss lists)
    part = torch.zeros(20, 7)
    native.copy_rows(src, sidx, part, didx, count=2)
    want = torch.zeros(20, 7)
    want[didx[:2].long()] = src[sidx[:2].long()]
    assert torch.equal(part, want)
    with pytest.raises(ValueError, match="count=5 outside"):
        native.copy_rows(src, sidx, part, didx, count=5)


@pytest.mark.skipif(not native.available(), reason="native library unavailable")
@pytest.mark.parametrize("row_bytes", [4160, 8192, 16384 + 32, 16384 + 16, 5003],
                         ids=["32B-streams", "8KiB", "16KiB+32", "16B-streams", "memcpy"])
@pytest.mark.parametrize("nthreads", [1, 2])
def test_native_copy_of_long_rows_matches_torch(row_bytes: int, nthreads: int) -> None:
    """Rows over 4 KiB take the prefetch-stream copy (its stream runs past a row's end into
    the next row): every store width and the threaded split move exactly the rows asked."""
    g = torch.Generator().manual_seed(row_bytes)
    src = torch.randint(0, 256, (600, row_bytes), dtype=torch.uint8, generator=g)
    dst = torch.zeros(700, row_bytes, dtype=torch.uint8)
    sidx = torch.randperm(600, generator=g)[:300].to(torch.int32)
    didx = torch.randperm(700, generator=g)[:300].to(torch.int32)
    native.copy_rows(src, sidx, dst, didx, nthreads=nthreads)
    want = torch.zeros_like(dst)
    want[didx.long()] = src[sidx.long()]
    assert torch.equal(dst, want)
    one = torch.zeros_like(dst)  # a single row: the stream has no next row to run into
    native.copy_rows(src, sidx[:1], one, didx[:1])
    assert torch.equal(one[didx[0]], src[sidx[0]]) and int(one.sum()) == int(src[sidx[0]].sum())


def test_manager_uses_native_when_asked() -> None:
    if not native.available():
        pytest.skip("native library unavailable")
    cfg = SparseOffloadConfig(enabled=True, topk_buffer_size=8, index_topk=4, use_native="on")
    m = SparseOffloadManager(cfg, num_layers=1, row_shape=(2,), dtype=torch.float32,
                             block_size=4, max_requests=1, pool_rows=8)
    assert m.residency.kind == "native"


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_vector_and_scalar_paths_give_identical_results(tmp_path) -> None:
    """The AVX-512 and AVX2 paths (when the CPU has them) and the scalar paths give
    the same checksum on the random trace (ASCEND_OFFLOAD_NATIVE_SIMD=0 forces
    scalar, =2 caps at AVX2)."""
    src = native.source_dir()
    drv = Path(__file__).with_name("native_trace_driver.cpp")
    exe = tmp_path / "drv"
    subprocess.run(["g++", "-O3", "-std=c++17", "-fno-strict-aliasing", "-fopenmp", str(drv),
                    str(src / "residency.cpp"), str(src / "rowcopy.cpp"), "-o", str(exe)],
                   check=True, timeout=300)
    env = dict(os.environ)
    vec = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, check=True,
                         env=env)
    env["ASCEND_OFFLOAD_NATIVE_SIMD"] = "2"
    avx2 = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, check=True,
                          env=env)
    env["ASCEND_OFFLOAD_NATIVE_SIMD"] = "0"
    sca = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, check=True,
                         env=env)
    assert vec.stdout.strip() and vec.stdout.strip() == sca.stdout.strip()
    assert avx2.stdout.strip() == sca.stdout.strip()
    # each run really took its path (the driver reports the scan width it used)
    flags = Path("/proc/cpuinfo").read_text().split()
    widest = 512 if {"avx512f", "avx512vl"} <= set(flags) else 256 if "avx2" in flags else 0
    assert vec.stderr.split() == [f"simd={widest}"]
    assert avx2.stderr.split() == [f"simd={min(widest, 256)}"]
    assert sca.stderr.split() == ["simd=0"]


@pytest.mark.skipif(
    shutil.which("g++") is None or shutil.which("aarch64-linux-gnu-g++") is None
    or shutil.which("qemu-aarch64-static") is None,
    reason="needs g++, aarch64-linux-gnu-g++ and qemu-aarch64-static")
def test_aarch64_build_gives_identical_results(tmp_path) -> None:
    """The same random trace (tags, invalidation, releases, 2 threads, row copy)
    gives the same checksum built for x86-64 and for aarch64 (run under qemu)."""
    src = native.source_dir()
    drv = Path(__file__).with_name("native_trace_driver.cpp")
    files = [str(drv), str(src / "residency.cpp"), str(src / "rowcopy.cpp")]
    flags = ["-O3", "-std=c++17", "-fno-strict-aliasing", "-fopenmp"]
    x86, arm = tmp_path / "drv_host", tmp_path / "drv_arm"
    subprocess.run(["g++", *flags, *files, "-o", str(x86)], check=True, timeout=300)
    subprocess.run(["aarch64-linux-gnu-g++", *flags, "-static", *files, "-o", str(arm)],
                   check=True, timeout=300, capture_output=True)
    a = subprocess.run([str(x86)], capture_output=True, text=True, timeout=120, check=True)
    b = subprocess.run(["qemu-aarch64-static", str(arm)], capture_output=True, text=True,
                       timeout=300, check=True)
    assert a.stdout.strip() and a.stdout.strip() == b.stdout.strip()
