"""Ascend smoke tests: what an Ascend user runs first, each printing what it measured.

Skipped unless ``torch_npu`` imports and an NPU is visible. Run them all with

    pytest -s -m npu tests/npu

* device copies: a paged KV tensor's blocks to host pages and back (``device.py``);
* a Memcache round trip: blocks off the NPU, through ``MemcacheStore`` (a real meta
  service on loopback, the client's data path on this NPU), back onto the NPU;
* one MemFabric layer pull between two processes (``MemFabricEngine``, prefill and
  decode roles, NPU memory on both sides);
* a prefill + decode pair on a tiny sparse-MLA model behind ``ascend-offload-proxy``,
  launched with the shipped ``configs/ascend`` files (only ports and sizes moved).

Set ``ASCEND_SMOKE_PROTOCOL`` (default ``sdma``) to the MemFabric data-op type of the
host (``device_rdma`` on A2, ``sdma`` on A3 with HCCS) and ``ASCEND_SMOKE_MMC_PROTOCOL``
(default ``device_sdma``) to Memcache's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

torch_npu = pytest.importorskip("torch_npu")

from ascend_offload import device  # noqa: E402

pytestmark = [pytest.mark.npu, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
ASCEND = ROOT / "configs" / "ascend"
MF_PROTOCOL = os.environ.get("ASCEND_SMOKE_PROTOCOL", "sdma")
MMC_PROTOCOL = os.environ.get("ASCEND_SMOKE_MMC_PROTOCOL", "device_sdma")


@pytest.fixture(autouse=True)
def _need_device() -> None:
    if not torch.npu.is_available():  # type: ignore[attr-defined]
        pytest.skip("no NPU visible")


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / max(seconds, 1e-9) / 1e9:.2f} GB/s"


def test_device_copies_round_trip() -> None:
    kv = torch.randn(512, 2, 128, 576, device="npu", dtype=torch.bfloat16)  # 512 blocks of 288 KiB
    ids = list(range(0, 512, 2))
    stream = device.new_stream()
    device.blocks_to_host(kv, 0, ids[:4], stream)  # warm-up
    t = time.perf_counter()
    rows = device.blocks_to_host(kv, 0, ids, stream)
    d2h = time.perf_counter() - t
    back = torch.zeros_like(kv)
    t = time.perf_counter()
    device.blocks_from_host(rows, back, 0, ids, stream)
    h2d = time.perf_counter() - t
    assert torch.equal(back[ids].cpu(), kv[ids].cpu())
    assert int(back[1::2].abs().sum().item()) == 0
    print(f"\ndevice copies: {len(ids)} blocks, {rows.nbytes >> 20} MiB: D2H {_rate(rows.nbytes, d2h)}, "
          f"H2D {_rate(rows.nbytes, h2d)}")


def test_memcache_round_trip(tmp_path: Path) -> None:
    from ascend_offload.bench.stores.memcache import memcache_store_from_config
    from ascend_offload.config import MemcacheStoreConfig
    from ascend_offload.store.services.memcache_meta import MemcacheMeta, available

    if not available():
        pytest.skip("memcache_hybrid not installed (pip install 'ascend-offload[ascend]')")
    kv = torch.randn(64, 2, 128, 576, device="npu", dtype=torch.bfloat16)
    block_bytes = kv[0].numel() * kv.element_size()
    ids = list(range(0, 64, 3))
    keys = [f"smoke-{i}" for i in ids]
    with MemcacheMeta(tmp_path / "meta") as meta:
        cfg = MemcacheStoreConfig(meta_service_url=meta.meta_service_url, config_store_url=meta.config_store_url,
                                  protocol=MMC_PROTOCOL, dram_size="1GB")
        store = memcache_store_from_config(cfg, block_bytes, staging_bytes=64 * block_bytes,
                                           device_id=torch.npu.current_device())
        try:
            stream = device.new_stream()
            rows = device.blocks_to_host(kv, 0, ids, stream).view(len(ids), -1).view(torch.uint8)
            handles = store.allocate(keys, [block_bytes] * len(keys))
            assert handles is not None and all(h is not None for h in handles)
            t = time.perf_counter()
            store.write_batch(handles, rows)  # type: ignore[arg-type]
            store.commit(handles)  # type: ignore[arg-type]
            put_s = time.perf_counter() - t
            assert store.stats().committed_objects == len(keys), store.stats()
            assert store.lookup_prefix(keys) == len(keys)
            t = time.perf_counter()
            pin = store.pin(keys)
            assert pin is not None
            host = device.empty_host((len(keys), block_bytes), torch.uint8)
            store.read_batch(pin, keys, host)
            store.unpin(pin)
            get_s = time.perf_counter() - t
            back = torch.zeros_like(kv)
            device.blocks_from_host(host.view(kv.dtype).view(len(ids), *kv.shape[1:]), back, 0, ids, stream)
            assert torch.equal(back[ids].cpu(), kv[ids].cpu())
            total = len(keys) * block_bytes
            print(f"\nmemcache ({MMC_PROTOCOL}): {len(keys)} objects, {total >> 20} MiB: "
                  f"put {_rate(total, put_s)}, pin+read {_rate(total, get_s)}")
        finally:
            store.close()


_PREFILL = textwrap.dedent("""
    import json, os, sys
    import torch, torch_npu
    from ascend_offload.transfer.memfabric import MemFabricEngine
    torch.npu.set_device(int(sys.argv[1]))
    layer = torch.arange(64 * 1024 * 1024, dtype=torch.int32, device="npu").view(64, -1)  # 256 MiB
    eng = MemFabricEngine(host="127.0.0.1", protocol=sys.argv[2], role="Prefill", device_id=int(sys.argv[1]))
    eng.register(layer.data_ptr(), layer.numel() * layer.element_size())
    torch.npu.synchronize()
    print("@@" + json.dumps({"endpoint": eng.endpoint, "addr": layer.data_ptr(),
                              "nbytes": layer.numel() * layer.element_size()}), flush=True)
    sys.stdin.readline()
    eng.close()
    os._exit(0)
