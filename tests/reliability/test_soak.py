"""Soak with faults: real prefill (layerwise store + RD2H producer through the
MultiConnector), decode and proxy under 200+ requests at concurrency 8 -- mixed
lengths, some streamed, some streamed and fanned out (``n`` 2 or 3), some clients
hanging up mid-stream -- while faults hit:

* phase "faults": repeated prompts make the prefill read the store, one prompt
  makes the prefill stall past decode's request deadline
  (``debug: {pd_faults: "drop:2@7"}``: layer 2 never announced, the prefill holds
  the buffer until its ack deadline, decode recomputes), and the proxy's metaserver
  gets a garbled registration and a hijack attempt (a live request id, wrong token);
  and the prefill's first layerwise store read fails (``debug.fail_layer_loads``);
* phase "kill": decode is SIGKILLed mid-load and restarted;
* phase "recovered": the same mix again, after the decode is back, while a flood of
  registrations (unknown ids, garbled, above the proxy's registration cap) hits the
  metaserver.

Pass: every request ends within its deadline (an answer, or an OpenAI-style
error -- errors only in the kill phase), every answer (each choice of a fan-out)
equals the plain engine's greedy tokens, 0 errors after recovery, every flooded
registration is refused with its OpenAI-style error, the store really served
repeated prefixes and failed exactly the one injected load, and the idle counters
(proxy registry and admissions of requests and registrations, both engines'
running/waiting requests and KV blocks in use, the prefill's published readiness
items all answered or expired) are back at idle.

Waits on state (the decode back, the counters at idle, a fault's log evidence) poll
for the evidence under a generous bound; the only timings asserted are the
per-request client deadline and the RD2H deadlines the faults exercise.
"""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("mooncake.engine")

from ascend_offload.harness.tiny_model import random_prompts
from tests.reliability.conftest import RD2H, REGISTRATION_MAX_BYTES, Cluster
from tests.reliability.loadgen import Job, Outcome, is_openai_error, run_jobs

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(900)]

CONCURRENCY = 8
PLAIN_CONCURRENCY = 4  # the plain answers at the end (the reference)
DEADLINE_S = 90.0  # per request, client side; far above any fault's own deadline
# Mixed lengths; none of 7 blocks of 32 (193-224 tokens): that size is the stall fault's.
LENGTHS = [40, 1300, 333, 97, 760, 512, 64, 900, 150, 260, 1000, 33, 420, 600, 128, 1200]
PROMPTS = random_prompts(len(LENGTHS), LENGTHS, seed=41)
STALL_PROMPT = random_prompts(1, [210], seed=3)[0]  # 7 blocks: the drop:2@7 fault
PROMPTS.append(STALL_PROMPT)
STALL_ID = len(PROMPTS) - 1
MAX_TOKENS = (8, 16, 24)
PHASES = {"faults": 60, "kill": 40, "recovered": 110}
# Registrations the flood posts against the metaserver during phase "recovered".
FLOOD_POSTS, FLOOD_CLIENTS = 240, 4
# Bounds of waits on state (not timings under test): generous for a loaded 2-core box.
STATE_WAIT_S = 180.0


