"""ZMQ socket addresses of one server instance: ipc:// paths in a private temporary directory.

The server removes its directory when it stops. A server killed with SIGKILL cannot, so each
directory records its owner's pid, and the next server to start removes the directories of
owners that are gone.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, replace

PREFIX = "tpserve-"
OWNER_FILE = "owner.pid"


@dataclass(frozen=True)
class Endpoints:
    tokenizer: str  # API server PUSH (binds) -> tokenizer workers PULL (connect)
    # tokenizers / detokenizer / API server PUSH (connect) -> rank 0 PULL (binds); with data
    # parallelism, the API server's router PULL (binds), which forwards to a replica's rank 0
    scheduler: str
    rank_broadcast: str  # rank 0 PUB (binds) -> ranks 1.. SUB (connect)
    detokenizer: str  # every replica's rank 0 PUSH (connects) -> detokenizer PULL (binds)
    api: str  # detokenizer and tokenizers PUSH (connect) -> API server PULL (binds)
    directory: str
    # each replica's rank 0 PULL and rank broadcast; one replica: (scheduler,), (rank_broadcast,)
    replica_schedulers: tuple[str, ...] = ()
    replica_broadcasts: tuple[str, ...] = ()

    @classmethod
    def create(cls, dp_size: int = 1) -> Endpoints:
        remove_stale_directories()
        directory = tempfile.mkdtemp(prefix=PREFIX)
        os.chmod(directory, 0o700)
        with open(os.path.join(directory, OWNER_FILE), "w") as f:
            f.write(str(os.getpid()))

        def path(name: str) -> str:
            return f"ipc://{os.path.join(directory, name)}"

        schedulers = tuple(path(f"scheduler-dp{d}") for d in range(dp_size))
        broadcasts = tuple(path(f"rank-broadcast-dp{d}") for d in range(dp_size))
        return cls(
            tokenizer=path("tokenizer"),
            scheduler=schedulers[0] if dp_size == 1 else path("router"),
            rank_broadcast=broadcasts[0],
            detokenizer=path("detokenizer"),
            api=path("api"),
            directory=directory,
            replica_schedulers=schedulers,
            replica_broadcasts=broadcasts,
        )

    @property
    def dp_size(self) -> int:
        return len(self.replica_schedulers)

    def for_replica(self, dp_rank: int) -> Endpoints:
        """The addresses replica ``dp_rank``'s ranks use: its own rank 0 and broadcast."""
        return replace(
            self, scheduler=self.replica_schedulers[dp_rank], rank_broadcast=self.replica_broadcasts[dp_rank]
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
