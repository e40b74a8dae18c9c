"""The rank driver: how the offline ``LLM`` runs the server's ranks and scheduler loop.

``RankProcesses`` starts the server's scheduler processes (``Backend`` without the tokenizers and
the detokenizer) and takes the detokenizer's place: it pushes messages to rank 0 and pulls rank 0's
outputs; with data-parallel replicas it is also the router (``Dispatch``). ``LocalRank`` runs the
only rank's loop in this process and steps it whenever output is wanted. Both take
``SchedulerInput``s and give back ``BatchTokenOutput``s (``receive`` waits for the next; a dead
rank is a RuntimeError), so the LLM never branches on the mode.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing.util
import signal
import sys
import threading
from collections.abc import Iterator

import msgspec
import torch
import zmq

from tpserve.engine_config import EngineConfig
from tpserve.launch.backend import Backend, ChildDied, describe_exit, with_first_error
from tpserve.message import BatchTokenOutput, SchedulerInput
from tpserve.message.transport import encode, open_socket
from tpserve.router.policy import Dispatch

POLL_MS = 500  # how often a wait for output checks that every rank is alive


def start_ranks(config: EngineConfig, load_balance_method: str = "cache_aware") -> RankDriver:
    if config.nnodes > 1:
        raise ValueError("the offline LLM runs on one node (nnodes 1); serve with tpserve --nnodes for more")
    if config.tp_size == 1 and config.dp_size == 1:
        return LocalRank(config)
    return RankProcesses(config, load_balance_method)


@contextlib.contextmanager
def _sigint_after_step() -> Iterator[list[int]]:
    """SIGINT during the block is noted (the list it yields becomes non-empty) and raised again once the block
    ends, to whatever handler was there; a second one raises KeyboardInterrupt at once (a step that never ends
    can still be left). Only the main thread receives signals, and an ignored SIGINT (or a handler not installed
    from Python, which could not be put back) is left alone."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous in (signal.SIG_IGN, None):
        yield []
        return
    received: list[int] = []

    def note(sig: int, frame: object) -> None:
        received.append(sig)
        if len(received) > 1:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, note)
    try:
        yield received
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            signal.raise_signal(signal.SIGINT)


class LocalRank:
    """tp 1: the rank's engine, scheduler and loop in this process."""

    def __init__(self, config: EngineConfig) -> None:
        from tpserve.engine.engine import Engine
        from tpserve.scheduler.io import LocalIO
        from tpserve.scheduler.process import SchedulerLoop
        from tpserve.scheduler.scheduler import Scheduler

        self.engine = Engine(config, rank=0)
        self.scheduler, self.io = Scheduler(self.engine), LocalIO()
        self.loop = SchedulerLoop(self.scheduler, self.io, config.debug_check_invariants)
        self._failed: str | None = None  # why a step stopped halfway (its requests and pages are lost)

    def send(self, msg: SchedulerInput) -> None:
        self.io.inbox.append(msg)

    def receive(self) -> BatchTokenOutput:
        """The next output, stepping the loop meanwhile. A Ctrl-C waits for the step it lands in to end (one
        interrupted halfway leaves the scheduler's requests and KV pages inconsistent); an exception out of a
        step leaves this rank failed."""
        if self._failed is not None:
            raise RuntimeError(f"the engine failed in a step ({self._failed}); create a new LLM")
        while True:  # a SIGINT handler that does not raise (one that sets a flag) lets the steps go on
            with _sigint_after_step() as interrupted:
                while not self.io.outbox and not interrupted:
                    try:
                        self.loop.run_once()
                    except BaseException as e:
                        self._failed = f"{type(e).__name__}: {e}"
                        raise
            if self.io.outbox:
                return self.io.outbox.popleft()

    def close(self) -> None:
        """Free the engine now (its GPU memory included)."""
        self.scheduler.close()
        self.engine.shutdown()
        del self.engine, self.scheduler, self.loop
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class RankProcesses:
    """tp > 1 or dp > 1: the server's scheduler processes; stopped on close, when garbage-collected
    or at exit (before multiprocessing joins its children), and by the kernel if this process dies."""

    def __init__(self, config: EngineConfig, load_balance_method: str = "cache_aware") -> None:
        self.backend = Backend(config, log_level="warning")
        self._ctx = zmq.Context()
        self._outputs = open_socket(self._ctx, zmq.PULL, self.backend.endpoints.detokenizer, bind=True)
        self._inputs = [self._push(address) for address in self.backend.endpoints.replica_schedulers]
        self.dispatch = Dispatch.for_replicas(config, load_balance_method)
        self._decoder = msgspec.msgpack.Decoder(BatchTokenOutput)
        self._finalizer = multiprocessing.util.Finalize(self, _stop, (self.backend, self._ctx), exitpriority=10)
        try:
            self.backend.start()
            self.backend.wait_ready()
        except BaseException as e:
            error = self._died() if isinstance(e, ChildDied) else e  # named before close stops the rest
            self.close()
            raise error from None

    def _push(self, address: str) -> zmq.Socket:
        socket = open_socket(self._ctx, zmq.PUSH, address, bind=False)
        socket.setsockopt(zmq.SNDHWM, 0)  # queue rather than block, even if rank 0 is gone
        return socket

    def send(self, msg: SchedulerInput) -> None:
        data = encode(msg)
        for replica in [0] if self.dispatch is None else self.dispatch.destinations(msg):
            self._inputs[replica].send(data)

    def receive(self) -> BatchTokenOutput:
        while not self._outputs.poll(POLL_MS):
            if self.backend.dead_child() is not None:
                raise self._died()
        batch = self._decoder.decode(self._outputs.recv())
        if self.dispatch is not None:
            for out in batch.outputs:
                self.dispatch.router.on_output(out.rid, len(out.token_ids), out.finish_reason is not None)
            if batch.stats is not None:
                self.dispatch.on_stats(batch.stats)
        return batch

    def _died(self) -> RuntimeError:
        engine = self.backend.engine
        procs = self.backend.procs
        dead = [(*divmod(i, engine.tp_size), p.exitcode) for i, p in enumerate(procs) if p.exitcode is not None]
        reason = self.backend.child_error()
        if reason is None and all(code == 1 for *_, code in dead):
            reason = _unguarded_script_hint()
        return RuntimeError(with_first_error("; ".join(
            f"tp rank {rank}{f' of replica {dp_rank}' if engine.dp_size > 1 else ''} died ({describe_exit(code)})"
            for dp_rank, rank, code in dead
        ), reason))

    def close(self) -> None:
        self._finalizer()


def _unguarded_script_hint() -> str | None:
    """Why a rank exits 1 without reporting an error: it failed before tpserve's code ran, most often in importing
    the user's script, which every spawned process does first and which, unguarded, starts tpserve again."""
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    if script is None:
        return None
    return (f"the rank failed while starting, before tpserve's code ran; each rank first imports {script}, so a "
            'script must create the LLM under `if __name__ == "__main__":`')


def _stop(backend: Backend, ctx: zmq.Context) -> None:
    backend.shutdown()
    ctx.destroy(linger=0)


RankDriver = LocalRank | RankProcesses
