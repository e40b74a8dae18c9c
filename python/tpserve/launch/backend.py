"""Starting and stopping the backend processes of one server, or of the offline LLM's ranks.

One scheduler per TP rank of each data-parallel replica (every replica its own TP group, with
its own rendezvous, ipc sockets and GPUs), one detokenizer, N tokenizer workers, all spawned.
Each replica's rank 0, the detokenizer and each tokenizer put an acknowledgement on a queue when
ready. The API server (or the shell, or the offline LLM, which runs only the ranks) runs in the
parent process; a node other than node 0 of a multi-node job runs only its ranks (``run_headless``).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import shutil
import signal
import threading
import time
from dataclasses import replace
from typing import Any

import zmq

from tpserve.engine_config import EngineConfig
from tpserve.distributed.comm import local_init_addr
from tpserve.distributed.nodes import NodeLayout
from tpserve.launch.args import DEFAULT_SCHEDULER_ENTRY, ServerArgs
from tpserve.launch.child import child_main, started_with_signals_blocked
from tpserve.message import Shutdown
from tpserve.message.endpoints import Endpoints
from tpserve.message.transport import encode, open_socket
from tpserve.tokenizer.prepare import PromptLimits
from tpserve.tokenizer.worker import TokenizerConfig

logger = logging.getLogger(__name__)

DETOKENIZER_ENTRY = "tpserve.tokenizer.detokenizer:run_detokenizer"
TOKENIZER_ENTRY = "tpserve.tokenizer.worker:run_tokenizer"
GRACEFUL_STOP_S = 5.0  # after Shutdown, before SIGTERM
TERMINATE_STOP_S = 2.0  # after SIGTERM, before SIGKILL
WATCH_INTERVAL_S = 0.5


class ChildDied(Exception):
    def __init__(self, name: str, exitcode: int | None, others: tuple[str, ...] = (), reason: str | None = None) -> None:
        also = f"; also stopped: {', '.join(others)}" if others else ""
        super().__init__(with_first_error(f"{name} exited ({describe_exit(exitcode)}){also}", reason))
        self.name = name
        self.exitcode = exitcode
        self.reason = reason


def with_first_error(text: str, reason: str | None) -> str:
    """``text`` about stopped children, with the first exception one of them reported, if any."""
    return f"{text} (the first error: {reason})" if reason else text


def first_failure(procs: list[Any], reason: str | None = None) -> ChildDied | None:
    """The stopped child to blame, if any: one killed by a signal before one that exited by itself
    (when a TP rank is killed, its peers' next collective fails and they exit with an error within
    milliseconds, before the watchdog looks, and rank 0 comes first in the list); the message also
    names the other stopped children."""
    dead = [p for p in procs if p.exitcode is not None]
    if not dead:
        return None
    first = next((p for p in dead if p.exitcode < 0), dead[0])
    others = tuple(f"{p.name} ({describe_exit(p.exitcode)})" for p in dead if p is not first)
    return ChildDied(first.name, first.exitcode, others, reason)


class StartupCancelled(Exception):
    pass


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # each stops the service cleanly (SIGHUP: its terminal closed)


def ignore_stop_signals() -> None:
    """Before the clean-up: a second stop signal must not cut it short."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def _init_addrs(engine: EngineConfig) -> list[str | None]:
    """Each replica's torch.distributed rendezvous (distinct ports); None where tp 1 needs none."""
    if engine.tp_size == 1:
        return [None] * engine.dp_size
    if engine.dist_init_addr is not None and engine.dp_size == 1:
        return [engine.dist_init_addr]
    addrs: list[str] = []
    while len(addrs) < engine.dp_size:
        addr = local_init_addr()
        if addr not in addrs:
            addrs.append(addr)
    return addrs


