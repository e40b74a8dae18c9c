"""A multi-node rank group: joining it, noticing a dead node, and stopping everyone when one is.

Rank 0's process holds the rendezvous store (a torch ``TCPStore`` on ``--dist-init-addr``). Every
rank joins it within ``dist_timeout`` seconds or the job stops naming the ranks that never came.
Then each rank's watchdog thread bumps a heartbeat counter in the store every ``HEARTBEAT_S`` and
reads everyone's: a rank whose counter stands still for ``dist_timeout`` is declared dead, as is
node 0 when the store stops answering. A failure seen by any rank (a dead peer, a collective that
broke or timed out) becomes the job's *verdict*, written once to the store; every watchdog polls
it and stops its process with that message, so a dead node stops every process within seconds,
each naming the node and rank that failed. Rank 0 (the store's host) stays until the live ranks
have read the verdict, or ``LINGER_S``.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn
from urllib.parse import urlsplit

import torch.distributed as dist

from tpserve.engine_config import EngineConfig

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.5
SUSPECT_S = 3.0  # after a failure: a rank whose heartbeat does not move this long is dead
LINGER_S = 5.0  # rank 0 waits this long at most for the others to read the verdict
STORE_GRACE_S = 2.0  # an unanswering store during a clean shut-down is not a failure
POLL_S = 0.1
EXIT_CODE = 1
# Start-up's collectives wait for the slowest node's JIT compiles and CUDA-graph captures; from
# the first served step on, every collective has the job's ``dist_timeout``.
STARTUP_COLLECTIVE_TIMEOUT_S = 1800.0

_JOINED, _BEAT, _VERDICT, _LEFT = "tpserve/joined/", "tpserve/beat/", "tpserve/verdict", "tpserve/left/"
_CLAIMED = "tpserve/claimed/"


class NodeFailure(RuntimeError):
    """The job cannot go on: a node or rank is missing, dead or unreachable."""


def split_addr(addr: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` or ``HOST:PORT`` -> (host, port)."""
    url = urlsplit(addr if "//" in addr else f"tcp://{addr}")
    try:
        port = url.port
    except ValueError:
        port = None
    if not url.hostname or port is None:
        raise ValueError(f"expected HOST:PORT, got {addr!r}")
    return url.hostname, port


