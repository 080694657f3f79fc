"""``ascend-offload plan``: print the layerwise buffer plan for a layer count.

Why a CLI: operators size ``layerwise_num_shared_buffers`` before they start an
engine; this shows the slot assignment and the device KV footprint without
loading torch or vLLM. Bad input exits with code 2 and names the option.
"""

from __future__ import annotations

import argparse
import json
import sys

from ascend_offload.errors import AscendOffloadError
from ascend_offload.layerwise.plan import KEY_B, KEY_I, Independent, PlanError, plan_uniform

_OPTION_OF = {KEY_B: "--shared-buffers", KEY_I: "--independent"}


class _UsageError(AscendOffloadError):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so ``main`` can return 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(message)


def _parse_independent(text: str) -> Independent:
    text = text.strip()
    if text == "all":
        return "all"
    if not text:
        return []
    out: list[int] = []
    for part in text.split(","):
        try:
            out.append(int(part.strip()))
        except ValueError:
            raise _UsageError(
                f"--independent {text!r}: {part.strip()!r} is not an integer "
                "(accepted: comma-separated layer indices such as 0,-1, or 'all')"
            ) from None
    return out


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="ascend-offload plan",
        description="Show which physical KV buffer each layer uses under layerwise sharing.",
    )
    p.add_argument("--num-layers", type=int, required=True, help="cache-bearing base layers N")
    p.add_argument("--shared-buffers", type=int, required=True, help="shared buffers B (>= 1)")
    p.add_argument(
        "--independent", default="0",
        help="layers with their own buffer: comma-separated indices (negatives count from the "
        "end, MTP layers included) or 'all' (default: 0)",
    )
    p.add_argument("--mtp-layers", type=int, default=0, help="MTP layers after the base layers")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def _text(plan_json: dict[str, object], names: list[str]) -> str:
    assignment = plan_json["assignment"]
    assert isinstance(assignment, list)
    lines = [
        f"logical layers: {plan_json['num_logical_layers']}  physical buffers: "
        f"{plan_json['physical_buffers']}  footprint ratio: {plan_json['footprint_ratio']:.4f}",
        "layer  slot  prefetch-from",
    ]
    prefetch = plan_json["prefetch_from"]
    assert isinstance(prefetch, list)
    for i, (slot, prev) in enumerate(zip(assignment, prefetch, strict=True)):
        src = "-" if prev is None else names[prev]
        lines.append(f"{names[i]:<10} {slot:>4}  {src}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        try:
            args = parser.parse_args(args_list)
        except SystemExit as exc:  # --help
            return int(exc.code or 0)
        if args.num_layers < 1:
            raise _UsageError(f"--num-layers {args.num_layers}: must be >= 1")
        if args.mtp_layers < 0:
            raise _UsageError(f"--mtp-layers {args.mtp_layers}: must be >= 0")
        independent = _parse_independent(args.independent)
        try:
            plan = plan_uniform(args.num_layers, args.shared_buffers, independent, args.mtp_layers)
        except PlanError as exc:
            option = _OPTION_OF.get(exc.key or "", "")
            prefix = f"{option}: " if option else ""
            raise _UsageError(prefix + str(exc)) from None
    except _UsageError as exc:
        sys.stderr.write(f"ascend-offload plan: error: {exc}\n")
        return 2
    data = plan.to_json()
    if args.json:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    else:
        sys.stdout.write(_text(data, list(plan.layers)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
