"""``ascend-offload bench store-ssd``: prefix hits of a multi-turn workload whose prefix
set is several times the host store, with the SSD tier (``local.ssd``) and without.

Three real vLLM CPU engines of the tiny Llama (float32, greedy), one after the other,
run the *same* request sequence: a plain engine (no plugin: the reference tokens),
``AscendStoreConnector`` with host pages only, and the same with the SSD tier under
them. The workload is ``--convs`` conversations of ``--turns`` turns, sent one request
at a time, round robin over the conversations: turn ``t`` of a conversation is its
first prompt plus, for every earlier turn, a fixed "assistant" reply and a new user
message (fixed token ids, so every engine sees identical prompts). Between two turns
of one conversation the other conversations push its blocks out of the host pages
(the prefix set is ``>= 4x`` their capacity), so without the tier the next turn
recomputes; with it, the prefix comes back from the slot files. A share ``--quick`` of
turns gets a follow-up turn at once, before the other conversations speak: those are
the hits the host pages alone can serve, so the ratio of the two runs is finite.

Hit rate: blocks loaded from the store (``kv_transfer_params['ascend_store']
['loaded_blocks']``) over the blocks that could have been (every full block of the
prompt but the last token's), summed over every request after each conversation's
first turn. The bench also reports the SSD counters and whether every request's
tokens equal the plain engine's.

``bench store`` adds the tier's load row (:func:`bench_tier_load`): slot -> host
pages with header and checksum verification against a raw read of the same slots
from the same file, same I/O mode, in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ascend_offload.harness.engines import tiny_llm

BLOCK_SIZE = 32


def multi_turn_prompts(convs: int, turns: int, *, first_tokens: int = 160, reply_tokens: int = 16,
                       user_tokens: int = 48, quick: float = 0.0, seed: int = 0) -> list[tuple[int, list[int]]]:
    """``(conversation, prompt)`` in send order: turn by turn, round robin (module doc).

    ``quick``: the share of turns (after the first) a user answers at once, before the
    other conversations speak: that follow-up comes right after the turn, so the host
    pages still hold its prefix. Without quick follow-ups the host pages alone hit nothing
    and the ratio of the two runs is unbounded."""
    from ascend_offload.harness.tiny_model import VOCAB

    rng = random.Random(seed)
    follow = random.Random(seed + 1)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    history = [ids(first_tokens) for _ in range(convs)]
    out: list[tuple[int, list[int]]] = []
    for t in range(turns):
        for c in range(convs):
            if t:
                history[c] = history[c] + ids(reply_tokens) + ids(user_tokens)
            out.append((c, list(history[c])))
            if t and follow.random() < quick:
                history[c] = history[c] + ids(reply_tokens) + ids(user_tokens)
                out.append((c, list(history[c])))
    return out


def hit_blocks_possible(prompt: list[int], block_size: int = BLOCK_SIZE) -> int:
    """Full blocks of a prompt the store may serve (vLLM computes the last token itself)."""
    return (len(prompt) - 1) // block_size


def run_sequence(llm: Any, prompts: list[tuple[int, list[int]]], max_tokens: int) -> list[Any]:
    """Send each prompt alone, in order; the request outputs."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0] for _, p in prompts]


def summarize(prompts: list[tuple[int, list[int]]], outs: list[Any]) -> dict[str, Any]:
    """Hit rate over every turn after a conversation's first, and the last store gauges."""
    seen: set[int] = set()
    loaded = possible = 0
    last: dict[str, Any] = {}
    for (c, p), o in zip(prompts, outs, strict=True):
        st = (o.kv_transfer_params or {}).get("ascend_store", {})
        last = st.get("store", last)
        if c in seen:
            loaded += int(st.get("loaded_blocks", 0))
            possible += hit_blocks_possible(p)
        seen.add(c)
    return {"loaded_blocks": loaded, "possible_blocks": possible,
            "hit_rate": loaded / possible if possible else 0.0, "store": last}


def prefix_set_blocks(prompts: list[tuple[int, list[int]]], block_size: int = BLOCK_SIZE) -> int:
    """Distinct full prompt blocks of the workload (prefix chains, counted once)."""
    chains: set[tuple[int, ...]] = set()
    for _, p in prompts:
        for i in range(1, hit_blocks_possible(p, block_size) + 1):
            chains.add(tuple(p[:i * block_size]))
    return len(chains)


def store_config(host_pages: int, object_bytes: int, ssd: dict[str, Any] | None) -> dict[str, Any]:
    local: dict[str, Any] = {"capacity_bytes": host_pages * object_bytes}
    if ssd is not None:
        local["ssd"] = ssd
    return {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"local": local}}


