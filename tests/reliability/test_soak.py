"""Soak with faults: real prefill (layerwise store + RD2H producer through the
MultiConnector), decode and proxy under 200+ requests at concurrency 8 -- mixed
lengths, some streamed, some clients hanging up mid-stream -- while faults hit:

* phase "faults": repeated prompts make the prefill read the store, one prompt
  makes the prefill stall past decode's request deadline
  (``ASCEND_OFFLOAD_PD_FAULTS=drop:2@7``: layer 2 never announced, the prefill holds
  the buffer until its ack deadline, decode recomputes), and the proxy's metaserver
  gets a garbled registration and a hijack attempt (a live request id, wrong token);
  and the prefill's first layerwise store read fails (``debug_fail_layer_loads``);
* phase "kill": decode is SIGKILLed mid-load and restarted;
* phase "recovered": the same mix again, after the decode is back.

Pass: every request ends within its deadline (an answer, or an OpenAI-style
error -- errors only in the kill phase), every answer equals the plain engine's
greedy tokens, 0 errors after recovery, and the idle counters (proxy registry and
admissions, both engines' running/waiting requests and KV blocks in use, the
prefill's published readiness items all answered or expired) are back at idle.
"""

from __future__ import annotations

import json
import random
import threading
import time
from typing import Any

import httpx
import pytest

pytest.importorskip("mooncake.engine")

from ascend_offload.testing.tiny_model import random_prompts
from tests.reliability.conftest import RD2H, Cluster
from tests.reliability.loadgen import Job, Outcome, is_openai_error, run_jobs

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(900)]

CONCURRENCY = 8
DEADLINE_S = 90.0  # per request, client side; far above any fault's own deadline
# Mixed lengths; none of 7 blocks of 32 (193-224 tokens): that size is the stall fault's.
LENGTHS = [40, 1300, 333, 97, 760, 512, 64, 900, 150, 260, 1000, 33, 420, 600, 128, 1200]
PROMPTS = random_prompts(len(LENGTHS), LENGTHS, seed=41)
STALL_PROMPT = random_prompts(1, [210], seed=3)[0]  # 7 blocks: the drop:2@7 fault
PROMPTS.append(STALL_PROMPT)
STALL_ID = len(PROMPTS) - 1
MAX_TOKENS = (8, 16, 24)
PHASES = {"faults": 60, "kill": 40, "recovered": 110}


def make_jobs(phase: str, n: int, start: int, seed: int) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for k in range(n):
        stream = k % 3 == 1
        jobs.append(Job(start + k, phase, rng.randrange(len(LENGTHS)), rng.choice(MAX_TOKENS),
                        stream=stream, disconnect=stream and k % 5 == 4))
    return jobs


