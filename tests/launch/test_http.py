"""The HTTP server's process settings."""

from __future__ import annotations

import contextlib
import resource
import socket
import threading
import time
from typing import Iterator

import pytest

from tpserve.launch.http import raise_open_files_limit


def test_the_open_files_limit_is_raised_within_the_hard_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        raise_open_files_limit(4096)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == (4096 if hard == resource.RLIM_INFINITY else
                                                                 min(4096, hard))
        raise_open_files_limit(512)  # never lowered
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= min(4096, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_out_of_file_descriptor_lines_are_logged_once_per_interval():
    import logging

    from tpserve.launch.http import AcceptErrorsOncePer

    now = [0.0]
    once = AcceptErrorsOncePer(10.0, clock=lambda: now[0])

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, None, None)

    accept = "socket.accept() out of system resource"
    assert [once.filter(record(accept)) for _ in range(1000)] == [True] + [False] * 999
    assert once.filter(record("something else")) and once.dropped == 999
    now[0] = 10.5
    assert once.filter(record(accept))


@contextlib.contextmanager
def trickle_server(app) -> Iterator[int]:
    """uvicorn with tpserve's HTTP protocol serving ``app`` on a free port, in a thread."""
    import uvicorn

    from tpserve.launch import http

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, http=http._idle_timeout_protocol(), log_level="error", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)


def response(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"ok"):
        chunk = conn.recv(1024)
        assert chunk, data
        data += chunk
    return data


def closed_while_trickling(conn: socket.socket, pieces: Iterator[bytes]) -> float:
    """Sends ``pieces`` 0.2 s apart until the server closes the connection; the seconds that took."""
    start = time.monotonic()
    with pytest.raises((BrokenPipeError, ConnectionResetError)):
        for piece in pieces:
            conn.sendall(piece)
            time.sleep(0.2)
            if conn.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b"":
                raise ConnectionResetError
    return time.monotonic() - start


async def ok_app(scope, receive, send):
    """Reads the request's body, then answers "ok"."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def test_headers_trickled_past_the_deadline_close_the_connection(monkeypatch):
    """Slowloris: a client sending a request's headers a line at a time held its connection forever (uvicorn has
    no header timeout). Headers not complete HEADER_TIMEOUT_S after a request's first bytes now close it; a request
    whose headers come in time, even in pieces, is served, and so is the next one on the connection."""
    from tpserve.launch import http

    monkeypatch.setattr(http, "HEADER_TIMEOUT_S", 0.6)
    with trickle_server(ok_app) as port:
        def connect() -> socket.socket:
            conn = socket.create_connection(("127.0.0.1", port), timeout=10)
            conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
            return conn

        # 8 s of header lines
        assert closed_while_trickling(connect(), (b"X-Slow-%d: 1\r\n" % i for i in range(40))) < 3
        timely = connect()
        time.sleep(0.3)
        timely.sendall(b"X-In-Time: 1\r\n\r\n")
        assert response(timely).startswith(b"HTTP/1.1 200")
        time.sleep(0.8)  # idle between requests: the keep-alive timeout (5 s) applies, not the header deadline
        timely.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        time.sleep(0.3)
        timely.sendall(b"\r\n")
        assert response(timely).startswith(b"HTTP/1.1 200")


def test_a_body_trickled_past_the_deadline_closes_the_connection(monkeypatch):
    """The same for a request's body: its headers complete, a client sending the body a byte at a time held the
    connection, and the handler waiting for the body, forever. A body not complete BODY_TIMEOUT_S after its headers
    now closes it; one that comes in time, in pieces, is served, and so is a body-less request after it."""
    from tpserve.launch import http

    monkeypatch.setattr(http, "BODY_TIMEOUT_S", 0.6)
    monkeypatch.setattr(http, "HEADER_TIMEOUT_S", 30.0)
    with trickle_server(ok_app) as port:
        def post(length: int) -> socket.socket:
            conn = socket.create_connection(("127.0.0.1", port), timeout=10)
            conn.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % length)
            return conn

        assert closed_while_trickling(post(100), (b"x" for _ in range(40))) < 3
        timely = post(4)
        for piece in (b"ab", b"cd"):
            time.sleep(0.2)
            timely.sendall(piece)
        assert response(timely).startswith(b"HTTP/1.1 200")
        time.sleep(0.8)  # past the body deadline: a finished body's timer is gone
        timely.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert response(timely).startswith(b"HTTP/1.1 200")


def test_a_body_the_app_has_not_read_yet_is_no_slow_client(monkeypatch):
    """The body deadline bounds the client, not the server: a body past uvicorn's buffer (reading paused until the
    app reads it) whose app starts reading after the deadline is served, not cut off (as a pipelined request queued
    behind a slow response is: its reads are paused too)."""
    import asyncio

    from tpserve.launch import http

    monkeypatch.setattr(http, "BODY_TIMEOUT_S", 0.6)

    async def late_reader(scope, receive, send):
        if scope["type"] != "http":
            return
        await asyncio.sleep(1.5)
        size = 0
        while True:
            message = await receive()
            size += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"%d ok" % size
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})

    with trickle_server(late_reader) as port:
        size = 1 << 20  # far past uvicorn's 64 KiB high-water mark
        conn = socket.create_connection(("127.0.0.1", port), timeout=10)
        conn.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % size)
        sender = threading.Thread(target=conn.sendall, args=(b"x" * size,), daemon=True)
        sender.start()
        assert response(conn).endswith(b"\r\n\r\n%d ok" % size)
        sender.join(10)