def run_workload(model: str, object_bytes: int, *, convs: int, turns: int, host_pages: int,
                 ssd_dir: str, ssd_bytes: int, quick: float = 0.0, max_tokens: int = 16,
                 seed: int = 0) -> dict[str, Any]:
    """The three engines over one workload (module doc); the comparison."""
    prompts = multi_turn_prompts(convs, turns, quick=quick, seed=seed)
    result: dict[str, Any] = {"convs": convs, "turns": turns, "quick": quick, "requests": len(prompts),
                              "host_pages": host_pages, "prefix_set_blocks": prefix_set_blocks(prompts)}
    result["prefix_set_over_host"] = result["prefix_set_blocks"] / host_pages
    with tiny_llm(model, None, plugin=False, block_size=BLOCK_SIZE) as llm:
        plain = [list(o.outputs[0].token_ids) for o in run_sequence(llm, prompts, max_tokens)]
    runs: dict[str, Any] = {}
    for name, ssd in (("host_only", None), ("ssd", {"path": ssd_dir, "capacity_bytes": ssd_bytes})):
        t0 = time.perf_counter()
        with tiny_llm(model, store_config(host_pages, object_bytes, ssd), block_size=BLOCK_SIZE) as llm:
            outs = run_sequence(llm, prompts, max_tokens)
        runs[name] = summarize(prompts, outs)
        runs[name]["seconds"] = time.perf_counter() - t0
        runs[name]["tokens_equal_plain"] = [list(o.outputs[0].token_ids) for o in outs] == plain
    result["runs"] = runs
    base = runs["host_only"]["hit_rate"]
    # None when the host pages alone hit nothing (the ratio is unbounded then)
    result["hit_rate_ratio"] = runs["ssd"]["hit_rate"] / base if base else None
    return result


# ----------------------------------------------------------------------------- tier load row


