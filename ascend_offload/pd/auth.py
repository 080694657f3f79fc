"""Peer authentication of the P/D control plane (ZMQ CURVE keyed by one shared secret).

Why: decode's ROUTER accepts readiness from any TCP peer, and a peer that
claims a prefill's routing identity could take over its replies. With a shared
secret configured (``control_secret_file``, off by default), both sides derive
the same CURVE keys from it: decode is the CURVE server with a key pair only
the secret yields, prefill connects with that server key. A peer without the
secret cannot complete the handshake, so it can neither send a message nor
claim an identity; every message is also encrypted and integrity-protected.
No key files to distribute: the secret is the only credential.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils import z85

# Read at most this much of a secret file: a secret, not a data set.
MAX_SECRET_BYTES = 4096
MIN_SECRET_BYTES = 16


class AuthError(ValueError):
    """The shared secret is missing, unreadable or too short."""


@dataclass(frozen=True)
class ControlKeys:
    """CURVE keys (Z85) of the control plane, derived from the shared secret."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def derive_keys(secret: bytes) -> ControlKeys:
    """Both sides' CURVE key pairs from ``secret`` (deterministic: no key exchange needed)."""
    if len(secret) < MIN_SECRET_BYTES:
        raise AuthError(f"control-plane secret has {len(secret)} bytes; at least {MIN_SECRET_BYTES} needed")

    def pair(label: bytes) -> tuple[bytes, bytes]:
        sk = z85.encode(hashlib.sha256(b"ascend-offload pd " + label + b"\0" + secret).digest())
        return zmq.curve_public(sk), sk

    s_pub, s_sec = pair(b"server")
    c_pub, c_sec = pair(b"client")
    return ControlKeys(s_pub, s_sec, c_pub, c_sec)


def load_keys(path: str) -> ControlKeys | None:
    """Keys from the secret file at ``path``; None when ``path`` is empty (authentication off)."""
    if not path:
        return None
    if not zmq.has("curve"):
        raise AuthError("control_secret_file is set but this libzmq has no CURVE support")
    try:
        with open(Path(path), "rb") as f:
            secret = f.read(MAX_SECRET_BYTES + 1)
    except OSError as exc:
        raise AuthError(f"control_secret_file={path!r}: {exc.strerror or exc}") from None
    if len(secret) > MAX_SECRET_BYTES:
        raise AuthError(f"control_secret_file={path!r}: longer than {MAX_SECRET_BYTES} bytes")
    return derive_keys(secret.strip())


def secure_server(sock: zmq.Socket, keys: ControlKeys | None) -> None:
    """Make ``sock`` (before bind) accept only peers holding the secret."""
    if keys is None:
        return
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True


def secure_client(sock: zmq.Socket, keys: ControlKeys | None) -> None:
    """Make ``sock`` (before connect) authenticate to a secured server."""
    if keys is None:
        return
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret
