"""ipc directories: private, owned, and reaped after a server killed with SIGKILL."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess

from tpserve.message.endpoints import OWNER_FILE, Endpoints, remove_stale_directories


def make_dir(root, name: str, owner: int | None) -> str:
    path = root / name
    path.mkdir()
    if owner is not None:
        (path / OWNER_FILE).write_text(str(owner))
    return str(path)


def test_only_directories_of_dead_owners_are_removed(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = make_dir(tmp_path, "tpserve-stale", dead.pid)
    live = make_dir(tmp_path, "tpserve-live", os.getpid())
    unowned = make_dir(tmp_path, "tpserve-unowned", None)
    other = make_dir(tmp_path, "something-else", dead.pid)
    assert remove_stale_directories(str(tmp_path)) == [stale]
    assert not os.path.exists(stale)
    assert all(os.path.isdir(p) for p in (live, unowned, other))


def test_created_directory_is_private_and_owned():
    endpoints = Endpoints.create()
    try:
        mode = stat.S_IMODE(os.stat(endpoints.directory).st_mode)
        assert mode == 0o700
        with open(os.path.join(endpoints.directory, OWNER_FILE)) as f:
            assert int(f.read()) == os.getpid()
        assert endpoints.scheduler.startswith(f"ipc://{endpoints.directory}/")
    finally:
        shutil.rmtree(endpoints.directory)
