"""Two nodes of one multi-node job simulated as two ``tpserve`` launches on this host."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import httpx
from server_process import ServerProcess

from tpserve.distributed.comm import free_port
from tpserve.distributed.control import TOKEN_ENV

TOKEN = "multinode-test-token-0123456789"


class TwoNodes:
    """Node 0 (HTTP server) and node 1 (headless) of one job, each a ``tpserve`` launch."""

    def __init__(self, model: str, tp: int, extra: list[str] | None = None, nodes: tuple[int, ...] = (0, 1),
                 device: str = "cpu", node_env: dict[int, dict[str, str]] | None = None) -> None:
        self.port = free_port()
        common = ["--model", model, "--device", device, "--tp-size", str(tp), "--nnodes", "2",
                  "--dist-init-addr", f"127.0.0.1:{self.port}", *(extra or [])]
        self.nodes = {
            rank: ServerProcess([*common, "--node-rank", str(rank)],
                                env={TOKEN_ENV: TOKEN, **(node_env or {}).get(rank, {})})
            for rank in nodes
        }

    def __getitem__(self, rank: int) -> ServerProcess:
        return self.nodes[rank]

    def wait_exits(self, timeout: float) -> dict[int, int | None]:
        deadline = time.monotonic() + timeout
        for node in self.nodes.values():
            with contextlib.suppress(Exception):
                node.proc.wait(max(0.1, deadline - time.monotonic()))
        return {rank: node.proc.poll() for rank, node in self.nodes.items()}

    def kill_all(self) -> None:
        for node in self.nodes.values():
            if node.proc.poll() is None or node.descendants():
                node.kill_all()


@contextlib.contextmanager
def two_nodes(model: str, tp: int, **kwargs) -> Iterator[TwoNodes]:
    job = TwoNodes(model, tp, **kwargs)
    try:
        yield job
    finally:
        job.kill_all()


def greedy(url: str, prompt: list[int], max_tokens: int) -> str:
    """Greedy completion text of a token-id prompt (served model name: m)."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]
