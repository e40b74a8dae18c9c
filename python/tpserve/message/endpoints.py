"""ZMQ socket addresses of one server instance: ipc:// paths in a private temporary directory."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass


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
        directory = tempfile.mkdtemp(prefix="tpserve-")
        os.chmod(directory, 0o700)

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