def make_jobs(phase: str, n: int, start: int, seed: int) -> list[Job]:
    """Every third request streamed, one streamed in five hung up after its first event,
    one request in twelve a streamed fan-out of 2 or 3 samples (some of those hung up too)."""
    rng = random.Random(seed)
    jobs = []
    for k in range(n):
        stream = k % 3 == 1
        fan = 2 + (k // 12) % 2 if stream and k % 4 == 3 else 1
        jobs.append(Job(start + k, phase, rng.randrange(len(LENGTHS)), rng.choice(MAX_TOKENS),
                        stream=stream, disconnect=stream and k % 5 == 4, n=fan))
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
PROXY_IDLE = ("pending", "inflight_requests", "inflight_body_bytes", "inflight_registrations",
              "inflight_registration_bytes")


def counters(c: Cluster) -> dict[str, Any]:
    """Idle counters of proxy and engines. Engine gauges are reported with a step's stats,
    so each engine first runs a tiny plain request: its steps report the current values."""
    for url in (c.prefill, c.decode):
        r = httpx.post(f"{url}/v1/completions", timeout=60,
                       json={"model": c.model, "prompt": PROBE, "max_tokens": 2, "temperature": 0.0})
        assert r.status_code == 200, r.text
    health = httpx.get(f"{c.proxy}/health", timeout=10).json()
    out: dict[str, Any] = {"proxy": {k: health[k] for k in PROXY_IDLE}}
    for role, url, rd2h in (("prefill", c.prefill, RD2H_PREFILL), ("decode", c.decode, RD2H_DECODE)):
        m = metrics(url)
        vals: dict[str, float] = {k: m.get(k, -1.0) for k in (*ENGINE_IDLE, *IDLE_GAUGES[role])}
        vals.update({f"rd2h_{k}": m.get(f"vllm:ascend_offload_rd2h_{k}_total", 0.0) for k in rd2h})
        if role == "prefill":
            vals["store_layerwise_blocks_loaded"] = m.get("vllm:ascend_offload_store_layerwise_blocks_loaded_total",
                                                          0.0)
            vals["store_layerwise_load_errors"] = m.get("vllm:ascend_offload_store_layerwise_load_errors_total", 0.0)
            vals["store_layerwise_saves_dropped"] = m.get(
                "vllm:ascend_offload_store_layerwise_saves_dropped_total", 0.0)
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


def post_meta(proxy: str, content: bytes, client: httpx.Client | None = None) -> tuple[int, Any]:
    post = client.post if client is not None else httpx.post
    r = post(f"{proxy}/v1/metaserver", content=content, headers={"Content-Type": "application/json"},
             timeout=30)
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, r.text


def flood_bodies() -> list[tuple[int, bytes]]:
    """(expected status, body) of the registration flood: well-formed registrations for
    ids that do not exist (404), garbled JSON (400), and bodies above the proxy's cap
    for the soak's model length (413)."""
    kv = {"remote_host": "203.0.113.9", "remote_port": 1, "remote_request_id": "r", "remote_block_ids": [1, 2]}
    bodies = []
    for i in range(FLOOD_POSTS):
        kind = i % 3
        if kind == 0:
            msg = {"proxy_request_id": f"flood-{i}", "registration_token": "A" * 32, "kv_transfer_params": kv}
            bodies.append((404, json.dumps(msg).encode()))
        elif kind == 1:
            bodies.append((400, b'{"proxy_request_id": "flood-%d", "registration_tok' % i))
        else:
            big = {**kv, "remote_block_ids": list(range(REGISTRATION_MAX_BYTES // 4))}
            msg = {"proxy_request_id": f"flood-{i}", "registration_token": "A" * 32, "kv_transfer_params": big}
            bodies.append((413, json.dumps(msg).encode()))
    return bodies


def run_flood(proxy: str) -> list[tuple[int, int, Any]]:
    """Post the flood with ``FLOOD_CLIENTS`` concurrent clients: (expected, status, body) each."""
    def one(item: tuple[int, bytes]) -> tuple[int, int, Any]:
        try:
            return (item[0], *post_meta(proxy, item[1]))
        except httpx.HTTPError as exc:
            return item[0], -1, repr(exc)

    with ThreadPoolExecutor(FLOOD_CLIENTS) as pool:
        return list(pool.map(one, flood_bodies()))


def wait_for_log(path: Path, text: str, what: str) -> str:
    """The log's text once it contains ``text`` (the evidence a fault happened)."""
    deadline = time.monotonic() + STATE_WAIT_S
    while text not in (log := path.read_text(errors="replace")):
        assert time.monotonic() < deadline, f"{what}: {text!r} not in {path.name} after {STATE_WAIT_S:g} s"
        time.sleep(1)
    return log


def test_soak_with_faults(soak_cluster: Cluster) -> None:
    c = soak_cluster
    t_start = time.monotonic()
    outcomes: list[Outcome] = []
    meta: dict[str, Any] = {}

    # -- phase "faults": store reads (repeated prompts), prefill stall,
    #    garbled + hijack registrations while a stream is live.
    def hijack(job: Job, response_id: str) -> None:
        if "hijack" in meta or job.disconnect or job.n > 1:  # a fan-out's id is the proxy's own
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
    deadline = time.monotonic() + STATE_WAIT_S
    while True:
        got = run_jobs(c.proxy, c.model, PROMPTS, [probe], concurrency=1, deadline_s=DEADLINE_S)[0]
        if got.kind == "answer":
            break
        assert got.kind == "error", got
        assert time.monotonic() < deadline, f"no answer through the proxy {STATE_WAIT_S:g} s after the restart: {got}"
        time.sleep(1)

    # -- phase "recovered": the same mix, no error allowed, while registrations flood the metaserver.
    flood: list[tuple[int, int, Any]] = []
    flooder = threading.Thread(target=lambda: flood.extend(run_flood(c.proxy)), name="flood")
    flooder.start()
    recovered = make_jobs("recovered", PHASES["recovered"], len(outcomes), seed=3)
    outcomes += run_jobs(c.proxy, c.model, PROMPTS, recovered, concurrency=CONCURRENCY, deadline_s=DEADLINE_S)
    flooder.join(STATE_WAIT_S)
    assert not flooder.is_alive(), "the registration flood did not end"
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

    fanouts = [o for o in outcomes if o.job.n > 1]
    assert any(o.kind == "answer" for o in fanouts if o.job.phase == "recovered"), fanouts

    # -- the metaserver refused both forged registrations and every flooded one; the engines survived
    assert meta["garbled"][0] == 400 and is_openai_error(meta["garbled"][1]), meta["garbled"]
    assert "hijack" in meta, "no live stream to hijack"
    assert meta["hijack"][1] == 403 and is_openai_error(meta["hijack"][2]), meta["hijack"]
    assert len(flood) == FLOOD_POSTS
    wrong_flood = [f for f in flood if f[1] != f[0] or not is_openai_error(f[2])]
    assert wrong_flood == [], wrong_flood[:5]
    prom = metrics(c.proxy)
    assert prom.get("ascend_offload_proxy_metaserver_registrations_total", 0) > 0
    assert c.servers["prefill"].proc.poll() is None and c.servers["proxy"].proc.poll() is None

    # -- the faults really happened (and ended by their deadlines); the logs are read once
    #    they hold the evidence, not at a fixed time
    prefill_path = c.log_dir / "prefill.log"
    timeout = float(RD2H["ack_timeout_s"])
    wait_for_log(prefill_path, f"(layer 2): 1 decode reads unanswered after {timeout}s", "the stall fault")
    prefill_log = wait_for_log(prefill_path, "Recovered from KV load failure", "the store-read fault")
    wait_for_log(c.log_dir / "decode.log", "reads missing after", "decode giving the stalled pull up")
    assert "EngineCore encountered a fatal error" not in prefill_log

    # -- idle counters
    deadline = time.monotonic() + STATE_WAIT_S
    while not is_idle(snap := counters(c)):
        assert time.monotonic() < deadline, f"counters not back to idle: {snap}"
        time.sleep(1)

    # -- the store served the repeated prefixes, and failed exactly the one injected load:
    #    one layer load (its blocks are load errors), reported and recomputed. The step it
    #    failed in saves nothing from that layer on, so a request of that step whose prompt
    #    continues in its next chunk misses its own blocks there and is recomputed too
    #    (docs/reliability.md): a recovery beyond the first needs dropped saves.
    prefill_log = c.log("prefill")
    store = snap["prefill"]
    assert store["store_layerwise_blocks_loaded"] > 0, store
    assert store["store_layerwise_load_errors"] >= 1, store
    assert prefill_log.count("failed: injected (debug.fail_layer_loads)") == 1
    recoveries = prefill_log.count("Recovered from KV load failure")
    assert recoveries >= 1
    assert recoveries == 1 or store["store_layerwise_saves_dropped"] > 0, (recoveries, store)

    # -- answers identical to the plain engine (decode, no transfer), per prompt and length:
    #    one greedy answer per prompt, of the longest length asked of it; a shorter answer
    #    must equal its first tokens (greedy, ignore_eos: the first k tokens of a longer
    #    answer are the k-token answer)
    longest: dict[int, int] = {}
    for o in outcomes:
        if o.kind == "answer":
            longest[o.job.prompt_id] = max(longest.get(o.job.prompt_id, 0), o.job.max_tokens)
    plain_jobs = [Job(i, "plain", pid, mt) for i, (pid, mt) in enumerate(sorted(longest.items()))]
    plain = run_jobs(c.decode, c.model, PROMPTS, plain_jobs, concurrency=PLAIN_CONCURRENCY,
                     deadline_s=DEADLINE_S)
    assert all(o.kind == "answer" for o in plain), [o for o in plain if o.kind != "answer"][:3]
    assert all(len(o.token_ids or ()) == o.job.max_tokens for o in plain), plain[:3]
    expected = {o.job.prompt_id: o.token_ids for o in plain}
    wrong = [o for o in outcomes if o.kind == "answer"
             and any(ids != expected[o.job.prompt_id][:o.job.max_tokens] for ids in o.choices)]
    assert wrong == [], [(o.job, o.choices) for o in wrong[:3]]

    latencies = sorted(o.elapsed_s for o in outcomes)
    print(f"\nsoak: {len(outcomes)} requests in {soak_s:.0f} s at concurrency {CONCURRENCY}; by phase {by_phase}")
    print(f"soak: kill-phase error statuses {sorted(o.status for o in errors['kill'])}; decode restart "
          f"{restart_s:.0f} s; latency p50 {latencies[len(latencies) // 2]:.2f} s, max {latencies[-1]:.2f} s")
    print(f"soak: metaserver garbled -> {meta['garbled'][0]}, hijack of {meta['hijack'][0]!r} -> "
          f"{meta['hijack'][1]}; flood of {len(flood)} -> "
          f"{sorted({s: sum(1 for f in flood if f[1] == s) for s in {f[1] for f in flood}}.items())}")
    fan_kinds = {k: sum(1 for o in fanouts if o.kind == k) for k in {o.kind for o in fanouts}}
    print(f"soak: fan-outs (n 2-3, streamed) {fan_kinds}; store blocks loaded "
          f"{store['store_layerwise_blocks_loaded']:.0f}, load errors {store['store_layerwise_load_errors']:.0f}, "
          f"saves dropped {store['store_layerwise_saves_dropped']:.0f}, recoveries {recoveries}")
    print(f"soak: idle counters {json.dumps(snap, sort_keys=True)}")
