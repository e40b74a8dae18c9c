"""The scheduler's message I/O. Only rank 0 talks to the tokenizers and the detokenizer (or the
offline LLM); ``LocalIO`` is a lone rank's I/O inside the process that drives it.

Rank 0 drains its PULL socket, broadcasts the *count* of new messages over the Gloo CPU group, then
publishes them on a PUB socket; the other ranks read that many from their SUB socket, so every rank
applies the same messages at the same step. On one node the broadcast is an ipc socket in the
server's private directory; across nodes it is TCP on the ``--dist-init-addr`` interface (port
published in the rendezvous store), CURVE-encrypted with keys from the job's token
(``tpserve.distributed.control``), every wait bounded by the job's deadline.
"""

from __future__ import annotations

from collections import deque

import msgspec
import torch
import torch.distributed as dist
import zmq

from tpserve.distributed.control import CurveKeys, ZapGuard, read_token, secure_client, secure_server, zmq_host
from tpserve.distributed.nodes import NodeFailure, NodeGroup
from tpserve.message import BatchTokenOutput, SchedulerInput
from tpserve.message.endpoints import Endpoints
from tpserve.message.transport import encode, open_socket

IDLE_POLL_MS = 500  # an idle rank 0 still broadcasts (a zero count) this often, so peers never time out
SHUTDOWN_LINGER_MS = 2000
BROADCAST_KEY = "tpserve/broadcast"  # the store key holding rank 0's TCP broadcast endpoint
# Each subscriber also subscribes to its own topic, which tells rank 0 who has connected. No
# message matches it: messages are msgpack maps and never start with a zero byte.
_RANK_TOPIC = b"\x00tpserve-rank-"


class SchedulerIO:
    def __init__(
        self, rank: int, tp_size: int, endpoints: Endpoints, cpu_group: dist.ProcessGroup | None,
        nodes: NodeGroup | None = None,
    ) -> None:
        self.rank, self.tp_size, self.cpu_group, self.nodes = rank, tp_size, cpu_group, nodes
        self.ctx = zmq.Context()
        self.decoder = msgspec.msgpack.Decoder(SchedulerInput)
        self._guard: ZapGuard | None = None
        keys = CurveKeys.from_token(read_token()) if nodes is not None else None
        if rank == 0:
            self.pull = open_socket(self.ctx, zmq.PULL, endpoints.scheduler, bind=True)
            self.push = open_socket(self.ctx, zmq.PUSH, endpoints.detokenizer, bind=False)
            if tp_size > 1:
                self.pub = self.ctx.socket(zmq.XPUB)
                self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
                self.pub.setsockopt(zmq.SNDHWM, 0)
                self.pub.setsockopt(zmq.LINGER, 0)
                if nodes is None or keys is None:
                    self.pub.bind(endpoints.rank_broadcast)
                else:
                    self._guard = ZapGuard(self.ctx, keys)
                    secure_server(self.pub, keys)
                    self.pub.setsockopt(zmq.IPV6, int(":" in nodes.host))  # an IPv6 --dist-init-addr
                    self.pub.bind(f"tcp://{zmq_host(nodes.host)}:*")  # only the --dist-init-addr interface
                    nodes.store.set(BROADCAST_KEY, self.pub.getsockopt(zmq.LAST_ENDPOINT))
        else:
            self.sub = self.ctx.socket(zmq.SUB)
            self.sub.setsockopt(zmq.RCVHWM, 0)
            self.sub.setsockopt(zmq.LINGER, 0)
            self.sub.setsockopt(zmq.SUBSCRIBE, b"")
            self.sub.setsockopt(zmq.SUBSCRIBE, _RANK_TOPIC + str(rank).encode())
            if nodes is None or keys is None:
                self.sub.connect(endpoints.rank_broadcast)
            else:
                self.sub.setsockopt(zmq.RCVTIMEO, int(nodes.timeout_s * 1000))
                secure_client(self.sub, keys)
                self.sub.setsockopt(zmq.IPV6, int(":" in nodes.host))
                self.sub.connect(nodes.store.get(BROADCAST_KEY).decode())

    def wait_for_peers(self) -> None:
        """Rank 0 waits until every other rank has subscribed (nothing published is lost)."""
        if self.rank == 0 and self.tp_size > 1:
            self._wait_subscribers()
        if self.cpu_group is not None:
            dist.barrier(group=self.cpu_group)

    def _wait_subscribers(self) -> None:
        nodes = self.nodes
        joined: set[int] = set()
        while len(joined) < self.tp_size - 1:
            if not self.pub.poll(-1 if nodes is None else int(nodes.timeout_s * 1000)) and nodes is not None:
                missing = [r for r in range(1, self.tp_size) if r not in joined]
                raise NodeFailure(
                    f"{nodes.layout.names(missing)} did not connect to rank 0's message broadcast within "
                    f"{nodes.timeout_s:g} s (is TPSERVE_DIST_TOKEN the same on every node?)"
                )
            msg = self.pub.recv()  # a subscription message: b"\x01" + topic
            if msg[1:].startswith(_RANK_TOPIC):
                joined.add(int(msg[1 + len(_RANK_TOPIC):]))

    def receive(self, blocking: bool, local: list[SchedulerInput] | None = None) -> list[SchedulerInput]:
        """The new messages, the same on every rank; rank 0's ``local`` ones (e.g. GrammarReady) first."""
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
            raws = [self._receive_broadcast() for _ in range(int(count.item()))]
        return [self.decoder.decode(raw) for raw in raws]

    def _receive_broadcast(self) -> bytes:
        try:
            return self.sub.recv()
        except zmq.Again:  # only with a deadline (across nodes)
            raise NodeFailure("no message from rank 0 (node 0) within the --dist-timeout although it announced one") from None

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
        if self._guard is not None:
            self._guard.stop()
        if self.rank == 0 and self.tp_size > 1:
            # rank 0's last broadcast (the Shutdown, maybe after a burst of requests) must still get out: closed with
            # no linger, ZMQ drops what it has not sent, and a rank told to expect it waits for SIGTERM
            self.pub.close(linger=SHUTDOWN_LINGER_MS)
        self.ctx.destroy(linger=SHUTDOWN_LINGER_MS if self.nodes is not None else 0)


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
