"""The proxy's settings, validated once so the CLI and tests share the rules."""

from __future__ import annotations

from dataclasses import dataclass

MB = 1024 * 1024

# Timers beyond this (a week) are a typo, and inf/1e300 overflow the event loop's timers.
MAX_TIMEOUT_S = 7 * 24 * 3600.0
# A registration's fixed part: five ids of at most 512 characters (registration.py), the
# keys, the small ints, and room for escapes and whitespace.
REGISTRATION_OVERHEAD = 16 * 1024
# One block id in the JSON list: up to 10 digits, a comma and a space.
REGISTRATION_BYTES_PER_BLOCK = 12
PREFILL_DISPATCH = ("registered", "early")


def registration_max_bytes(max_model_len: int, block_size: int) -> int:
    """The largest legitimate ``/v1/metaserver`` body: one block id per prompt block.

    Why derived: a decode registers one destination block per prompt block, so the
    longest prompt the decode accepts sets the longest list; anything above it is not a
    registration and must not cost the proxy more memory than one.
    """
    blocks = -(-max_model_len // block_size)
    return REGISTRATION_OVERHEAD + blocks * REGISTRATION_BYTES_PER_BLOCK


@dataclass
class ProxyConfig:
    """Everything the proxy needs; validated here so the CLI and tests share the rules."""

    prefillers: list[tuple[str, int]]
    decoders: list[tuple[str, int]]
    host: str = "127.0.0.1"
    port: int = 8000
    # URL decode instances POST registrations to; default derived from the
    # metaserver listener (its own when metaserver_port is set, else host/port).
    metaserver_url: str | None = None
    # A separate listener for /v1/metaserver (None: served on the public one).
    # Bind it to an interface only the decode instances reach.
    metaserver_host: str | None = None
    metaserver_port: int | None = None
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
    # A client (or registering decode) must deliver its whole body within this;
    # a stalled upload gets 408 and its connection closed.
    body_timeout_s: float = 30.0
    # A write to a client that stops reading may wait this long, then the
    # connection is closed and both backends are aborted.
    write_timeout_s: float = 60.0
    # Client requests served at once; more get 429 with Retry-After.
    max_inflight: int = 1024
    # Request bodies held at once (Content-Length, or max_body_mb when unknown);
    # more get 503 with Retry-After.
    max_inflight_mb: int = 1024
    # Sub-requests waiting in the metaserver registry; more get 503.
    max_pending: int = 16384
    # Chunks buffered between the sub-streams of a fan-out and the client.
    fanout_queue: int = 64
    # Largest non-streamed decode answer read, and largest event of a fanned-out
    # stream (502 above it).
    max_answer_mb: int = 256
    # The decodes' --max-model-len and --block-size: they bound a registration's block
    # list, hence its body (registration_max_bytes). Too small refuses long prompts'
    # registrations (413); too large only loosens the cap.
    max_model_len: int = 262144
    block_size: int = 16
    # When the prefill request leaves: "registered" (after the decode registered, its
    # params in the body) or "early" (together with the decode request; the prefill
    # claims the params at /v1/metaserver/claim, so its HTTP ingress overlaps the
    # decode's ingress and registration).
    prefill_dispatch: str = "registered"

    def __post_init__(self) -> None:
        _check_port("port", self.port)
        if self.metaserver_port is not None:
            _check_port("metaserver_port", self.metaserver_port)
        for key in ("timeout_s", "register_timeout_s", "connect_timeout_s", "keepalive_s",
                    "body_timeout_s", "write_timeout_s"):
            value = getattr(self, key)
            if not 0 < value <= MAX_TIMEOUT_S:
                raise ValueError(f"{key} must be > 0 and <= {MAX_TIMEOUT_S:g} s, got {value!r}")
        if not 0 <= self.cooldown_s <= MAX_TIMEOUT_S:
            raise ValueError(f"cooldown_s must be >= 0 and <= {MAX_TIMEOUT_S:g} s, got {self.cooldown_s!r}")
        if self.max_connections < 0:
            raise ValueError(f"max_connections must be >= 0, got {self.max_connections!r}")
        if self.max_fanout < 1:
            raise ValueError(f"max_fanout must be >= 1, got {self.max_fanout!r}")
        for key in ("max_body_mb", "max_inflight", "max_inflight_mb", "max_pending", "fanout_queue",
                    "max_answer_mb", "max_model_len", "block_size"):
            value = getattr(self, key)
            if not value >= 1:
                raise ValueError(f"{key} must be >= 1, got {value!r}")
        if self.max_inflight_mb < self.max_body_mb:
            raise ValueError(
                f"max_inflight_mb ({self.max_inflight_mb}) must be >= max_body_mb ({self.max_body_mb}):"
                " a largest-size request could never be admitted"
            )
        if self.registration_max_bytes > self.max_inflight_mb * MB:
            raise ValueError(
                f"a registration of max_model_len={self.max_model_len} in blocks of {self.block_size} "
                f"({self.registration_max_bytes} bytes) does not fit max_inflight_mb={self.max_inflight_mb}"
            )
        if self.prefill_dispatch not in PREFILL_DISPATCH:
            raise ValueError(
                f"prefill_dispatch must be one of {', '.join(PREFILL_DISPATCH)}, got {self.prefill_dispatch!r}"
            )
        if not self.prefillers:
            raise ValueError("at least one prefill instance is required")
        if not self.decoders:
            raise ValueError("at least one decode instance is required")
        for role, addrs in (("prefill", self.prefillers), ("decode", self.decoders)):
            for host, port in addrs:
                if not host or not 0 < int(port) < 65536:
                    raise ValueError(f"bad {role} address {host!r}:{port!r}")


    @property
    def registration_max_bytes(self) -> int:
        """Cap on one ``/v1/metaserver`` body (413 above it)."""
        return registration_max_bytes(self.max_model_len, self.block_size)


def _check_port(key: str, value: object) -> None:
    """0 (pick a free port) .. 65535; anything else is an error, never wrapped around."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ValueError(f"{key} must be an integer in 0..65535, got {value!r}")