def metrics(url: str) -> dict[str, float]:
    """Prometheus text -> {name: value summed over label sets} (no histograms)."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


ENGINE_IDLE = {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0,
               "vllm:kv_cache_usage_perc": 0.0}
RD2H_PREFILL = ("layers_published", "acks", "failed_answers", "ack_timeouts", "acks_late", "send_errors",
                "gate_holds", "gate_hold_failures", "rejected_messages")
RD2H_DECODE = ("layers_pulled", "read_failures", "read_retries", "rejected_messages")
# The engines' own idle gauges (connectors/metrics.py): all 0 when nothing is in flight.
IDLE_GAUGES = {
    "prefill": ("vllm:ascend_offload_rd2h_pending_slot_uses", "vllm:ascend_offload_store_pinned_objects",
                "vllm:ascend_offload_store_pending_objects",
                "vllm:ascend_offload_store_layerwise_gate_consumers_held"),
    "decode": ("vllm:ascend_offload_rd2h_inflight_reads", "vllm:ascend_offload_rd2h_parked_messages",
               "vllm:ascend_offload_rd2h_active_requests"),
}
PROBE = [5, 6, 7, 8, 9, 10, 11, 12]  # under one block: nothing saved, loaded or sent


def counters(c: Cluster) -> dict[str, Any]:
    """Idle counters of proxy and engines. Engine gauges are reported with a step's stats,
    so each engine first runs a tiny plain request: its steps report the current values."""
    for url in (c.prefill, c.decode):
        r = httpx.post(f"{url}/v1/completions", timeout=60,
                       json={"model": c.model, "prompt": PROBE, "max_tokens": 2, "temperature": 0.0})
        assert r.status_code == 200, r.text
    health = httpx.get(f"{c.proxy}/health", timeout=10).json()
    out: dict[str, Any] = {"proxy": {k: health[k] for k in ("pending", "inflight_requests", "inflight_body_bytes")}}
    for role, url, rd2h in (("prefill", c.prefill, RD2H_PREFILL), ("decode", c.decode, RD2H_DECODE)):
        m = metrics(url)
        vals: dict[str, float] = {k: m.get(k, -1.0) for k in (*ENGINE_IDLE, *IDLE_GAUGES[role])}
        vals.update({f"rd2h_{k}": m.get(f"vllm:ascend_offload_rd2h_{k}_total", 0.0) for k in rd2h})
        if role == "prefill":
            vals["store_layerwise_blocks_loaded"] = m.get("vllm:ascend_offload_store_layerwise_blocks_loaded_total",
                                                          0.0)
            vals["store_layerwise_load_errors"] = m.get("vllm:ascend_offload_store_layerwise_load_errors_total", 0.0)
            vals["store_layerwise_gate_timeouts"] = m.get(
                "vllm:ascend_offload_store_layerwise_gate_timeouts_total", 0.0)
        out[role] = vals
    return out


def is_idle(snap: dict[str, Any]) -> bool:
    p = snap["prefill"]
    published = p["rd2h_layers_published"]
    resolved = p["rd2h_acks"] + p["rd2h_failed_answers"] + p["rd2h_ack_timeouts"] + p["rd2h_send_errors"]
    return (all(v == 0 for v in snap["proxy"].values())
            and all(snap[r][k] == v for r in ("prefill", "decode") for k, v in ENGINE_IDLE.items())
            and all(snap[r][k] == 0 for r in ("prefill", "decode") for k in IDLE_GAUGES[r])
            and resolved >= published)


def post_meta(proxy: str, content: bytes) -> tuple[int, Any]:
    r = httpx.post(f"{proxy}/v1/metaserver", content=content, headers={"Content-Type": "application/json"},
                   timeout=30)
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, r.text


def test_soak_with_faults(soak_cluster: Cluster) -> None:
    c = soak_cluster
    t_start = time.monotonic()
    outcomes: list[Outcome] = []
    meta: dict[str, Any] = {}

    # -- phase "faults": store reads (repeated prompts), prefill stall,
    #    garbled + hijack registrations while a stream is live.
    def hijack(job: Job, response_id: str) -> None:
        if "hijack" in meta or job.disconnect:
            return
        rid = response_id.removeprefix("cmpl-")
        forged = {"proxy_request_id": rid, "registration_token": "A" * 43,
                  "kv_transfer_params": {"do_remote_decode": False, "remote_host": "203.0.113.9",
                                         "remote_port": "not-a-port"}}
        meta["hijack"] = (rid, *post_meta(c.proxy, json.dumps(forged).encode()))

    meta["garbled"] = post_meta(c.proxy, b'{"proxy_request_id": "x", "registration_tok')
    faults = make_jobs("faults", PHASES["faults"], 0, seed=1)
    faults.insert(len(faults) // 3, Job(len(faults), "faults", STALL_ID, 8))
    outcomes += run_jobs(c.proxy, c.model, PROMPTS, faults, concurrency=CONCURRENCY, deadline_s=DEADLINE_S,
                         on_first_event=hijack)

    # -- phase "kill": SIGKILL decode after a quarter of the jobs ended, restart after.
    done = 0
    lock = threading.Lock()
    killed = threading.Event()

    def on_done(_: Outcome) -> None:
        nonlocal done
        with lock:
            done += 1
            kill = done == PHASES["kill"] // 4 and not killed.is_set()
            if kill:
                killed.set()
        if kill:
            c.kill_decode()

    kill_jobs = make_jobs("kill", PHASES["kill"], len(outcomes), seed=2)
    outcomes += run_jobs(c.proxy, c.model, PROMPTS, kill_jobs, concurrency=CONCURRENCY, deadline_s=DEADLINE_S,
                         on_done=on_done)
    assert killed.is_set()
    restart_s = c.restart_decode()
    # The proxy takes the decode back after its cooldown: probe until the first answer.
    probe = Job(-1, "probe", 0, 8)
    deadline = time.monotonic() + 120
    while True:
        got = run_jobs(c.proxy, c.model, PROMPTS, [probe], concurrency=1, deadline_s=DEADLINE_S)[0]
        if got.kind == "answer":
            break
        assert got.kind == "error", got
        assert time.monotonic() < deadline, f"no answer through the proxy 120 s after the restart: {got}"
        time.sleep(1)

    # -- phase "recovered": the same mix, no error allowed.
    recovered = make_jobs("recovered", PHASES["recovered"], len(outcomes), seed=3)
    outcomes += run_jobs(c.proxy, c.model, PROMPTS, recovered, concurrency=CONCURRENCY, deadline_s=DEADLINE_S)
    soak_s = time.monotonic() - t_start

    # -- every request ended within its deadline, as it may in its phase
    assert len(outcomes) >= 200
    broken = [o for o in outcomes if o.kind == "broken" or o.elapsed_s > DEADLINE_S]
    assert broken == [], broken[:5]
    by_phase: dict[str, dict[str, int]] = {}
    for o in outcomes:
        by_phase.setdefault(o.job.phase, {}).setdefault(o.kind, 0)
        by_phase[o.job.phase][o.kind] += 1
    errors = {p: [o for o in outcomes if o.job.phase == p and o.kind == "error"] for p in PHASES}
    assert errors["faults"] == [], errors["faults"][:5]
    assert errors["recovered"] == [], errors["recovered"][:5]
    assert errors["kill"], "killing the decode mid-load must fail some requests"
    assert {o.status for o in errors["kill"]} <= {200, 502, 503, 504}, [o.status for o in errors["kill"]]

    # -- the metaserver refused both forged registrations; the engines survived
    assert meta["garbled"][0] == 400 and is_openai_error(meta["garbled"][1]), meta["garbled"]
    assert "hijack" in meta, "no live stream to hijack"
    assert meta["hijack"][1] == 403 and is_openai_error(meta["hijack"][2]), meta["hijack"]
    prom = metrics(c.proxy)
    assert prom.get("ascend_offload_proxy_metaserver_registrations_total", 0) > 0
    assert c.servers["prefill"].proc.poll() is None and c.servers["proxy"].proc.poll() is None

    # -- the faults really happened (and ended by their deadlines)
    prefill_log = c.log("prefill")
    timeout = float(RD2H["ack_timeout_s"])
    assert f"(layer 2): 1 decode reads unanswered after {timeout}s" in prefill_log
    assert "EngineCore encountered a fatal error" not in prefill_log
    assert "reads missing after" in (c.log_dir / "decode.log").read_text()  # decode gave the pull up

    # -- idle counters
    deadline = time.monotonic() + 60
    while not is_idle(snap := counters(c)):
        assert time.monotonic() < deadline, f"counters not back to idle: {snap}"
        time.sleep(1)

    # -- answers identical to the plain engine (decode, no transfer), per prompt and length
    wanted = sorted({(o.job.prompt_id, o.job.max_tokens) for o in outcomes if o.kind == "answer"})
    plain_jobs = [Job(i, "plain", pid, mt) for i, (pid, mt) in enumerate(wanted)]
    plain = run_jobs(c.decode, c.model, PROMPTS, plain_jobs, concurrency=2, deadline_s=DEADLINE_S)
    assert all(o.kind == "answer" for o in plain), [o for o in plain if o.kind != "answer"][:3]
    expected = {(o.job.prompt_id, o.job.max_tokens): o.token_ids for o in plain}
    wrong = [o for o in outcomes if o.kind == "answer" and o.token_ids != expected[(o.job.prompt_id,
                                                                                    o.job.max_tokens)]]
    assert wrong == [], [(o.job, o.token_ids) for o in wrong[:3]]

    latencies = sorted(o.elapsed_s for o in outcomes)
    print(f"\nsoak: {len(outcomes)} requests in {soak_s:.0f} s at concurrency {CONCURRENCY}; by phase {by_phase}")
    print(f"soak: kill-phase error statuses {sorted(o.status for o in errors['kill'])}; decode restart "
          f"{restart_s:.0f} s; latency p50 {latencies[len(latencies) // 2]:.2f} s, max {latencies[-1]:.2f} s")
    print(f"soak: metaserver garbled -> {meta['garbled'][0]}, hijack of {meta['hijack'][0]!r} -> "
          f"{meta['hijack'][1]}")
    print(f"soak: idle counters {json.dumps(snap, sort_keys=True)}")
