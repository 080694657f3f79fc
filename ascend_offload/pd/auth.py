"""Peer authentication of the P/D control plane (ZMQ CURVE keyed by one shared secret).

Why: decode's ROUTER accepts readiness from any TCP peer, and a peer that
claims a prefill's routing identity could take over its replies. With a shared
secret configured (``control_secret_file``, off by default), both sides derive
the same CURVE keys from it: decode is the CURVE server with a key pair only
the secret yields, prefill connects with that server key and with the client
key pair only the secret yields. CURVE alone proves the server to the client;
the client's key is checked by a ZAP handler (``ServerAuth``) that admits only
the derived client key, so knowing the server's public key is not enough. A
peer without the secret cannot complete the handshake, so it can neither send
a message nor claim an identity; every message is also encrypted and
integrity-protected. No key files to distribute: the secret is the only
credential.

The ZAP handler serves every CURVE socket of its ZMQ context, so it runs on
a context of the control plane's own, never on the process-wide
``zmq.Context.instance()`` that vLLM and other libraries share.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from ascend_offload.errors import AscendOffloadError

log = logging.getLogger(__name__)

# Read at most this much of a secret file: a secret, not a data set.
MAX_SECRET_BYTES = 4096
MIN_SECRET_BYTES = 16


class AuthError(AscendOffloadError, ValueError):
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
    """Keys from the secret file at ``path``; None when ``path`` is empty (authentication off).

    The path is read as given, symlinks followed: a Kubernetes Secret mount is a
    chain of links to the real file. A file others may read or write (group or
    other permission bits) is used, with a warning: the secret is the only
    credential of the control plane.
    """
    if not path:
        return None
    if not zmq.has("curve"):
        raise AuthError("control_secret_file is set but this libzmq has no CURVE support")
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            secret = f.read(MAX_SECRET_BYTES + 1)
    except OSError as exc:
        raise AuthError(f"control_secret_file={path!r}: {exc.strerror or exc}") from None
    if stat.S_IMODE(mode) & 0o077:
        real = os.path.realpath(path)
        shown = path if real == os.path.abspath(path) else f"{path} -> {real}"
        log.warning("control_secret_file=%s has mode %04o: group or others may read it; the shared "
                    "secret is the control plane's only credential (chmod 600, or a Secret's "
                    "defaultMode 0400)", shown, stat.S_IMODE(mode))
    if len(secret) > MAX_SECRET_BYTES:
        raise AuthError(f"control_secret_file={path!r}: longer than {MAX_SECRET_BYTES} bytes")
    return derive_keys(secret.strip())


class _ClientKey:
    """ZAP credentials provider: admits exactly one CURVE client key (Z85)."""

    # Distinct refused keys that get a warning; a peer reconnects every few hundred
    # milliseconds, so later refusals of a known key are logged at debug only.
    MAX_WARNED = 64

    def __init__(self, client_public: bytes) -> None:
        self._key = client_public
        self._warned: set[bytes] = set()
        self.refused = 0

    def callback(self, domain: str, key: bytes) -> bool:
        if hmac.compare_digest(key, self._key):
            return True
        self.refused += 1
        if key not in self._warned and len(self._warned) < self.MAX_WARNED:
            self._warned.add(key)
            log.warning("P/D control plane: refused a peer whose CURVE client key %s is not the one "
                        "derived from control_secret_file (a wrong or missing secret)", key.decode())
        else:
            log.debug("P/D control plane: refused CURVE client key %s", key.decode())
        return False


class ServerAuth:
    """The ZMQ context of a secured server (decode's ROUTER), checking its clients' keys.

    With ``keys``: a context of its own, whose ZAP handler (a pyzmq
    ``ThreadAuthenticator``) admits only ``keys.client_public``. Without: the
    process-wide context, nothing installed. ``close()`` after the sockets made
    on ``context`` are closed (or to destroy them with it).
    """

    def __init__(self, keys: ControlKeys | None) -> None:
        self._owned = keys is not None
        self._auth: ThreadAuthenticator | None = None
        self.check: _ClientKey | None = None
        self.context: zmq.Context
        if keys is None:
            self.context = zmq.Context.instance()
            return
        self.context = zmq.Context()
        try:
            self.check = _ClientKey(keys.client_public)
            self._auth = ThreadAuthenticator(self.context, log=logging.getLogger(f"{__name__}.zap"))
            self._auth.configure_curve_callback("*", credentials_provider=self.check)
            self._auth.start()  # binds the context's ZAP endpoint before any socket accepts
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if not self._owned:
            return
        self._owned = False
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self.context.destroy(linger=0)


def secure_server(sock: zmq.Socket, keys: ControlKeys | None) -> None:
    """Make ``sock`` (before bind) accept only peers holding the secret.

    ``sock`` must come from ``ServerAuth(keys).context``: CURVE itself admits any
    client key, the context's ZAP handler refuses all but the derived one.
    """
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