class Backend:
    """The child processes of one server (without ``server``: only the ranks) and their ipc dir.

    Across nodes it runs this node's ranks (``engine.node_rank``); node 0's also has the server's
    other processes, the other nodes' only their ranks (headless).
    """

    def __init__(self, engine: EngineConfig, log_level: str, server: ServerArgs | None = None) -> None:
        self.engine, self.log_level, self.server = engine, log_level, server
        self.ranks = NodeLayout.of(engine).ranks_on(engine.node_rank)
        self.endpoints = Endpoints.create(engine.dp_size)
        self._mp = multiprocessing.get_context("spawn")
        self._ack_queue = self._mp.Queue()
        self._errors = self._mp.SimpleQueue()  # a child's exception, in one line (child_main), first come first
        self.first_error: str | None = None
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self._acks_expected = engine.dp_size + (0 if server is None else 1 + server.num_tokenizers)
        # Each scheduler rank, tokenizer and the detokenizer writes time.monotonic() here at every loop
        # iteration (a liveness signal that needs no message: a stopped or stuck process simply stops
        # writing), keyed by what /health calls it. Zero until the process's loop starts.
        self.heartbeats: dict[str, Any] = {}
        self.replica_heartbeats: dict[int, list[Any]] = {}  # data-parallel replica -> its scheduler ranks' here
        self._specs = self._children()
        self._stopping = False
        self._ready = False

    # ---- start-up ----
    def _children(self) -> list[tuple[str, str, tuple]]:
        """(name, "module:function" entry, its arguments) of every child."""
        args, ep, engine = self.server, self.endpoints, self.engine
        entry = DEFAULT_SCHEDULER_ENTRY if args is None else args.scheduler_entry
        children = []
        for dp_rank, init_addr in enumerate(_init_addrs(engine)):
            replica = replace(engine, dp_rank=dp_rank, dist_init_addr=init_addr)
            prefix = "scheduler" if engine.dp_size == 1 else f"scheduler-dp{dp_rank}"
            where = f" of replica {dp_rank}" if engine.dp_size > 1 else ""
            beats = self.replica_heartbeats[dp_rank] = [self._heartbeat(f"scheduler rank {rank}{where}")
                                                        for rank in self.ranks]
            children += [(f"{prefix}-tp{rank}", entry, (replica, rank, ep.for_replica(dp_rank), self._ack_queue, beat))
                         for rank, beat in zip(self.ranks, beats)]
        if args is None:
            return children
        children.append(("detokenizer", DETOKENIZER_ENTRY,
                         (args.model_dir, ep, self._ack_queue, self._heartbeat("the detokenizer"))))
        limits = PromptLimits(args.context_len, args.vocab_size)
        tok_config = TokenizerConfig(args.model_dir, limits, args.chat_template, args.default_chat_template_kwargs)
        children += [
            (f"tokenizer-{i}", TOKENIZER_ENTRY, (tok_config, ep, self._ack_queue, i, self._heartbeat(f"tokenizer {i}")))
            for i in range(args.num_tokenizers)
        ]
        return children

    def _heartbeat(self, name: str) -> Any:
        self.heartbeats[name] = self._mp.Value("d", 0.0, lock=False)
        return self.heartbeats[name]

    def start(self) -> None:
        """Spawn every child (returns at once; see ``wait_ready``)."""
        log_file = self.server and self.server.log_file
        for name, entry, args in self._specs:
            proc = self._mp.Process(target=child_main,
                                    args=(entry, args, os.getpid(), self.log_level, log_file, self._errors,
                                          threading.current_thread() is threading.main_thread()),
                                    name=f"tpserve-{name}", daemon=False)
            with started_with_signals_blocked():
                proc.start()
            self.procs.append(proc)
        logger.info(
            "started %s; ipc directory %s",
            ", ".join(f"{p.name} (pid {p.pid})" for p in self.procs),
            self.endpoints.directory,
        )

    def wait_ready(self, cancel: threading.Event | None = None, poll_s: float = 0.2) -> None:
        """Block until every acknowledgement came. Raises ChildDied or StartupCancelled."""
        received = 0
        while received < self._acks_expected:
            try:
                ack = self._ack_queue.get(timeout=poll_s)
            except queue.Empty:
                dead = self.dead_child()
                if dead is not None:
                    raise dead from None
                if cancel is not None and cancel.is_set():
                    raise StartupCancelled("start-up cancelled") from None
                continue
            received += 1
            logger.info("%s (%d/%d)", ack, received, self._acks_expected)
        self._ready = True

    # ---- while serving ----
    def dead_child(self) -> ChildDied | None:
        """The child that stopped (the one to blame when several did), if any, with the first exception a child
        raised (the root cause: the peers of a failed rank fail after it)."""
        if all(p.exitcode is None for p in self.procs):
            return None
        return first_failure(self.procs, self.child_error())

    def child_error(self) -> str | None:
        """The first exception any child reported (``child_main``), once one did."""
        if self.first_error is None and not self._errors.empty():
            self.first_error = self._errors.get()
        return self.first_error

    def stalled(self, timeout: float) -> str | None:
        """Why the backend is not live, if a process's loop (a rank's, a tokenizer's, the detokenizer's)
        has not come round for ``timeout`` s: the one stalled longest (a stopped rank stalls the others
        in their next collective soon after)."""
        now = time.monotonic()
        beats = [(beat.value, name) for name, beat in self.heartbeats.items() if beat.value]
        if not beats:
            return None
        oldest, name = min(beats)
        return f"{name} has made no progress for {now - oldest:.1f} s" if now - oldest > timeout else None

    def stalled_replicas(self, timeout: float) -> set[int]:
        """The data-parallel replicas a scheduler rank of which (on this node) has not come round its loop for
        ``timeout`` s: the router sends them no new requests meanwhile."""
        now = time.monotonic()
        return {replica for replica, beats in self.replica_heartbeats.items()
                if any(beat.value and now - beat.value > timeout for beat in beats)}

    # ---- shut-down ----
    def shutdown(self) -> None:
        """Stop every child (Shutdown message, then SIGTERM, then SIGKILL); remove the ipc dir."""
        if self._stopping:
            return
        self._stopping = True
        try:
            self._stop_children()
        finally:
            shutil.rmtree(self.endpoints.directory, ignore_errors=True)
            self._ack_queue.close()
            self._ack_queue.cancel_join_thread()

    def _stop_children(self) -> None:
        alive = [p for p in self.procs if p.exitcode is None]
        if not alive:
            return
        # before start-up ends, children may not listen yet, and only rank 0 takes a Shutdown
        # message (another node's ranks get it from rank 0): SIGTERM at once
        if self._ready and self.ranks.start == 0:
            self._send_shutdown()
            for proc in alive:
                if proc.name.startswith("tpserve-tokenizer"):
                    proc.terminate()  # stateless: no need to wait for a Shutdown message
            deadline = time.monotonic() + GRACEFUL_STOP_S
            for proc in alive:
                proc.join(max(0.0, deadline - time.monotonic()))
        for method, sig_name, wait_s in (("terminate", "SIGTERM", TERMINATE_STOP_S), ("kill", "SIGKILL", 1.0)):
            alive = [p for p in alive if p.exitcode is None]
            if not alive:
                break
            for proc in alive:
                if self._ready or method == "kill":
                    logger.warning("%s did not stop: sending %s", proc.name, sig_name)
                getattr(proc, method)()
            deadline = time.monotonic() + wait_s
            for proc in alive:
                proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.exitcode is None:  # pragma: no cover - SIGKILL failed
                logger.error("%s (pid %s) is still running", proc.name, proc.pid)

    def _send_shutdown(self) -> None:
        ctx = zmq.Context()
        ep = self.endpoints
        addresses = list(ep.replica_schedulers) + ([ep.detokenizer] if self.server is not None else [])
        try:
            for address in addresses:
                sock = open_socket(ctx, zmq.PUSH, address, bind=False)
                sock.setsockopt(zmq.SNDTIMEO, 200)
                sock.setsockopt(zmq.LINGER, 500)  # deliver before the socket closes
                try:
                    sock.send(encode(Shutdown()))
                except zmq.ZMQError:
                    pass  # the receiver is gone: SIGTERM follows anyway
        finally:
            ctx.destroy(linger=500)


