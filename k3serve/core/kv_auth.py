"""The KV events secret: one shared string that keys the block hashes and authenticates the event sockets.

An engine's KV event sockets (``engine.kv_events``) tell whoever connects which prefixes are cached, by
block hash. On a loopback address only local processes can connect; anywhere else they need a secret,
shared by the replicas and their router (``--kv-events-key-file PATH`` or the ``K3SERVE_KV_EVENTS_KEY``
environment variable; never argv, which ``ps`` shows). From it both sides derive, deterministically:

* ``hash_key``: the BLAKE2b key of ``core.hashing`` (32 bytes), so a subscriber without the secret cannot
  test whether a guessed prompt is cached; engine and router hash with the same key, so the router's prefix
  index still matches the engine's blocks;
* a CURVE server keypair (the engine binds with it) and a client keypair (the router connects with it); a
  ZAP handler in the engine admits only the derived client key, so nobody else gets a byte of the stream.

The server's *public* key is published in ``/kv_events/info``: a router with another secret sees the
mismatch there and says so, instead of waiting for events that never come. Deriving goes through scrypt
(~0.1 s, once per process) so that public key does not make a short secret cheap to guess offline.
Key material is z85 text (40 chars), as libzmq takes it.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import os
import secrets
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KEY_ENV = "K3SERVE_KV_EVENTS_KEY"
MIN_SECRET_CHARS = 16
_SALT = b"k3serve-kv-events-v1"  # bump with any change to the derivation


@dataclass(frozen=True)
class KVEventsKey:
    """Everything derived from one secret; secret parts are left out of ``repr`` (logs, tracebacks)."""

    hash_key: bytes = field(repr=False)
    server_public: bytes  # z85, published in /kv_events/info
    server_secret: bytes = field(repr=False)
    client_public: bytes
    client_secret: bytes = field(repr=False)

    @staticmethod
    def from_secret(secret: str) -> KVEventsKey:
        return _derive(check_secret(secret))


def check_secret(secret: str) -> str:
    secret = secret.strip()
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"the KV events key must be at least {MIN_SECRET_CHARS} characters, got {len(secret)}")
    return secret


@functools.lru_cache(maxsize=4)
def _derive(secret: str) -> KVEventsKey:
    import zmq
    from zmq.utils import z85

    if not zmq.has("curve"):
        raise ValueError("this pyzmq/libzmq has no CURVE support: KV events cannot be authenticated")
    master = hashlib.scrypt(secret.encode(), salt=_SALT, n=2**14, r=8, p=1, dklen=64)

    def part(label: bytes) -> bytes:
        return hashlib.blake2b(master, digest_size=32, person=label).digest()

    server_secret, client_secret = z85.encode(part(b"curve-server")), z85.encode(part(b"curve-client"))
    return KVEventsKey(hash_key=part(b"block-hash"), server_public=zmq.curve_public(server_secret),
                       server_secret=server_secret, client_public=zmq.curve_public(client_secret),
                       client_secret=client_secret)


def new_secret() -> str:
    """A fresh random secret (for ``serve --replicas``, which hands it to its replicas and router itself)."""
    return secrets.token_urlsafe(32)


def load_secret(key_file: str | None, env: dict[str, str] | None = None) -> str | None:
    """The secret from ``key_file`` (it wins) or ``K3SERVE_KV_EVENTS_KEY``; None when neither is set.
    ValueError (one line) for an unreadable file or a secret that is too short."""
    if key_file is not None:
        try:
            text = Path(key_file).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--kv-events-key-file {key_file}: cannot read it ({e.__class__.__name__})") from None
        try:
            return check_secret(text)
        except ValueError as e:
            raise ValueError(f"--kv-events-key-file {key_file}: {e}") from None
    value = (os.environ if env is None else env).get(KEY_ENV)
    if not value:
        return None
    try:
        return check_secret(value)
    except ValueError as e:
        raise ValueError(f"{KEY_ENV}: {e}") from None


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` exposes nothing beyond this machine (unresolvable: False)."""
    if host in ("*", ""):
        return False
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def check_exposure(host: str, secret: str | None) -> None:
    """Refuse KV events on a non-loopback address without a secret: they would leak the cache to anyone."""
    if secret is None and not is_loopback(host):
        raise ValueError(f"--kv-events-host {host} is not a loopback address: KV events there need a key "
                         f"(--kv-events-key-file PATH or {KEY_ENV}), the same one the router is given")


class _OnlyKey:
    """ZAP credentials provider admitting one CURVE client public key."""

    def __init__(self, client_public: bytes) -> None:
        self.client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return secrets.compare_digest(key, self.client_public)


def start_authenticator(ctx: Any, key: KVEventsKey) -> Any:
    """A ZAP handler thread on ``ctx`` admitting only ``key``'s client. Start it before binding: without a
    handler libzmq lets any CURVE client in (the server's public key is no secret). Stop it on close."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback("*", _OnlyKey(key.client_public))
    return auth


def make_server(sock: Any, key: KVEventsKey) -> None:
    """Make ``sock`` a CURVE server (before ``bind``)."""
    sock.curve_secretkey = key.server_secret
    sock.curve_publickey = key.server_public
    sock.curve_server = True


def make_client(sock: Any, key: KVEventsKey) -> None:
    """Make ``sock`` a CURVE client of a ``make_server`` socket (before ``connect``)."""
    sock.curve_secretkey = key.client_secret
    sock.curve_publickey = key.client_public
    sock.curve_serverkey = key.server_public
