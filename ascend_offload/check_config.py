"""``ascend-offload check-config``: validate a kv-transfer config before launching vLLM.

Accepts the JSON you would pass to ``--kv-transfer-config`` (inline or a file);
prints the normalized extra config, or the error naming key and accepted values.
Children of a multi connector (``AscendMultiConnector`` or vLLM's
``MultiConnector``) that are ours are validated too, as the engine would at start.

Two more kinds of launch file are checked by their suffix: ``*.conf`` is a Memcache
``mmc-meta.conf`` / ``mmc-local.conf`` (``key = value``; the keys this project's
deployment sets are checked for type and range, other ``ock.mmc.*`` keys are passed
to Memcache as they are), ``*.args`` the arguments of ``ascend-offload-proxy`` (one
per line, ``#`` comments), parsed and validated by the proxy's own CLI code.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
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
from ascend_offload.store.private_files import PrivatePathError, check_private_dir

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
            if parsed.local.ssd is not None:
                check_ssd_path(parsed.local.ssd.path, parsed.local.ssd.capacity_bytes)
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


def check_ssd_path(path: str, capacity_bytes: int) -> None:
    """``local.ssd``: the directory exists and is writable, or can be created (its nearest
    existing ancestor is a writable directory), an existing one private to this user as the
    engine requires (``store/private_files``); the file system's free space (statvfs, as
    an unprivileged process sees it) holds one rank file of ``capacity_bytes``, counting
    slot files already there (they are reused). Raises :class:`ConfigError` naming the key."""
    p = Path(path).expanduser()
    probe = p
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"key 'local.ssd.path'={path!r}: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        what = "is not writable" if probe == p else f"cannot be created ({probe} is not writable)"
        raise ConfigError(f"key 'local.ssd.path'={path!r}: {what}")
    if p.is_dir():  # a missing one is created 0700 by the engine
        try:
            check_private_dir(p, "local.ssd.path")
        except PrivatePathError as exc:
            raise ConfigError(str(exc)) from None
    st = os.statvfs(probe)
    free = st.f_bavail * st.f_frsize
    existing = sum(f.stat().st_size for f in p.glob("ssd-*.slots")) if p.is_dir() else 0
    if capacity_bytes > free + existing:
        raise ConfigError(f"key 'local.ssd.capacity_bytes'={capacity_bytes}: {path!r} has {free} bytes free "
                          f"(+{existing} in slot files there); every worker rank needs capacity_bytes")


_SIZE = re.compile(r"^\d+(\.\d+)?\s*([KMGTkmgt][Bb]?)?$")
_TCP = re.compile(r"^tcp://[^\s:/]+:\d{1,5}$")
_HTTP = re.compile(r"^http://[^\s:/]+:\d{1,5}$")
_PROTOCOLS = {"device_sdma", "device_rdma", "device_urma", "device_uboe", "host_rdma", "host_tcp",
              "host_shm", "host_urma"}


def _int_in(lo: int, hi: int) -> Any:
    return lambda v: v.isdigit() and lo <= int(v) <= hi


#: Memcache keys the shipped confs set, with their checks (memcache's config reference).
MEMCACHE_KEYS: dict[str, tuple[Any, str]] = {
    "ock.mmc.meta_service_url": (_TCP.match, "tcp://host:port"),
    "ock.mmc.meta_service.config_store_url": (_TCP.match, "tcp://host:port"),
    "ock.mmc.local_service.config_store_url": (_TCP.match, "tcp://host:port"),
    "ock.mmc.meta_service.metrics_url": (_HTTP.match, "http://host:port"),
    "ock.mmc.log_level": (lambda v: v in ("debug", "info", "warn", "error"), "debug, info, warn, error"),
    "ock.mmc.local_service.world_size": (_int_in(1, 1024), "an integer in 1..1024"),
    "ock.mmc.local_service.protocol": (lambda v: v in _PROTOCOLS, ", ".join(sorted(_PROTOCOLS))),
    "ock.mmc.local_service.dram.size": (_SIZE.match, "a size such as 0, 512MB, 64GB"),
    "ock.mmc.local_service.hbm.size": (_SIZE.match, "a size such as 0, 512MB, 64GB"),
    "ock.mmc.evict_threshold_high": (_int_in(1, 99), "an integer percentage in 1..99"),
    "ock.mmc.evict_threshold_low": (_int_in(1, 98), "an integer percentage in 1..98"),
}


def check_memcache_conf(text: str, *, where: str) -> dict[str, str]:
    """The ``key = value`` pairs of a Memcache conf; raises :class:`ConfigError` naming the
    line of a malformed entry, an unknown prefix or a bad value of a known key."""
    out: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, eq, value = (p.strip() for p in line.partition("="))
        if not eq or not key:
            raise ConfigError(f"{where}:{n}: expected 'key = value', got {line[:80]!r}")
        if not key.startswith(("ock.mmc.", "ubsio.")):
            raise ConfigError(f"{where}:{n}: key {key!r} is not a Memcache key (ock.mmc.* / ubsio.*)")
        check = MEMCACHE_KEYS.get(key)
        if check is not None and not check[0](value):
            raise ConfigError(f"{where}:{n}: key {key!r}={value!r} (accepted: {check[1]})")
        out[key] = value
    hi, lo = out.get("ock.mmc.evict_threshold_high"), out.get("ock.mmc.evict_threshold_low")
    if hi is not None and lo is not None and int(lo) >= int(hi):
        raise ConfigError(f"{where}: ock.mmc.evict_threshold_low={lo} must be below evict_threshold_high={hi}")
    if "ock.mmc.meta_service_url" not in out:
        raise ConfigError(f"{where}: key 'ock.mmc.meta_service_url' is required")
    return out


def check_proxy_args(text: str, *, where: str) -> dict[str, Any]:
    """``ascend-offload-proxy`` arguments (one per line, ``#`` comments), validated by the
    proxy's own parser and config; the resulting settings."""
    import dataclasses

    from proxy.cli import build_parser, config_from_args

    argv = [a for line in text.splitlines() if not line.lstrip().startswith("#") for a in shlex.split(line)]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = build_parser().parse_args(argv)
        return dataclasses.asdict(config_from_args(args))
    except SystemExit:
        raise ConfigError(f"{where}: {err.getvalue().strip().splitlines()[-1] if err.getvalue() else 'bad arguments'}") from None
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None


def check_file(path: Path) -> Any:
    """Check a launch file by its suffix (see module doc)."""
    if path.suffix == ".conf":
        return check_memcache_conf(path.read_text(), where=str(path))
    if path.suffix == ".args":
        return check_proxy_args(path.read_text(), where=str(path))
    return check(_load(str(path)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ascend-offload check-config", description=__doc__)
    ap.add_argument("config", help="kv-transfer-config JSON, a path to a JSON file, a Memcache *.conf "
                    "or a proxy *.args file")
    args = ap.parse_args(argv)
    path = Path(args.config)
    try:
        out = check_file(path) if path.suffix in (".conf", ".args") else check(_load(args.config))
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=2))
    return 0