def run_headless(args: ServerArgs) -> int:
    """A node other than node 0 of a multi-node job: its ranks only, no HTTP, no tokenizers.

    Its ranks take their messages from rank 0 (on node 0) and stop when it says so: then this
    process exits 0. A rank that dies or a node that fails (the ranks name it) ends it with 1,
    a signal with 0.
    """
    engine = args.engine
    me = f"node {engine.node_rank}"
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        logger.info("%s: received %s: stopping its ranks", me, signal.Signals(signum).name)
        stop.set()

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)
    backend = Backend(engine, args.log_level)
    logger.info("%s of %d: ranks %d-%d joining node 0 at %s (no HTTP server on this node)",
                me, engine.nnodes, backend.ranks.start, backend.ranks.stop - 1, engine.dist_init_addr)
    try:
        backend.start()
        backend.wait_ready(stop)
        logger.info("%s: ready", me)
        while not stop.wait(WATCH_INTERVAL_S):
            codes = [p.exitcode for p in backend.procs]
            failed = first_failure([p for p in backend.procs if p.exitcode not in (None, 0)])
            if failed is not None:
                logger.error("%s: %s: stopping this node", me, failed)
                return 1
            if all(code == 0 for code in codes):
                logger.info("%s: node 0 ended the job", me)
                return 0
        return 0
    except StartupCancelled:
        return 0
    except ChildDied as e:
        logger.error("%s: start-up failed: %s", me, e)
        return 1
    finally:
        ignore_stop_signals()
        backend.shutdown()