def bench_tier_load(directory: str, *, layer_bytes: int, layers: int, slots: int, repeats: int,
                    direct_io: str) -> dict[str, Any]:
    """Promote (slot -> host pages, verified) vs a raw read of the same slots from the same
    file descriptor; paired rounds (the order alternates), medians. ``direct_io`` as in
    ``local.ssd``."""
    import torch

    from ascend_offload.store.ssd import format as fmt
    from ascend_offload.store.ssd.file import CHUNK_BYTES, RankTier, SlotFile, _Staging

    page = layer_bytes * layers
    sb = fmt.slot_bytes(page)
    planes = {f"l{i}": torch.randint(0, 256, (slots, layer_bytes), dtype=torch.uint8) for i in range(layers)}
    path = Path(directory) / f"bench-{os.getpid()}.slots"
    tier = RankTier(planes, SlotFile(path, slots, sb, direct_io=direct_io), rank=0)  # type: ignore[arg-type]
    try:
        keys = [f"b{i}" for i in range(slots)]
        order = list(range(slots))
        tier.submit_spill(1, keys, order, order)
        if not tier.wait_idle(600) or tier.take_spill_report()[1]:
            raise RuntimeError("bench: spilling the slots failed")
        want = {n: p.clone() for n, p in planes.items()}
        pages = order[::-1]  # scattered back into other pages: the connector's case
        raw_buf = _Staging(sb, max(1, CHUNK_BYTES // sb))

        def tier_load() -> None:
            good, bad = tier.promote(keys, order, pages)
            if good != slots or bad:
                raise RuntimeError(f"bench: {slots - good} slots failed verification")

        def raw_read() -> None:
            for start in range(0, slots, raw_buf.slots):  # the same chunks the tier reads
                n = min(raw_buf.slots, slots - start)
                tier.file.read(order[start:start + n], raw_buf.view[:n * sb])

        tier_load()
        raw_read()
        ts, tr, ratios = [], [], []
        for r in range(repeats):  # the order alternates: neither side always runs right after the other
            first, second = (tier_load, raw_read) if r % 2 == 0 else (raw_read, tier_load)
            t0 = time.perf_counter()
            first()
            t1 = time.perf_counter()
            second()
            t2 = time.perf_counter()
            load_s, raw_s = (t1 - t0, t2 - t1) if r % 2 == 0 else (t2 - t1, t1 - t0)
            ts.append(load_s)
            tr.append(raw_s)
            ratios.append(raw_s / load_s)
        for n, p in planes.items():
            if not torch.equal(p[pages], want[n][order]):
                raise RuntimeError("bench: promoted pages differ from the spilled ones")
        total = slots * sb
        direct = tier.file.direct
        raw_buf.close()
        return {"path": "ssd", "io": "O_DIRECT" if direct else "buffered (page cache)",
                "object_bytes": page, "slot_bytes": sb, "objects": slots, "total_bytes": total,
                "load_GBps": total / statistics.median(ts) / 1e9,
                "raw_read_GBps": total / statistics.median(tr) / 1e9,
                "load_ratio": statistics.median(ratios), "checksum": fmt.checksum_implementation()}
    finally:
        tier.close()
        path.unlink(missing_ok=True)


def ssd_rows(directory: str | None, total_mib: int, repeats: int) -> list[dict[str, Any]]:
    """``bench store``'s SSD rows: O_DIRECT and buffered, two object sizes."""
    rows = []
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        for layer_bytes, layers in ((16 << 10, 4), (32 << 10, 32)):
            n = max(4, (total_mib << 20) // (layer_bytes * layers))
            for mode in ("on", "off"):
                try:
                    rows.append(bench_tier_load(tmp, layer_bytes=layer_bytes, layers=layers, slots=n,
                                                repeats=repeats, direct_io=mode))
                except Exception as exc:  # e.g. O_DIRECT refused by this file system
                    rows.append({"path": "ssd", "io": mode, "skipped": str(exc)})
    return rows


def print_ssd_rows(rows: list[dict[str, Any]], target: float) -> float | None:
    """Print the rows; the worst O_DIRECT load ratio (the target's row), or None."""
    print("ssd tier load: slot -> host pages, every header and payload checksum verified, vs a raw "
          "read of the same slots (same file, same chunks, same I/O mode, paired rounds, medians)")
    print(f"{'io':24} {'object':>9} {'objs':>6} {'load GB/s':>10} {'raw GB/s':>10} {'load x':>7} {'checksum':>9}")
    for r in rows:
        if "skipped" in r:
            print(f"{r['io']:24} skipped: {r['skipped']}")
            continue
        print(f"{r['io']:24} {r['object_bytes']:>9} {r['objects']:>6} {r['load_GBps']:>10.2f} "
              f"{r['raw_read_GBps']:>10.2f} {r['load_ratio']:>7.2f} {r['checksum']:>9}")
    direct = [r["load_ratio"] for r in rows if r.get("io") == "O_DIRECT"]
    worst = min(direct) if direct else None
    if worst is not None:
        print(f"ssd: worst O_DIRECT load ratio vs raw read: {worst:.2f} (target >= {target})")
    return worst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ascend-offload bench store-ssd", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--convs", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--quick", type=float, default=0.25,
                    help="share of turns answered at once by a follow-up (the host pages' only hits)")
    ap.add_argument("--host-pages", type=int, default=16, help="host store capacity in blocks")
    ap.add_argument("--ssd-dir", default=None, help="directory of the tier's files (default: a temp dir)")
    ap.add_argument("--ssd-mib", type=int, default=64)
    args = ap.parse_args(argv)
    from ascend_offload.harness.tiny_model import make_tiny_llama

    models = Path(os.environ.get("ASCEND_OFFLOAD_TEST_MODELS", "/tmp/ascend-offload-test-models"))
    model = str(make_tiny_llama(models / "tiny-llama-4l", num_layers=4))
    object_bytes = 4 * 2 * BLOCK_SIZE * 64 * 4  # 4 layers x K,V x 32 tokens x 64 x fp32
    with tempfile.TemporaryDirectory(dir=args.ssd_dir) as tmp:
        res = run_workload(model, object_bytes, convs=args.convs, turns=args.turns, host_pages=args.host_pages,
                           ssd_dir=tmp, ssd_bytes=args.ssd_mib << 20, quick=args.quick)
    res["bench"] = "store-ssd"
    h, s = res["runs"]["host_only"], res["runs"]["ssd"]
    print(f"workload: {res['convs']} conversations x {res['turns']} turns + quick follow-ups "
          f"(share {res['quick']}) = {res['requests']} requests; "
          f"prefix set {res['prefix_set_blocks']} blocks = {res['prefix_set_over_host']:.1f}x the host store "
          f"({res['host_pages']} blocks)")
    for name, r in (("host only", h), ("with SSD", s)):
        print(f"{name:10} hit rate {r['hit_rate']:.3f} ({r['loaded_blocks']}/{r['possible_blocks']} blocks), "
              f"tokens equal plain: {r['tokens_equal_plain']}, {r['seconds']:.1f} s")
    st = s["store"]
    print(f"ssd counters: spilled {st.get('ssd_spilled_blocks')}, hits {st.get('ssd_hit_blocks')}, promoted "
          f"{st.get('ssd_promoted_blocks')}, checksum failures {st.get('ssd_checksum_failures')}, "
          f"used slots {st.get('ssd_used_slots')}")
    ratio = res["hit_rate_ratio"]
    print("hit rate ratio (SSD / host only): " + (f"{ratio:.2f}" if ratio is not None else
                                                   "unbounded (the host pages alone hit nothing)"))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2))
    ok = h["tokens_equal_plain"] and s["tokens_equal_plain"] and s["hit_rate"] > h["hit_rate"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
