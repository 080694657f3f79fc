"""``ascend-offload demo`` (``make demo``): the P/D deployment with sparse decode offload.

Starts our proxy, a prefill engine (``configs/cpu-demo/prefill-joint.json``:
AscendMultiConnector of the layerwise store with shared buffers and the RD2H
producer; ``--prefill-config`` switches it, e.g. to ``prefill.json``, the RD2H
producer alone), a plain engine of the same model, and a decode engine
(``configs/cpu-demo/decode.json``: RD2H consumer with sparse decode offload, no
main KV on the device, speculating with n-gram drafts unless ``--no-speculative``)
on a generated tiny sparse-MLA model; sends a workload
with shared prefixes through the proxy (some streamed, most longer than the
decode hot buffer); compares every answer with the plain engine's; prints one
table of per-request latency and the servers' counters, ending with
``demo: N/N requests identical``. Exit 0 iff every answer is identical.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from ascend_offload.demo.run import CONFIG_DIR
from ascend_offload.demo.workload import SPEC


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ascend-offload demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill-config", type=Path, default=CONFIG_DIR / "prefill-joint.json",
                    help="the prefill's --kv-transfer-config file (kv_port is replaced by a free port)")
    ap.add_argument("--decode-config", type=Path, default=CONFIG_DIR / "decode.json")
    ap.add_argument("--requests", type=int, default=len(SPEC), choices=range(1, len(SPEC) + 1),
                    metavar=f"1..{len(SPEC)}", help="run the first N requests of the workload")
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--log-dir", type=Path, default=None,
                    help="where vLLM's and the proxy's logs go (default: a new temporary folder)")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--no-speculative", action="store_true",
                    help="the decode does not speculate (default: n-gram drafts, one per step)")
    args = ap.parse_args(argv)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix=time.strftime("ascend-offload-demo-%Y%m%d-%H%M%S-")))
    from ascend_offload.demo.run import SPECULATIVE, demo

    return demo(args.prefill_config, args.decode_config, args.requests, args.max_tokens, log_dir,
                args.startup_timeout, None if args.no_speculative else SPECULATIVE)
