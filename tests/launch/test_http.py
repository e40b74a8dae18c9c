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
