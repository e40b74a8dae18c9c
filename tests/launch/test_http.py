"""The HTTP server's process settings."""

from __future__ import annotations

import resource

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


def test_headers_trickled_past_the_deadline_close_the_connection(monkeypatch):
    """Slowloris: a client sending a request's headers a line at a time held its connection forever (uvicorn has
    no header timeout). Headers not complete HEADER_TIMEOUT_S after a request's first bytes now close it; a request
    whose headers come in time, even in pieces, is served, and so is the next one on the connection."""
    import socket
    import threading
    import time

    import uvicorn

    from tpserve.launch import http

    monkeypatch.setattr(http, "HEADER_TIMEOUT_S", 0.6)

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, http=http._idle_timeout_protocol(), log_level="error", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        port = sock.getsockname()[1]

        def connect() -> socket.socket:
            conn = socket.create_connection(("127.0.0.1", port), timeout=10)
            conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
            return conn

        slow = connect()
        start = time.monotonic()
        with __import__("pytest").raises((BrokenPipeError, ConnectionResetError)):
            for i in range(40):  # 8 s of header lines, 0.2 s apart
                slow.sendall(b"X-Slow-%d: 1\r\n" % i)
                time.sleep(0.2)
                if slow.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b"":
                    raise ConnectionResetError
        assert time.monotonic() - start < 3

        def response(conn: socket.socket) -> bytes:
            data = b""
            while not data.endswith(b"ok"):
                chunk = conn.recv(1024)
                assert chunk, data
                data += chunk
            return data

        timely = connect()
        time.sleep(0.3)
        timely.sendall(b"X-In-Time: 1\r\n\r\n")
        assert response(timely).startswith(b"HTTP/1.1 200")
        time.sleep(0.8)  # idle between requests: the keep-alive timeout (5 s) applies, not the header deadline
        timely.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        time.sleep(0.3)
        timely.sendall(b"\r\n")
        assert response(timely).startswith(b"HTTP/1.1 200")
    finally:
        server.should_exit = True
        thread.join(10)
