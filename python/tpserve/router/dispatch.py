"""Which replicas a message for the schedulers goes to, and the router's view of the outputs.

A new request goes to the replica the policy picks; an abort to the replica running the
request (to every replica if it was not routed yet: the request may still be on its way); a
cache flush, a stats query or a shut-down to every replica.
"""

from __future__ import annotations

import msgspec

from tpserve.config import EngineConfig
from tpserve.message import AbortRequest, FlushCache, GenerateRequest, SchedulerInput, SchedulerStats
from tpserve.router.policy import Router


class Dispatch:
    def __init__(self, router: Router) -> None:
        self.router = router
        self._decoder = msgspec.msgpack.Decoder(SchedulerInput)

    @classmethod
    def for_replicas(cls, engine: EngineConfig, method: str) -> Dispatch | None:
        """The dispatch of ``engine``'s data-parallel replicas (None with one: rank 0 is reached directly)."""
        return None if engine.dp_size == 1 else cls(Router(engine.dp_size, method, engine.page_size))

    def destinations(self, msg: SchedulerInput) -> list[int]:
        if isinstance(msg, GenerateRequest):
            return [self.router.route(msg.rid, msg.input_ids)]
        if isinstance(msg, AbortRequest):
            replica = self.router.replica_of(msg.rid)
            if replica is not None:
                return [replica]
        elif isinstance(msg, FlushCache):
            self.router.flush()
        return list(range(self.router.dp_size))

    def destinations_of(self, data: bytes) -> list[int]:
        """``destinations`` of an encoded message."""
        return self.destinations(self._decoder.decode(data))

    def on_stats(self, stats: SchedulerStats) -> None:
        self.router.set_cache_size(stats.replica, stats.kv_pages_total)
