"""Layer sharing on the prefill *and* P/D pulls: ``AscendMultiConnector`` on vLLM CPU.

The prefill runs ``AscendStoreConnector`` with ``use_layerwise`` (8 layers, I = [0],
B = 1: the 7 other layers time-share ONE physical buffer, so layer i's buffer is
rewritten by layer i + 1 within the same forward) together with the
``SfaRemoteD2HConnector`` producer; decode pulls every layer over Mooncake TCP.
Decode reads of a layer must therefore hold its buffer (reuse gate) until
decode answered. Without that, decode reads a later layer's KV and the tokens
change; with it, tokens equal the plain answer (decode server, no transfer)
for prompts of 40-1300 tokens, streaming and not, and decode logs no load failure.

Fault: the prefill's test-only injection drops layer 2's readiness for 7-block
prompts. Decode never reads layer 2, so its gate token is held until the
producer's ack deadline (20 s), longer than the store's own gate wait (5 s):
the prefill must outwait it (not fail its forward), decode recomputes, tokens
stay identical and the prefill keeps serving.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

pytest.importorskip("mooncake.engine")

from ascend_offload.harness.tiny_model import random_prompts
from tests.e2e.harness import tiny_model
from tests.e2e.pd_cluster import (
    body,
    complete,
    log_lines,
    log_sizes,
    pd_cluster,
    rd2h_config,
    stream,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

LENGTHS = [40, 1300, 333, 97, 760, 512, 64, 900]
PROMPTS = random_prompts(len(LENGTHS), LENGTHS, seed=23)
MAX_TOKENS = 12
FAULTS = "drop:2@7"  # by block count; no prompt above has 7 blocks
FAULT_PROMPT = random_prompts(1, [210], seed=3)[0]  # 7 blocks of 32
BAD = ("Recovered from KV load failure", "blocks failed to load", "decode did not read", "cannot send",
       "cannot receive", "Traceback", "has no reuse-gate token")


def prefill_config(kv_port: int, rd2h_extra: dict[str, Any]) -> dict[str, Any]:
    store = {"use_layerwise": True, "layerwise_num_shared_buffers": 1, "layerwise_independent_layers": [0],
             "layerwise_prefetch_layers": 1, "local": {"capacity_bytes": 256 << 20}, "save_timeout_s": 5.0,
             "load_timeout_s": 60.0}
    return {
        "kv_connector": "AscendMultiConnector", "kv_role": "kv_producer", "kv_port": kv_port,
        "kv_connector_module_path": "ascend_offload.connectors.multi",
        "kv_connector_extra_config": {"connectors": [
            {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
             "kv_connector_module_path": "ascend_offload.connectors.store", "kv_connector_extra_config": store},
            rd2h_config("kv_producer", kv_port, rd2h_extra),
        ]},
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    extra = {"ack_timeout_s": 20, "request_timeout_s": 20, "registration_timeout_s": 20}
    with pd_cluster(tiny_model(8), tmp_path_factory.mktemp("pd-layerwise-e2e"),
                    lambda port: prefill_config(port, {**extra, "debug": {"pd_faults": FAULTS}}),
                    lambda port: rd2h_config("kv_consumer", port, extra),
                    prefill_args=("--disable-hybrid-kv-cache-manager",)) as c:
        yield c


LAYERS = 8
BLOCK = 32
BLOCK_BYTES = 2 * BLOCK * 2 * 32 * 4  # K and V, 32 tokens, 2 KV heads of 32 dims, float32


def _pulled(url: str) -> tuple[float, float]:
    """(layers, bytes) pulled by the decode so far, from its Prometheus counters."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    total = {"layers_pulled": 0.0, "bytes_pulled": 0.0}
    for line in text.splitlines():
        for key in total:
            if line.startswith(f"vllm:ascend_offload_rd2h_{key}_total"):
                total[key] += float(line.rsplit(" ", 1)[1])
    return total["layers_pulled"], total["bytes_pulled"]


def _body(model: str, prompt: list[int], streaming: bool) -> dict[str, Any]:
    return body(model, prompt, streaming, MAX_TOKENS)


def test_layer_sharing_prefill_with_pd_pull_matches_plain(cluster: dict[str, Any]) -> None:
    model = cluster["model"]
    prefill = cluster["servers"]["prefill"]
    assert "decode reads of each layer hold its physical buffer (8 layers on 2 buffers)" in prefill.text()
    since = log_sizes(cluster)
    pulled0 = _pulled(cluster["decode"])
    pd = [complete(cluster["proxy"], _body(model, p, False)) for p in PROMPTS]
    # The whole prompt came over the wire, every layer: at least its full blocks
    # (asking the decode server first would have left them in its prefix cache).
    want_layers = len(PROMPTS) * LAYERS
    want_bytes = sum((n - 1) // BLOCK for n in LENGTHS) * LAYERS * BLOCK_BYTES
    deadline = time.monotonic() + 30
    while True:
        layers, nbytes = (b - a for a, b in zip(pulled0, _pulled(cluster["decode"]), strict=True))
        if layers >= want_layers or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert layers == want_layers and nbytes >= want_bytes, (layers, nbytes, want_bytes)
    # Plain answers from the decode server itself (no transfer involved), asked afterwards.
    baseline = [complete(cluster["decode"], _body(model, p, False)) for p in PROMPTS]
    assert pd == baseline
    streamed = [stream(cluster["proxy"], _body(model, p, True)) for p in PROMPTS[:3]]
    assert streamed == baseline[:3]
    assert [line for b in BAD for line in log_lines(cluster, since, b)] == []


def test_unanswered_layer_holds_its_buffer_until_the_ack_deadline(cluster: dict[str, Any]) -> None:
    model = cluster["model"]
    since = log_sizes(cluster)
    t0 = time.monotonic()
    pd = complete(cluster["proxy"], _body(model, FAULT_PROMPT, False))
    elapsed = time.monotonic() - t0
    # Baseline afterwards: asked first, decode would hold the prompt's blocks in its
    # prefix cache and pull only the last one (the fault matches 7-block pulls).
    assert pd == complete(cluster["decode"], _body(model, FAULT_PROMPT, False))

    def lines(name: str, needle: str) -> list[str]:
        return [ln for ln in cluster["servers"][name].text()[since[name]:].splitlines() if needle in ln]

    failed = lines("decode", "blocks failed to load")  # decode gave up on the request: recomputed
    assert failed and all("layer 2" in ln and "timeout" in ln for ln in failed), failed
    # The configured deadlines ended it, on both sides: decode's request_timeout_s and the
    # prefill's ack_timeout_s for the dropped layer 2 (its buffer held until then).
    assert lines("decode", "reads missing after 20.0s"), lines("decode", "missing after")
    assert lines("prefill", "(layer 2): 1 decode reads unanswered after 20.0s"), lines("prefill", "unanswered")
    assert lines("prefill", "Traceback") == [] and lines("prefill", "GateTimeout") == []
    assert elapsed >= 15, elapsed  # decode's request deadline: the pull really failed
    # The prefill still serves, and the layers of the next request are not held back.
    assert complete(cluster["proxy"], _body(model, PROMPTS[3], False)) == \
        complete(cluster["decode"], _body(model, PROMPTS[3], False))
