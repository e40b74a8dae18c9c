"""The authenticated control plane between nodes: rank 0's message broadcast over ZMQ TCP.

Every process of a multi-node job holds the same secret token (``TPSERVE_DIST_TOKEN``), from which
two CURVE key pairs are derived: the server's (rank 0's XPUB) and the clients' (the other ranks'
SUB sockets). A peer without the token cannot compute the server's public key, so its handshake
fails; a client key other than the job's is refused by the ZAP handler; all traffic is encrypted.
CURVE (libsodium, in pyzmq's wheels) rather than a home-made token handshake: libzmq authenticates
every connection before a single message reaches tpserve.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
from dataclasses import dataclass

import zmq
import zmq.auth.thread

logger = logging.getLogger(__name__)

TOKEN_ENV = "TPSERVE_DIST_TOKEN"
MIN_TOKEN_CHARS = 16


def read_token(env: dict[str, str] | None = None) -> str:
    """The job's shared secret from the environment; a clear error when it is missing or short."""
    token = (os.environ if env is None else env).get(TOKEN_ENV, "")
    if len(token) < MIN_TOKEN_CHARS:
        problem = "is not set" if not token else f"is shorter than {MIN_TOKEN_CHARS} characters"
        raise ValueError(
            f"{TOKEN_ENV} {problem}: a multi-node job needs the same secret on every node, "
            f"e.g. export {TOKEN_ENV}=$(openssl rand -hex 32)"
        )
    return token


@dataclass(frozen=True)
class CurveKeys:
    """z85-encoded key pairs derived from the token (the same on every node)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def from_token(cls, token: str) -> CurveKeys:
        def pair(role: str) -> tuple[bytes, bytes]:
            secret = zmq.utils.z85.encode(hashlib.sha256(f"tpserve-{role}\0{token}".encode()).digest())
            return zmq.curve_public(secret), secret

        return cls(*pair("server"), *pair("client"))


def zmq_host(host: str) -> str:
    """An address ZMQ can bind to or connect to: a resolved IP, bracketed when IPv6."""
    if ":" in host:
        return f"[{host}]"
    try:
        return socket.gethostbyname(host)
    except OSError as e:
        raise ValueError(f"cannot resolve {host!r}: {e}") from None


class ZapGuard(zmq.auth.thread.ThreadAuthenticator):
    """The (started) ZAP handler of one context, accepting only the job's client key."""

    def __init__(self, ctx: zmq.Context, keys: CurveKeys) -> None:
        super().__init__(ctx, log=logging.getLogger(f"{__name__}.zap"))
        self.client_public = keys.client_public
        self.refused = 0
        self.start()
        self.configure_curve_callback("*", self)

    def callback(self, domain: str, key: bytes) -> bool:
        """The credentials check (ZAP calls it on the auth thread)."""
        if key == self.client_public:
            return True
        self.refused += 1
        if self.refused & (self.refused - 1) == 0:  # the 1st, 2nd, 4th, ...: a peer retrying cannot flood the log
            logger.warning("refused a control-plane connection with an unknown key (not this job's %s; %d so far)",
                           TOKEN_ENV, self.refused)
        return False


def secure_server(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make ``sock`` (before bind) a CURVE server that the ZAP handler checks."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)


def secure_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make ``sock`` (before connect) a CURVE client of the job's server."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
