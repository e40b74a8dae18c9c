"""The API server's router between the frontend and the data-parallel replicas.

With more than one replica, every message for the schedulers (new requests from the tokenizers,
aborts from the detokenizer and the API server, cache flushes) comes to the router's socket;
one asyncio task forwards each, unchanged, to the replicas ``Dispatch`` names.
"""

from __future__ import annotations

import zmq
import zmq.asyncio

from tpserve.message.endpoints import Endpoints
from tpserve.message.transport import open_socket
from tpserve.router.policy import Dispatch


class ReplicaRouter:
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
