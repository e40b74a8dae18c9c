"""ZMQ PUSH/PULL sockets that carry msgpack-encoded msgspec structs (frontend helpers)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import msgspec
import zmq

from tpserve.message import Shutdown

T = TypeVar("T")

_ENCODER = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _ENCODER.encode(msg)


def open_socket(ctx: zmq.Context, kind: int, address: str, bind: bool) -> Any:
    """A PUSH or PULL socket that never blocks process exit (linger 0)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


class Receiver(Generic[T]):
    """A blocking PULL socket decoding one message type (usually a tagged union)."""

    def __init__(self, ctx: zmq.Context, address: str, msg_type: Any, bind: bool) -> None:
        self.socket = open_socket(ctx, zmq.PULL, address, bind)
        self._decoder = msgspec.msgpack.Decoder(msg_type)

    def serve(self, handle: Callable[[T], None], heartbeat: Any = None) -> None:
        """Pass every message to ``handle`` until a Shutdown arrives. ``heartbeat`` (a shared double, the
        server's /health reads it) gets time.monotonic() at least once a second while the loop is live."""
        while True:
            if heartbeat is not None:
                heartbeat.value = time.monotonic()
            if not self.socket.poll(1000):
                continue
            msg = self._decoder.decode(self.socket.recv())
            if isinstance(msg, Shutdown):
                return
            handle(msg)


class Sender:
    """A connecting PUSH socket for msgspec structs."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.socket = open_socket(ctx, zmq.PUSH, address, bind=False)

    def send(self, msg: msgspec.Struct) -> None:
        self.socket.send(encode(msg))
