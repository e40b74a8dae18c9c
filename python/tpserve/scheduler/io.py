"""The scheduler's message I/O. Only rank 0 talks to the tokenizers and the detokenizer (or the
offline LLM in their place); ``LocalIO`` is a lone rank's I/O inside the process that drives it.

Rank 0 drains its PULL socket, broadcasts the *count* of new messages over the Gloo CPU group,
then publishes the raw messages on a PUB socket; the other ranks read that many from their SUB
socket. So every rank applies the same messages in the same order at the same step.
"""

from __future__ import annotations

from collections import deque

import msgspec
import torch
import torch.distributed as dist
import zmq

from tpserve.message import BatchTokenOutput, SchedulerInput
from tpserve.message.endpoints import Endpoints
from tpserve.message.transport import encode, open_socket

IDLE_POLL_MS = 500  # an idle rank 0 still broadcasts (a zero count) this often, so peers never time out


class SchedulerIO:
    def __init__(self, rank: int, tp_size: int, endpoints: Endpoints, cpu_group: dist.ProcessGroup | None) -> None:
        self.rank, self.tp_size, self.cpu_group = rank, tp_size, cpu_group
        self.ctx = zmq.Context()
        self.decoder = msgspec.msgpack.Decoder(SchedulerInput)
        if rank == 0:
            self.pull = open_socket(self.ctx, zmq.PULL, endpoints.scheduler, bind=True)
            self.push = open_socket(self.ctx, zmq.PUSH, endpoints.detokenizer, bind=False)
            if tp_size > 1:
                self.pub = self.ctx.socket(zmq.XPUB)
                self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
                self.pub.setsockopt(zmq.SNDHWM, 0)
                self.pub.bind(endpoints.rank_broadcast)
        else:
            self.sub = self.ctx.socket(zmq.SUB)
            self.sub.setsockopt(zmq.RCVHWM, 0)
            self.sub.setsockopt(zmq.SUBSCRIBE, b"")
            self.sub.connect(endpoints.rank_broadcast)

    def wait_for_peers(self) -> None:
        """Rank 0 waits until every other rank has subscribed (nothing published is lost)."""
        if self.rank == 0 and self.tp_size > 1:
            for _ in range(self.tp_size - 1):
                self.pub.recv()  # a subscription message
        if self.cpu_group is not None:
            dist.barrier(group=self.cpu_group)

    def receive(self, blocking: bool, local: list[SchedulerInput] | None = None) -> list[SchedulerInput]:
        """The new messages, the same on every rank; ``local`` (rank 0's own, e.g. GrammarReady)
        go first. Other ranks ignore their ``local``."""
        own = [encode(msg) for msg in local or []] if self.rank == 0 else []
        if self.tp_size == 1:
            return [self.decoder.decode(raw) for raw in own + self._drain(blocking and not own)]
        count = torch.zeros(1, dtype=torch.int64)
        if self.rank == 0:
            raws = own + self._drain(blocking and not own)
            count[0] = len(raws)
            dist.broadcast(count, src=0, group=self.cpu_group)
            for raw in raws:
                self.pub.send(raw)
        else:
            dist.broadcast(count, src=0, group=self.cpu_group)
            raws = [self.sub.recv() for _ in range(int(count.item()))]
        return [self.decoder.decode(raw) for raw in raws]

    def _drain(self, blocking: bool) -> list[bytes]:
        raws: list[bytes] = []
        if blocking and self.pull.poll(IDLE_POLL_MS) == 0:
            return raws
        while True:
            try:
                raws.append(self.pull.recv(zmq.NOBLOCK))
            except zmq.Again:
                return raws

    def send(self, output: BatchTokenOutput) -> None:
        if self.rank == 0:
            self.push.send(encode(output))

    def close(self) -> None:
        self.ctx.destroy(linger=0)


class LocalIO:
    """The only rank's I/O inside the process that drives it: messages in and outputs out are queues."""

    rank, tp_size, cpu_group = 0, 1, None

    def __init__(self) -> None:
        self.inbox: list[SchedulerInput] = []
        self.outbox: deque[BatchTokenOutput] = deque()

    def receive(self, blocking: bool, local: list[SchedulerInput] | None = None) -> list[SchedulerInput]:
        msgs, self.inbox = (local or []) + self.inbox, []
        return msgs

    def send(self, output: BatchTokenOutput) -> None:
        self.outbox.append(output)
