"""The link to the backend: send requests, route their outputs, abort.

Every message from the backend goes on the queue of the request that owns its rid. An HTTP
request may own several rids (one per prompt) that share one queue. The API server reads the
backend from an asyncio task (``FrontendClient``); the shell blocks on it (``ShellClient``).
With data-parallel replicas, ``ReplicaRouter`` forwards the schedulers' messages to them.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass
from typing import Callable, Protocol, Union

import msgspec
import zmq
import zmq.asyncio

from tpserve.message import AbortRequest, FlushCache, LoadLoRA, LoRAAnswer, SchedulerStats, UnloadLoRA
from tpserve.message.endpoints import Endpoints
from tpserve.message.frontend import ApiInput, ApiOutput, RequestRejected, TokenizeRequest
from tpserve.message.transport import encode, open_socket
from tpserve.router.policy import Dispatch


@dataclass(frozen=True)
class RequestCancelled:
    """Not from the backend: the server ends the request itself (it is shutting down)."""

    rid: int
    message: str


BackendEvent = Union[ApiOutput, RequestRejected, RequestCancelled, LoRAAnswer]
ABORT_MEMORY_S = 300.0  # how long an aborted rid's late outputs still trigger a repeat abort


class EventQueue(Protocol):  # asyncio.Queue or queue.SimpleQueue
    def put_nowait(self, item: BackendEvent) -> None: ...


class BackendLink:
    """The sockets to the backend, the routing of its outputs to the queue of the request that
    owns each rid, and the memory of aborted rids. Subclasses add sending (blocking or async)."""

    context_type: type[zmq.Context] = zmq.Context

    def __init__(
        self,
        endpoints: Endpoints,
        on_stats: Callable[[SchedulerStats], None] | None = None,
        on_aborted_finish: Callable[[str], None] | None = None,
        dispatch: Dispatch | None = None,
    ) -> None:
        """``on_aborted_finish(finish_reason)`` reports how the scheduler ended an aborted
        request: "abort" once the abort took effect (its KV pages are free). ``dispatch``
        (data-parallel replicas) sees every output and stats, to keep the router's loads."""
        self._ctx = ctx = self.context_type()
        self._to_tokenizer = open_socket(ctx, zmq.PUSH, endpoints.tokenizer, bind=True)
        self._from_backend = open_socket(ctx, zmq.PULL, endpoints.api, bind=True)
        self._to_scheduler = open_socket(ctx, zmq.PUSH, endpoints.scheduler, bind=False)
        self._decoder = msgspec.msgpack.Decoder(ApiInput)
        self._rids = itertools.count(1)
        self._queues: dict[int, EventQueue] = {}
        self._aborted: dict[int, float] = {}  # rid -> when; until the scheduler confirms
        self._on_stats = on_stats
        self._on_aborted_finish = on_aborted_finish
        self._dispatch = dispatch

    def new_rid(self) -> int:
        return next(self._rids)

    def release(self, rid: int) -> None:
        """The caller is done with ``rid`` (it finished, or was aborted)."""
        self._queues.pop(rid, None)

    def _watch(self, requests: list[TokenizeRequest], queue: EventQueue) -> list[bytes]:
        """Route the requests' events to ``queue``; returns the messages to send. Every request
        is encoded before any is watched, so one that cannot be leaves nothing half-sent."""
        messages = [encode(req) for req in requests]
        for req in requests:
            for rid in req.choice_rids:
                self._queues[rid] = queue
        return messages

    def _aborting(self, rid: int) -> bytes:
        """Forget ``rid`` and remember its abort; returns the message to send. Repeated if the
        scheduler had not received the request yet (its outputs then still arrive)."""
        self.release(rid)
        self._aborted[rid] = time.monotonic()
        return encode(AbortRequest(rid=rid))

    def _route_message(self, data: bytes) -> list[bytes]:
        """Put a backend message's events on their queues; returns the aborts to send again."""
        msg = self._decoder.decode(data)
        if isinstance(msg, RequestRejected):
            self._route(msg.rid, msg, finished=True)
            return []
        if msg.lora is not None:  # each replica answers: the caller releases the rid once it has them all
            self._route(msg.lora.rid, msg.lora, finished=False)
        if msg.stats is not None:
            if self._on_stats is not None:
                self._on_stats(msg.stats)
            if self._dispatch is not None:
                self._dispatch.on_stats(msg.stats)
        again = []
        for out in msg.outputs:
            finished = out.finish_reason is not None
            if self._dispatch is not None:
                self._dispatch.router.on_output(out.rid, out.new_tokens, finished)
            if self._route(out.rid, out, finished):
                continue
            if out.rid in self._aborted:
                if finished:
                    del self._aborted[out.rid]
                    if self._on_aborted_finish is not None:
                        self._on_aborted_finish(out.finish_reason)
                else:  # the first abort overtook the request: say it again
                    again.append(encode(AbortRequest(rid=out.rid)))
        self._forget_old_aborts()
        return again

    def _route(self, rid: int, event: BackendEvent, finished: bool) -> bool:
        queue = self._queues.get(rid)
        if queue is None:
            return False
        if finished:
            del self._queues[rid]
        queue.put_nowait(event)
        return True

    def _forget_old_aborts(self) -> None:
        if not self._aborted:
            return
        horizon = time.monotonic() - ABORT_MEMORY_S
        for rid in [r for r, t in self._aborted.items() if t < horizon]:
            del self._aborted[rid]

    def cancel_all(self, message: str) -> None:
        """End every request in flight with a RequestCancelled event (e.g. at shut-down)."""
        for rid, queue in list(self._queues.items()):
            queue.put_nowait(RequestCancelled(rid, message))
        self._queues.clear()

    def close(self) -> None:
        self._ctx.destroy(linger=0)


