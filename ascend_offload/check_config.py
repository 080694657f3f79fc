"""``ascend-offload check-config``: validate a kv-transfer config before launching vLLM.

Accepts the JSON you would pass to ``--kv-transfer-config`` (inline or a file);
prints the normalized extra config, or the error naming key and accepted values.
Children of a multi connector (``AscendMultiConnector`` or vLLM's
``MultiConnector``) that are ours are validated too, as the engine would at start.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ascend_offload.config import (
    SCHEMAS,
    ConfigError,
    StoreConnectorConfig,
    check_store_backend,
    parse_extra_config,
)

MULTI = ("AscendMultiConnector", "MultiConnector")


def _load(arg: str) -> Any:
    """The JSON of ``arg``: a file's content when ``arg`` names one, else ``arg`` itself."""
    path = Path(arg)
    inline = arg.lstrip().startswith(("{", "["))
    try:
        is_file = not inline and path.is_file()
    except OSError:  # a name the file system refuses (too long, ...): not a file
        is_file = False
    if is_file:
        text = path.read_text()
    elif not inline and (arg.endswith(".json") or "/" in arg):
        raise ConfigError(f"no such file: {arg}")
    else:
        text = arg
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        where = f"{arg}: " if is_file else ""
        raise ConfigError(f"{where}not JSON: {e}") from None


def check(raw: Any) -> dict[str, Any]:
    """The normalized config; raises :class:`ConfigError` naming the key at fault."""
    if not isinstance(raw, dict):
        raise ConfigError(f"expected a JSON object (the --kv-transfer-config), got "
                          f"{type(raw).__name__}")
    name = raw.get("kv_connector")
    extra = raw.get("kv_connector_extra_config")
    if extra is not None and not isinstance(extra, dict):
        raise ConfigError(f"key 'kv_connector_extra_config' must be an object, got "
                          f"{type(extra).__name__}")
    if name == "MultiConnector":
        cfg: dict[str, Any] = dict(extra or {})
    else:
        parsed = parse_extra_config(str(name), extra)
        if isinstance(parsed, StoreConnectorConfig):
            check_store_backend(parsed)
        cfg = parsed.model_dump()
    if name in MULTI:
        children = (extra or {}).get("connectors")
        if not isinstance(children, list):
            raise ConfigError(f"{name}: key 'connectors' must be a list of connector configs")
        out = []
        for i, child in enumerate(children):
            if isinstance(child, dict) and child.get("kv_connector") in SCHEMAS:
                try:
                    out.append(check(child))
                except ConfigError as e:
                    raise ConfigError(f"{name}: connectors[{i}]: {e}") from None
            else:
                out.append(child)
        cfg["connectors"] = out
    return {"kv_connector": name, "kv_connector_extra_config": cfg}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ascend-offload check-config", description=__doc__)
    ap.add_argument("config", help="kv-transfer-config JSON, or a path to a JSON file")
    args = ap.parse_args(argv)
    try:
        out = check(_load(args.config))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=2))
    return 0
