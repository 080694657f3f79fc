"""The soak's cluster: prefill (layerwise store + RD2H producer through the
MultiConnector), decode (RD2H consumer) and the proxy, with the decode restartable
(same command, same ports) so the soak can SIGKILL it and bring it back."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ascend_offload.harness.servers import Server, free_port, stop_all, wait_health
from proxy.config import registration_max_bytes
from tests.e2e.harness import BLOCK_SIZE, tiny_model

ROOT = Path(__file__).resolve().parents[2]
STARTUP_S = 600.0
RD2H_MODULE = "ascend_offload.connectors.remote_d2h"
MAX_MODEL_LEN = 4096
# The proxy's registration cap for these engines (--max-model-len, --block-size).
REGISTRATION_MAX_BYTES = registration_max_bytes(MAX_MODEL_LEN, BLOCK_SIZE)
# The RD2H deadlines the faults exercise. ack_timeout_s is how long the stall fault holds
# the prefill (a layer never announced keeps its buffer until then): short, so the soak
# stays within its budget. request_timeout_s is when decode gives a pull up (the stall,
# the withheld layers after the failed store read); every other request must finish
# well inside it, also behind an ack_timeout_s stall on a loaded 2-core box, so it has
# headroom. registration_timeout_s is no fault's: only a bound.
RD2H = {"ack_timeout_s": 8, "request_timeout_s": 30, "registration_timeout_s": 60}
# The prefill's protocol fault (its RD2H ``debug.pd_faults``): drop layer 2's readiness
# for 7-block pulls.
PD_FAULTS = "drop:2@7"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "/reliability/" in str(item.fspath):
            item.add_marker(pytest.mark.reliability)


def rd2h_config(role: str, port: int, **extra: Any) -> dict[str, Any]:
    return {"kv_connector": "SfaRemoteD2HConnector", "kv_role": role, "kv_port": port,
            "kv_load_failure_policy": "recompute", "kv_connector_module_path": RD2H_MODULE,
            "kv_connector_extra_config": {**RD2H, **extra}}


def prefill_config(port: int) -> dict[str, Any]:
    """Layer sharing (8 layers on 2 buffers) + store reads + the RD2H producer.

    ``debug: {fail_layer_loads: 1}``: the first layerwise store read fails; the layers
    computed after it are neither saved nor published (docs/reliability.md). The RD2H
    producer injects :data:`PD_FAULTS`."""
    store = {"use_layerwise": True, "layerwise_num_shared_buffers": 1, "layerwise_independent_layers": [0],
             "layerwise_prefetch_layers": 1, "local": {"capacity_bytes": 256 << 20}, "save_timeout_s": 5.0,
             "load_timeout_s": 30.0, "debug": {"fail_layer_loads": 1}}
    return {
        "kv_connector": "AscendMultiConnector", "kv_role": "kv_producer", "kv_port": port,
        "kv_load_failure_policy": "recompute", "kv_connector_module_path": "ascend_offload.connectors.multi",
        "kv_connector_extra_config": {"connectors": [
            {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
             "kv_connector_module_path": "ascend_offload.connectors.store", "kv_connector_extra_config": store},
            rd2h_config("kv_producer", port, debug={"pd_faults": PD_FAULTS}),
        ]},
    }


class Cluster:
    """URLs and servers of the running cluster; ``kill_decode`` / ``restart_decode``."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.model = tiny_model(8)
        p_port, d_port, proxy_port = free_port(), free_port(), free_port()
        p_kv, d_kv = free_port(), free_port()
        # the worker inside the engine-core process (vLLM's uni-process executor): each
        # (re)start is ~10 s shorter; test_pd_e2e and the demo keep the worker process
        env = dict(os.environ, VLLM_HOST_IP="127.0.0.1", VLLM_CPU_KVCACHE_SPACE="1",
                   VLLM_ENABLE_V1_MULTIPROCESSING="0",
                   PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        common = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                  "--dtype", "float32", "--block-size", str(BLOCK_SIZE), "--enforce-eager",
                  "--max-model-len", str(MAX_MODEL_LEN), "--seed", "0", "--host", "127.0.0.1"]
        self.prefill = f"http://127.0.0.1:{p_port}"
        self.decode = f"http://127.0.0.1:{d_port}"
        self.proxy = f"http://127.0.0.1:{proxy_port}"
        self._decode_cmd = [*common, "--port", str(d_port), "--kv-transfer-config",
                            json.dumps(rd2h_config("kv_consumer", d_kv))]
        self._decode_env = dict(env, VLLM_CPU_OMP_THREADS_BIND="1")
        self.decode_starts = 0
        self.servers: dict[str, Server] = {}
        self.servers["prefill"] = Server(
            "prefill", [*common, "--no-enable-prefix-caching", "--port", str(p_port),
                        "--disable-hybrid-kv-cache-manager", "--kv-transfer-config",
                        json.dumps(prefill_config(p_kv))],
            dict(env, VLLM_CPU_OMP_THREADS_BIND="0"), log_dir)
        self._start_decode()
        self.servers["proxy"] = Server(
            "proxy", [sys.executable, "-m", "proxy.cli", "--host", "127.0.0.1", "--port", str(proxy_port),
                      "--prefiller-hosts", "127.0.0.1", "--prefiller-ports", str(p_port),
                      "--decoder-hosts", "127.0.0.1", "--decoder-ports", str(d_port),
                      "--register-timeout-s", "30", "--timeout-s", "60", "--cooldown-s", "1",
                      "--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BLOCK_SIZE)],
            env, log_dir)
        deadline = time.monotonic() + STARTUP_S
        try:
            for name, url in (("prefill", self.prefill), ("decode", self.decode), ("proxy", self.proxy)):
                wait_health(f"{url}/health", list(self.servers.values()), deadline, serving=self.servers[name])
        except BaseException:
            self.stop()
            raise

    def _start_decode(self) -> None:
        self.decode_starts += 1
        name = "decode" if self.decode_starts == 1 else f"decode{self.decode_starts}"
        self.servers["decode"] = Server(name, self._decode_cmd, self._decode_env, self.log_dir)

    def kill_decode(self) -> None:
        """SIGKILL the decode's whole process group (API server, engine core, worker)."""
        s = self.servers["decode"]
        os.killpg(s.proc.pid, signal.SIGKILL)
        s.proc.wait(30)
        s.stop()  # reaps stragglers, closes the log

    def restart_decode(self, timeout_s: float = 300.0) -> float:
        """Start the decode again with the same command; seconds until it was healthy."""
        t0 = time.monotonic()
        self._start_decode()
        wait_health(f"{self.decode}/health", list(self.servers.values()), t0 + timeout_s,
                    serving=self.servers["decode"])
        return time.monotonic() - t0

    def stop(self) -> None:
        stop_all(self.servers.values())

    def log(self, name: str) -> str:
        return self.servers[name].text()


@pytest.fixture(scope="module")
def soak_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("soak"))
    try:
        yield c
    finally:
        c.stop()