class FrontendClient(BackendLink):
    """The API server's link: one asyncio task (``run``) reads every backend message."""

    context_type = zmq.asyncio.Context

    async def submit(self, requests: list[TokenizeRequest], queue: asyncio.Queue[BackendEvent]) -> None:
        """Send requests; their outputs and rejections will arrive on ``queue``."""
        for data in self._watch(requests, queue):
            await self._to_tokenizer.send(data)

    async def abort(self, rid: int) -> None:
        """Stop generating ``rid`` and free its KV pages."""
        await self._to_scheduler.send(self._aborting(rid))

    async def flush_cache(self) -> None:
        """Every replica's (with data parallelism the router sends it to each)."""
        await self._to_scheduler.send(encode(FlushCache()))

    async def update_lora(self, update: LoadLoRA | UnloadLoRA, replicas: int, timeout: float) -> list[BackendEvent]:
        """Send a LoRA load or unload (``update.rid`` from ``new_rid``) to every replica; their ``LoRAAnswer``s
        (ending early with a RequestCancelled at shut-down), or a TimeoutError after ``timeout`` seconds."""
        queue: asyncio.Queue[BackendEvent] = asyncio.Queue()
        self._queues[update.rid] = queue
        events: list[BackendEvent] = []
        try:
            await self._to_scheduler.send(encode(update))
            async with asyncio.timeout(timeout):
                while len(events) < replicas and (not events or isinstance(events[-1], LoRAAnswer)):
                    events.append(await queue.get())
            return events
        finally:
            self.release(update.rid)

    async def run(self) -> None:
        """Route backend messages forever (cancel the task to stop)."""
        while True:
            for data in self._route_message(await self._from_backend.recv()):
                await self._to_scheduler.send(data)


class ReplicaRouter:
    """With more than one replica, every message for the schedulers (new requests from the
    tokenizers, aborts from the detokenizer and the API server, cache flushes) comes to the
    router's socket; one asyncio task forwards each, unchanged, to the replicas ``Dispatch`` names."""

    def __init__(self, endpoints: Endpoints, dispatch: Dispatch) -> None:
        self.dispatch = dispatch
        self._ctx = zmq.asyncio.Context()
        self._inbox = open_socket(self._ctx, zmq.PULL, endpoints.scheduler, bind=True)
        self._replicas = [open_socket(self._ctx, zmq.PUSH, a, bind=False) for a in endpoints.replica_schedulers]

    async def run(self) -> None:
        """Forward messages forever (cancel the task to stop)."""
        while True:
            data = await self._inbox.recv()
            for replica in self.dispatch.destinations_of(data):
                await self._replicas[replica].send(data)

    def close(self) -> None:
        self._ctx.destroy(linger=0)