""")


def test_memfabric_layer_pull_between_two_processes() -> None:
    pytest.importorskip("memfabric_hybrid", reason="the 'ascend' extra is not installed")
    from ascend_offload.transfer.base import ReadOp
    from ascend_offload.transfer.memfabric import MemFabricEngine

    n = torch.npu.device_count()  # type: ignore[attr-defined]
    p_dev, d_dev = (1, 0) if n > 1 else (0, 0)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    prefill = subprocess.Popen([sys.executable, "-c", _PREFILL, str(p_dev), MF_PROTOCOL], env=env, text=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert prefill.stdout is not None and prefill.stdin is not None
        info = next(json.loads(ln[2:]) for ln in prefill.stdout if ln.startswith("@@"))
        torch.npu.set_device(d_dev)
        dst = torch.zeros(info["nbytes"] // 4, dtype=torch.int32, device="npu")
        eng = MemFabricEngine(host="127.0.0.1", protocol=MF_PROTOCOL, role="Decode", device_id=d_dev)
        eng.register(dst.data_ptr(), info["nbytes"])
        rows = 64
        row = info["nbytes"] // rows
        ops = [ReadOp(dst.data_ptr() + i * row, info["addr"] + i * row, row) for i in range(rows)]
        eng.read(info["endpoint"], ops[:1])  # warm-up: connection set-up
        t = time.perf_counter()
        descs = eng.read(info["endpoint"], ops)
        pull = time.perf_counter() - t
        want = torch.arange(info["nbytes"] // 4, dtype=torch.int32)
        assert torch.equal(dst.cpu(), want)
        print(f"\nmemfabric ({MF_PROTOCOL}) layer pull NPU{p_dev} -> NPU{d_dev}: {info['nbytes'] >> 20} MiB in "
              f"{descs} descriptor(s): {pull * 1e3:.2f} ms, {_rate(info['nbytes'], pull)}")
        eng.close()
        prefill.stdin.write("done\n")
        prefill.stdin.flush()
        prefill.wait(60)
    finally:
        if prefill.poll() is None:
            prefill.kill()
            prefill.wait(10)


def _moved(name: str, ports: dict[str, int], meta: object) -> dict:
    """A shipped kv-transfer config with its ports and the Memcache URLs moved."""
    cfg = json.loads((ASCEND / name).read_text())
    cfg["kv_port"] = ports[name]
    for child in cfg.get("kv_connector_extra_config", {}).get("connectors", []):
        if "kv_port" in child:
            child["kv_port"] = ports[name]
        extra = child["kv_connector_extra_config"]
        if extra.get("backend") == "memcache":
            extra["memcache"].update(meta_service_url=meta.meta_service_url,  # type: ignore[attr-defined]
                                     config_store_url=meta.config_store_url,  # type: ignore[attr-defined]
                                     protocol=MMC_PROTOCOL, dram_size="4GB")
        if extra.get("transfer_backend") == "memfabric":
            extra["memfabric_transfer_protocol"] = MF_PROTOCOL
    extra = cfg["kv_connector_extra_config"]
    if extra.get("transfer_backend") == "memfabric":
        extra["memfabric_transfer_protocol"] = MF_PROTOCOL
    if "sparse_offload" in extra:  # the tiny model: index top-k 32, blocks of 128
        extra["sparse_offload"].update(index_topk=32, topk_buffer_size=256, dram_size_per_dp_GB=2)
    return cfg


def test_prefill_decode_pair_through_the_proxy(tmp_path: Path) -> None:
    pytest.importorskip("vllm_ascend", reason="vllm-ascend is not installed")
    import httpx

    from ascend_offload.harness.servers import Server, free_port, wait_health
    from ascend_offload.harness.tiny_sparse_model import make_tiny_sparse_model
    from ascend_offload.store.services.memcache_meta import MemcacheMeta

    model = str(make_tiny_sparse_model(tmp_path / "tiny-sparse"))
    p_port, d_port, proxy_port = free_port(), free_port(), free_port()
    kv = {"prefill.json": free_port(), "decode-sparse.json": free_port()}
    env = dict(os.environ, VLLM_HOST_IP="127.0.0.1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    common = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--block-size", "128",
              "--max-model-len", "4096", "--seed", "0", "--host", "127.0.0.1", "--enforce-eager"]
    two = torch.npu.device_count() > 1  # type: ignore[attr-defined]
    servers: list[Server] = []
    with MemcacheMeta(tmp_path / "meta") as meta:
        try:
            servers.append(Server("prefill", [*common, "--port", str(p_port), "--no-enable-prefix-caching",
                                              "--kv-transfer-config", json.dumps(_moved("prefill.json", kv, meta))],
                                  dict(env, ASCEND_RT_VISIBLE_DEVICES="0"), tmp_path))
            servers.append(Server("decode", [*common, "--port", str(d_port), "--kv-transfer-config",
                                             json.dumps(_moved("decode-sparse.json", kv, meta))],
                                  dict(env, ASCEND_RT_VISIBLE_DEVICES="1" if two else "0"), tmp_path))
            args = [a for ln in (ASCEND / "proxy.args").read_text().splitlines()
                    if not ln.startswith("#") for a in ln.split()]
            moved = {"--port": str(proxy_port), "--prefiller-ports": str(p_port), "--decoder-ports": str(d_port),
                     "--host": "127.0.0.1", "--metaserver-port": str(free_port())}
            args = [moved.get(args[i - 1], a) if i else a for i, a in enumerate(args)]
            servers.append(Server("proxy", [sys.executable, "-m", "proxy.cli", *args], env, tmp_path))
            deadline = time.monotonic() + 900
            for port in (p_port, d_port, proxy_port):
                wait_health(f"http://127.0.0.1:{port}/health", servers, deadline)
            prompt = [(7 * i) % 500 + 3 for i in range(700)]
            req = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
            alone = httpx.post(f"http://127.0.0.1:{p_port}/v1/completions", json=req, timeout=300).json()
            t = time.perf_counter()
            pd = httpx.post(f"http://127.0.0.1:{proxy_port}/v1/completions", json=req, timeout=300).json()
            took = time.perf_counter() - t
            assert pd["choices"][0]["text"] == alone["choices"][0]["text"], (pd, alone)
            assert "transfer protocol mismatch" not in servers[0].text()
            print(f"\nP/D pair (memfabric {MF_PROTOCOL}, memcache {MMC_PROTOCOL}): 700-token prompt + 16 tokens "
                  f"through the proxy in {took * 1e3:.0f} ms; tokens identical to the prefill engine alone")
        finally:
            for s in reversed(servers):
                s.stop()
