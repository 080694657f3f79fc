"""``ascend-offload check-config``: validate a kv-transfer config before launching vLLM.

Accepts the JSON you would pass to ``--kv-transfer-config`` (inline or a file);
prints the normalized extra config, or the error naming key and accepted values.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ascend_offload.config import ConfigError, parse_extra_config


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ascend-offload check-config", description=__doc__)
    ap.add_argument("config", help="kv-transfer-config JSON, or a path to a JSON file")
    args = ap.parse_args(argv)
    text = Path(args.config).read_text() if Path(args.config).is_file() else args.config
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        print(f"error: not JSON: {e}", file=sys.stderr)
        return 2
    name = raw.get("kv_connector")
    try:
        cfg = parse_extra_config(str(name), raw.get("kv_connector_extra_config"))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"kv_connector": name, "kv_connector_extra_config": cfg.model_dump()}, indent=2))
    return 0
