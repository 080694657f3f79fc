"""``ascend-offload`` command line: plan | check-config | demo | bench NAME.

Each subcommand lives in its own module with ``main(argv) -> int``; this file
only dispatches, importing lazily so ``plan`` never pays for torch or vLLM.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, str] = {
    "plan": "ascend_offload.layerwise.plan_cli",
    "check-config": "ascend_offload.check_config",
    "demo": "ascend_offload.demo",
}

BENCHES: dict[str, str] = {
    "store": "ascend_offload.bench.store",
    "store-ssd": "ascend_offload.bench.store_ssd",
    "sparse": "ascend_offload.bench.sparse",
    "layerwise": "ascend_offload.bench.layerwise",
    "pd": "ascend_offload.bench.pd",
    "proxy": "ascend_offload.bench.proxy",
    "e2e-pd": "ascend_offload.bench.e2e_pd",
    "sparse-e2e": "ascend_offload.bench.sparse_e2e",
    "sparse-admission": "ascend_offload.bench.sparse_admission",
    "sparse-scale": "ascend_offload.bench.sparse_scale",
    "sparse-multiturn": "ascend_offload.bench.sparse_multiturn",
}
# minutes long (real vLLM engines): ``bench all`` skips them; run them by name
SLOW_BENCHES = frozenset({"e2e-pd", "sparse-e2e", "sparse-admission", "store-ssd",
                          "sparse-scale", "sparse-multiturn"})

USAGE = (
    "usage: ascend-offload {plan,check-config,demo,bench} ...\n"
    "       ascend-offload bench {" + ",".join([*BENCHES, "all"]) + "} [--json PATH]\n"
)


def _run(module: str, argv: list[str]) -> int:
    return int(importlib.import_module(module).main(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        sys.stdout.write(USAGE)
        return 0 if args else 2
    cmd, rest = args[0], args[1:]
    if cmd in COMMANDS:
        return _run(COMMANDS[cmd], rest)
    if cmd == "bench":
        if rest and rest[0] in ("-h", "--help"):
            sys.stdout.write(USAGE)
            return 0
        if not rest or rest[0] not in [*BENCHES, "all"]:
            sys.stderr.write(USAGE + "error: bench needs one of: " + ", ".join([*BENCHES, "all"]) + "\n")
            return 2
        name, bench_args = rest[0], rest[1:]
        if name != "all":
            return _run(BENCHES[name], bench_args)
        if "-h" in bench_args or "--help" in bench_args:
            sys.stdout.write("usage: ascend-offload bench all [--out DIR]\n"
                             "runs every bench but " + ", ".join(sorted(SLOW_BENCHES)) + ", writing DIR/<name>.json "
                             "(default DIR: bench-results)\n")
            return 0
        out = "bench-results"
        if "--out" in bench_args:
            out = bench_args[bench_args.index("--out") + 1]
        rc = 0
        for key, module in BENCHES.items():
            if key in SLOW_BENCHES:
                continue
            rc |= _run(module, ["--json", f"{out}/{key}.json"])
        return rc
    sys.stderr.write(USAGE + f"error: unknown command {cmd!r}\n")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
