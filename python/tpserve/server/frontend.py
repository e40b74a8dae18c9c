"""The API server's link to the backend: send requests, route their outputs, abort.

One asyncio task reads every message from the backend (``run``) and puts each on the queue of
the HTTP request that owns its rid. An HTTP request may own several rids (one per prompt) that
share one queue.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass
from typing import Callable, Union

import msgspec
import zmq
import zmq.asyncio

from tpserve.message import AbortRequest, FlushCache, SchedulerStats
from tpserve.message.endpoints import Endpoints
from tpserve.message.frontend import ApiInput, ApiOutputBatch, RequestOutput, RequestRejected, TokenizeRequest
from tpserve.message.transport import encode, open_socket


@dataclass(frozen=True)
class RequestCancelled:
    """Not from the backend: the server ends the request itself (it is shutting down)."""

    rid: int
    message: str


BackendEvent = Union[RequestOutput, RequestRejected, RequestCancelled]
ABORT_MEMORY_S = 300.0  # how long an aborted rid's late outputs still trigger a repeat abort


class FrontendClient:
    def __init__(
        self,
        endpoints: Endpoints,
        on_stats: Callable[[SchedulerStats], None] | None = None,
        on_aborted_finish: Callable[[str], None] | None = None,
    ) -> None:
        """``on_aborted_finish(finish_reason)`` reports how the scheduler ended an aborted
        request: "abort" once the abort took effect (its KV pages are free)."""
        self._ctx = zmq.asyncio.Context()
        self._to_tokenizer = self._socket(zmq.PUSH, endpoints.tokenizer, bind=True)
        self._from_backend = self._socket(zmq.PULL, endpoints.api, bind=True)
        self._to_scheduler = self._socket(zmq.PUSH, endpoints.scheduler, bind=False)
        self._decoder = msgspec.msgpack.Decoder(ApiInput)
        self._rids = itertools.count(1)
        self._queues: dict[int, asyncio.Queue[BackendEvent]] = {}
        self._aborted: dict[int, float] = {}  # rid -> when; until the scheduler confirms
        self._on_stats = on_stats
        self._on_aborted_finish = on_aborted_finish

    def _socket(self, kind: int, address: str, bind: bool) -> zmq.asyncio.Socket:
        return open_socket(self._ctx, kind, address, bind)

    def new_rid(self) -> int:
        return next(self._rids)

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    async def submit(self, requests: list[TokenizeRequest], queue: asyncio.Queue[BackendEvent]) -> None:
        """Send requests; their outputs and rejections will arrive on ``queue``."""
        for req in requests:
            self._queues[req.rid] = queue
        for req in requests:
            await self._to_tokenizer.send(encode(req))

    def release(self, rid: int) -> None:
        """The caller is done with ``rid`` (it finished, or was aborted)."""
        self._queues.pop(rid, None)

    async def abort(self, rid: int) -> None:
        """Stop generating ``rid`` and free its KV pages. Repeated if the scheduler had not
        received the request yet (its outputs then still arrive, see ``_dispatch``)."""
        self.release(rid)
        self._aborted[rid] = time.monotonic()
        await self._to_scheduler.send(encode(AbortRequest(rid=rid)))

    async def flush_cache(self) -> None:
        await self._to_scheduler.send(encode(FlushCache()))

    async def run(self) -> None:
        """Route backend messages forever (cancel the task to stop)."""
        while True:
            msg = self._decoder.decode(await self._from_backend.recv())
            if isinstance(msg, RequestRejected):
                self._route(msg.rid, msg, finished=True)
                continue
            await self._dispatch(msg)

    async def _dispatch(self, batch: ApiOutputBatch) -> None:
        if batch.stats is not None and self._on_stats is not None:
            self._on_stats(batch.stats)
        for out in batch.outputs:
            finished = out.finish_reason is not None
            if self._route(out.rid, out, finished):
                continue
            if out.rid in self._aborted:
                if finished:
                    del self._aborted[out.rid]
                    if self._on_aborted_finish is not None:
                        self._on_aborted_finish(out.finish_reason)
                else:  # the first abort overtook the request: say it again
                    await self._to_scheduler.send(encode(AbortRequest(rid=out.rid)))
        self._forget_old_aborts()

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
