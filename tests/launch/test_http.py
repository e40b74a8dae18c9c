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
