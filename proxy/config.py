"""The proxy's settings, validated once so the CLI and tests share the rules."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ProxyConfig:
    """Everything the proxy needs; validated here so the CLI and tests share the rules."""

    prefillers: list[tuple[str, int]]
    decoders: list[tuple[str, int]]
    host: str = "127.0.0.1"
    port: int = 8000
    # URL decode instances POST registrations to; default derived from host/port.
    metaserver_url: str | None = None
    # Deadline for a prefill answer, and for each read from a decode.
    timeout_s: float = 600.0
    # The decode must register (or answer) within this after being forwarded.
    register_timeout_s: float = 60.0
    connect_timeout_s: float = 5.0
    # A backend that refused a connection is skipped this long.
    cooldown_s: float = 2.0
    # Must stay below the backends' keep-alive (uvicorn: 5 s), or a reused
    # connection can be closed under us.
    keepalive_s: float = 4.0
    # Connections per backend instance (0 = unlimited).
    max_connections: int = 0
    max_fanout: int = 1024
    max_body_mb: int = 64

    def __post_init__(self) -> None:
        for key in ("timeout_s", "register_timeout_s", "connect_timeout_s", "keepalive_s"):
            value = getattr(self, key)
            if not value > 0:
                raise ValueError(f"{key} must be > 0, got {value!r}")
        if self.cooldown_s < 0:
            raise ValueError(f"cooldown_s must be >= 0, got {self.cooldown_s!r}")
        if self.max_connections < 0:
            raise ValueError(f"max_connections must be >= 0, got {self.max_connections!r}")
        if self.max_fanout < 1:
            raise ValueError(f"max_fanout must be >= 1, got {self.max_fanout!r}")
        if self.max_body_mb < 1:
            raise ValueError(f"max_body_mb must be >= 1, got {self.max_body_mb!r}")
        if not self.prefillers:
            raise ValueError("at least one prefill instance is required")
        if not self.decoders:
            raise ValueError("at least one decode instance is required")
        for role, addrs in (("prefill", self.prefillers), ("decode", self.decoders)):
            for host, port in addrs:
                if not host or not 0 < int(port) < 65536:
                    raise ValueError(f"bad {role} address {host!r}:{port!r}")
