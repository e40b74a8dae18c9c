"""ZMQ socket addresses of one server instance: ipc:// paths in a private temporary directory.

The server removes its directory when it stops. A server killed with SIGKILL cannot, so each
directory records its owner's pid, and the next server to start removes the directories of
owners that are gone.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass

PREFIX = "tpserve-"
OWNER_FILE = "owner.pid"


@dataclass(frozen=True)
class Endpoints:
    tokenizer: str  # API server PUSH (binds) -> tokenizer workers PULL (connect)
    scheduler: str  # tokenizers / detokenizer / API server PUSH (connect) -> rank 0 PULL (binds)
    rank_broadcast: str  # rank 0 PUB (binds) -> ranks 1.. SUB (connect)
    detokenizer: str  # rank 0 PUSH (connects) -> detokenizer PULL (binds)
    api: str  # detokenizer and tokenizers PUSH (connect) -> API server PULL (binds)
    directory: str

    @classmethod
    def create(cls) -> Endpoints:
        remove_stale_directories()
        directory = tempfile.mkdtemp(prefix=PREFIX)
        os.chmod(directory, 0o700)
        with open(os.path.join(directory, OWNER_FILE), "w") as f:
            f.write(str(os.getpid()))

        def path(name: str) -> str:
            return f"ipc://{os.path.join(directory, name)}"

        return cls(
            tokenizer=path("tokenizer"),
            scheduler=path("scheduler"),
            rank_broadcast=path("rank-broadcast"),
            detokenizer=path("detokenizer"),
            api=path("api"),
            directory=directory,
        )


def remove_stale_directories(root: str | None = None) -> list[str]:
    """Remove this user's ipc directories whose owner process no longer exists; return them."""
    root = root or tempfile.gettempdir()
    removed = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if not name.startswith(PREFIX) or not os.path.isdir(path) or os.stat(path).st_uid != os.getuid():
            continue
        try:
            with open(os.path.join(path, OWNER_FILE)) as f:
                owner = int(f.read())
        except (OSError, ValueError):
            continue  # not ours, or still being created
        if not _alive(owner):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