@dataclass(frozen=True)
class NodeLayout:
    """Node n holds ranks n*R .. n*R+R-1 (R ranks a node); a rank's device on its node is its local rank."""

    nnodes: int
    ranks_per_node: int

    @classmethod
    def of(cls, config: EngineConfig) -> NodeLayout:
        return cls(config.nnodes, config.tp_size // config.nnodes)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def ranks_on(self, node: int) -> range:
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def name(self, rank: int) -> str:
        """``rank 3 (node 1)``: how logs and errors name a rank."""
        return f"rank {rank} (node {self.node_of(rank)})"

    def names(self, ranks: list[int]) -> str:
        return ", ".join(self.name(r) for r in ranks)


class NodeGroup:
    """This rank's membership of a multi-node job (one per rank process)."""

    def __init__(self, rank: int, layout: NodeLayout, host: str, port: int, timeout_s: float,
                 store: dist.TCPStore) -> None:
        self.rank, self.layout, self.host, self.port = rank, layout, host, port
        self.timeout_s = timeout_s
        self.store = store
        self.me = layout.name(rank)
        self._stopping = threading.Event()
        self._exit_lock = threading.Lock()

    # ---- joining ----
    @classmethod
    def join(cls, rank: int, config: EngineConfig) -> NodeGroup:
        """Reach node 0's store and wait until every rank has; NodeFailure names who is missing."""
        from tpserve.distributed.comm import rendezvous_store

        layout = NodeLayout.of(config)
        host, port = split_addr(config.dist_init_addr or "")
        me = layout.name(rank)
        try:
            store = rendezvous_store(config.dist_init_addr or "", rank, layout.world_size, config.dist_timeout,
                                     wait_for_workers=False)
        except (RuntimeError, OSError) as e:
            if rank == 0:
                raise NodeFailure(f"{me}: cannot listen on --dist-init-addr {host}:{port}: {e}") from None
            raise NodeFailure(
                f"{me}: could not reach node 0 (rank 0's rendezvous store) at {host}:{port} within "
                f"{config.dist_timeout:g} s: is node 0 running, and is --dist-init-addr its address?"
            ) from None
        if store.add(f"{_CLAIMED}{rank}", 1) > 1:  # the joined key below would just be overwritten
            raise NodeFailure(f"{me}: another process joined as {me} already: is --node-rank {layout.node_of(rank)} "
                              "given to two nodes?")
        group = cls(rank, layout, host, port, config.dist_timeout, store)
        store.add(f"{_BEAT}{rank}", 1)
        store.set(f"{_JOINED}{rank}", f"{socket.gethostname()} pid {os.getpid()}")
        try:
            missing = group._wait_all(_JOINED, config.dist_timeout)
        except (RuntimeError, OSError):  # torch's DistNetworkError: rank 0 gave up waiting (or died) and its store went
            raise NodeFailure(
                f"{me}: node 0's rendezvous store at {host}:{port} closed before every rank joined (rank 0 "
                "stopped: its log names the ranks that did not join)"
            ) from None
        if missing:
            raise NodeFailure(
                f"{me}: {layout.names(missing)} did not join within {config.dist_timeout:g} s "
                f"(is every node started with --nnodes {layout.nnodes}, its own --node-rank and the same "
                "--dist-init-addr?)"
            )
        threading.Thread(target=group._watch, name="node-watchdog", daemon=True).start()
        return group

    @property
    def startup_timeout_s(self) -> float:
        return max(self.timeout_s, STARTUP_COLLECTIVE_TIMEOUT_S)

    def start_serving(self, *groups: dist.ProcessGroup | None) -> None:
        """Every rank is ready: from now on a collective of ``groups`` (None: the default group)
        that waits longer than ``timeout_s`` fails, and the job stops (``fail``)."""
        timeout = timedelta(seconds=self.timeout_s)
        for group in dict.fromkeys(groups):
            dist.distributed_c10d._set_pg_timeout(timeout, group)  # torch's own setter, private in 2.x

    def barrier(self, name: str) -> None:
        """Wait until every rank got here; no deadline (the watchdog stops a job with a dead rank)."""
        self.store.set(f"tpserve/{name}/{self.rank}", "1")
        self._wait_all(f"tpserve/{name}/", None)

    def _wait_all(self, prefix: str, timeout_s: float | None) -> list[int]:
        """The ranks whose ``prefix + rank`` key is missing when ``timeout_s`` ran out ([] once all are)."""
        keys = [f"{prefix}{r}" for r in range(self.layout.world_size)]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.store.check(keys):
            if deadline is not None and time.monotonic() > deadline:
                return [r for r, key in enumerate(keys) if not self.store.check([key])]
            time.sleep(POLL_S)
        return []

    # ---- failures ----
    def fail(self, error: BaseException) -> NoReturn:
        """This rank cannot go on (``error``): settle the job's verdict, tell everyone, exit."""
        try:
            verdict = self._read_verdict() or self._diagnose(error)
            self.store.compare_set(_VERDICT, "", verdict)
            verdict = self._read_verdict() or verdict
        except Exception:  # noqa: BLE001 - the store went away: node 0 is gone
            verdict = self._store_lost()
        self._exit(f"{self.me} stopping: {verdict} [here: {type(error).__name__}: {error}]")

    def _diagnose(self, error: BaseException) -> str:
        """Which ranks are dead: those whose heartbeat does not move for SUSPECT_S."""
        keys = self._beat_keys()
        before = self.store.multi_get(keys)
        time.sleep(SUSPECT_S)
        after = self.store.multi_get(keys)
        dead = [r for r, b, a in zip(self._peers(), before, after) if a == b]
        if dead:
            return f"{self.layout.names(dead)} {'is' if len(dead) == 1 else 'are'} dead or unreachable " \
                   f"(no heartbeat for {SUSPECT_S:g} s)"
        return f"{self.me} failed ({type(error).__name__}: {error})"

    def _read_verdict(self) -> str | None:
        if not self.store.check([_VERDICT]):
            return None
        return self.store.get(_VERDICT).decode() or None

    def _store_lost(self) -> str:
        return (f"node 0 (rank 0, which holds the rendezvous store at {self.host}:{self.port}) is dead or "
                "unreachable")

    def _exit(self, message: str) -> NoReturn:
        with self._exit_lock:  # the watchdog and the main thread may both get here
            logger.error("%s", message)
            try:
                self.store.set(f"{_LEFT}{self.rank}", "1")
                if self.rank == 0:  # the store lives here: let the others read the verdict first
                    left = [f"{_LEFT}{r}" for r in self._peers()]
                    deadline = time.monotonic() + LINGER_S  # the dead never leave
                    while not self.store.check(left) and time.monotonic() < deadline:
                        time.sleep(POLL_S)
            except Exception:  # noqa: BLE001
                pass
            logging.shutdown()
            sys.stderr.flush()
            os._exit(EXIT_CODE)

    # ---- the watchdog ----
    def _peers(self) -> list[int]:
        return [r for r in range(self.layout.world_size) if r != self.rank]

    def _beat_keys(self) -> list[str]:
        return [f"{_BEAT}{r}" for r in self._peers()]

    def _watch(self) -> None:
        try:
            client = dist.TCPStore(self.host, self.port, None, False, timeout=timedelta(seconds=self.timeout_s),
                                   wait_for_workers=False)
        except Exception:  # noqa: BLE001
            self._lost_store()
            return
        keys = self._beat_keys()
        last: list[bytes | None] = [None] * len(keys)
        moved = [time.monotonic()] * len(keys)
        while not self._stopping.wait(HEARTBEAT_S):
            try:
                client.add(f"{_BEAT}{self.rank}", 1)
                verdict = client.get(_VERDICT).decode() if client.check([_VERDICT]) else ""
                values = client.multi_get(keys)
            except Exception:  # noqa: BLE001
                self._lost_store()
                return
            if self._stopping.is_set():
                return
            if verdict:
                self._exit(f"{self.me} stopping: {verdict}")
            now = time.monotonic()
            for i, value in enumerate(values):
                if value != last[i]:
                    last[i], moved[i] = value, now
            dead = [r for r, t in zip(self._peers(), moved) if now - t > self.timeout_s]
            if dead:
                verdict = (f"{self.layout.names(dead)} sent no heartbeat for {self.timeout_s:g} s: "
                           f"{'it is' if len(dead) == 1 else 'they are'} dead or unreachable")
                try:
                    client.compare_set(_VERDICT, "", verdict)
                except Exception:  # noqa: BLE001
                    pass
                self._exit(f"{self.me} stopping: {verdict}")

    def _lost_store(self) -> None:
        if self._stopping.wait(STORE_GRACE_S):
            return  # a clean shut-down: rank 0 went first
        self._exit(f"{self.me} stopping: {self._store_lost()}")

    def stop(self) -> None:
        """A clean shut-down: the watchdog ends (no verdict)."""
        self._stopping.set()
