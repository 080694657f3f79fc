"""``ascend-offload demo`` (``make demo``): the host KV store tier on a real vLLM CPU engine.

A few multi-turn conversations (each turn's prompt = the previous prompt, the
model's answer and new user tokens) run on an engine with
``AscendStoreConnector`` and vLLM's own prefix caching off, then on a plain
engine. It prints the store hit rate per turn and checks that every answer is
identical to the plain engine's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BLOCK = 32


def _engine(model: str, store: bool) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = None
    if store:
        kv = KVTransferConfig(
            kv_connector="AscendStoreConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"local": {"capacity_bytes": 256 << 20}},
        )
    return LLM(
        model=model,
        dtype="float32",
        block_size=BLOCK,
        enforce_eager=True,
        max_model_len=4096,
        enable_prefix_caching=False,
        kv_transfer_config=kv,
        seed=0,
    )


def _conversations(llm: Any, n_conv: int, turns: int, seed: int) -> tuple[list[list[list[int]]], list[dict[str, Any]]]:
    from vllm import SamplingParams

    rng = random.Random(seed)
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(150, 400))] for _ in range(n_conv)]
    answers: list[list[list[int]]] = [[] for _ in range(n_conv)]
    per_turn: list[dict[str, Any]] = []
    for turn in range(turns):
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        loaded = full = 0
        for i, o in enumerate(outs):
            ans = list(o.outputs[0].token_ids)
            answers[i].append(ans)
            full += len(prompts[i]) // BLOCK
            params = o.kv_transfer_params or {}
            loaded += params.get("ascend_store", {}).get("loaded_blocks", 0)
            prompts[i] = prompts[i] + ans + [rng.randrange(3, 512) for _ in range(rng.randrange(20, 60))]
        per_turn.append({"turn": turn + 1, "prompt_blocks": full, "loaded_blocks": loaded, "seconds": elapsed})
    return answers, per_turn


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ascend-offload demo", description=__doc__)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # One OMP thread on one core: with a KV connector configured, vLLM's CPU backend
    # otherwise reserves/binds both cores of a small machine and spin-waits (measured
    # 5-8x slower steps here, with or without our connector doing any work).
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    from ascend_offload.testing.tiny_model import make_tiny_llama

    model = str(make_tiny_llama(Path(tempfile.gettempdir()) / "ascend-offload-demo-model"))
    results: dict[str, Any] = {}
    for name, store in (("store", True), ("plain", False)):
        llm = _engine(model, store)
        answers, per_turn = _conversations(llm, args.conversations, args.turns, seed=1)
        results[name] = {"answers": answers, "turns": per_turn}
        llm.llm_engine.engine_core.shutdown()
        del llm
    print("\nturn  prompt blocks  loaded from store  hit rate  seconds(store)  seconds(plain)")
    for s, p in zip(results["store"]["turns"], results["plain"]["turns"], strict=True):
        rate = s["loaded_blocks"] / max(1, s["prompt_blocks"])
        print(f"{s['turn']:>4}  {s['prompt_blocks']:>13}  {s['loaded_blocks']:>17}  {rate:>8.2f}  "
              f"{s['seconds']:>14.3f}  {p['seconds']:>14.3f}")
    same = results["store"]["answers"] == results["plain"]["answers"]
    print(f"\nidentical output with and without the store: {'YES' if same else 'NO'}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"identical": same, **{k: v["turns"] for k, v in results.items()}}, indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
