"""The router's choice of replica for a request: least outstanding work, cached prefixes.

A replica's outstanding work is the tokens of the requests routed to it and not finished yet:
their prompts plus what they have generated so far (the KV tokens they hold or will hold).

``minimum_tokens`` sends a request to the replica with the least outstanding work.
``cache_aware`` sends it to the replica that likely holds the longest prefix of the prompt in its
cache among the replicas whose loads are even: a replica's load counts as even when, less the
prefix it would not have to prefill, it is within BALANCE_SLACK of the mean load of the least
loaded one. A replica further behind than that gets no new requests until the others catch up,
so a popular prefix spreads over more replicas only when its replica is busy.
The router does not ask the replicas what they cache: it remembers the pages of the prompts it
sent to each (chained page hashes, as the radix cache matches whole pages), least recently sent
first out, bounded by the replica's KV-cache size. Ties go round the replicas in turn.

``Dispatch`` sends a new request to the replica the router picks; an abort to the replica
running the request (to every replica if it was not routed yet: the request may still be on its
way); a cache flush, a stats query or a shut-down to every replica.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass

import msgspec

from tpserve.engine_config import EngineConfig
from tpserve.message import AbortRequest, FlushCache, GenerateRequest, SchedulerInput, SchedulerStats

logger = logging.getLogger(__name__)

LOAD_BALANCE_METHODS = ("cache_aware", "minimum_tokens")
DEFAULT_TABLE_PAGES = 1 << 16  # per replica, until its first stats give its KV-cache size
# cache_aware: how far (a share of the mean outstanding tokens) a replica may run ahead of the
# least loaded one and still get the requests whose prefix it holds. Measured on the CPU with
# 64 shared 128-token prefixes over two replicas (benchmarks/serving.py --shared-prefix 64:128):
# 0 (the prefix saving alone) kept too few prefixes on one replica to beat minimum_tokens' hit rate by much.
BALANCE_SLACK = 0.5


def page_hashes(input_ids: list[int], page_size: int, salt: str | None = None) -> list[int]:
    """One hash per whole page of the prompt, each covering every token up to its page's end (and the request's
    ``cache_salt``: a salted prompt's pages are cached apart from the same tokens' unsalted ones)."""
    hashes, previous = [], 0 if salt is None else hash(salt)
    for start in range(0, len(input_ids) - page_size + 1, page_size):
        previous = hash((previous, *input_ids[start:start + page_size]))
        hashes.append(previous)
    return hashes


class PrefixTable:
    """The pages one replica was sent most recently (an LRU set of chained page hashes)."""

    def __init__(self, capacity: int = DEFAULT_TABLE_PAGES) -> None:
        self.capacity = capacity
        self._pages: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pages)

    def match(self, hashes: list[int]) -> int:
        """How many leading pages of ``hashes`` the table holds."""
        for i, h in enumerate(hashes):
            if h not in self._pages:
                return i
        return len(hashes)

    def insert(self, hashes: list[int]) -> None:
        for h in hashes:
            self._pages[h] = None
            self._pages.move_to_end(h)
        while len(self._pages) > self.capacity:
            self._pages.popitem(last=False)

    def clear(self) -> None:
        self._pages.clear()


@dataclass
class _InFlight:
    replica: int
    tokens: int  # prompt + generated so far


class Router:
    """Picks a replica per request and keeps each replica's outstanding work up to date."""

    def __init__(self, dp_size: int, method: str = "cache_aware", page_size: int = 16) -> None:
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        if method not in LOAD_BALANCE_METHODS:
            raise ValueError(f"load balance method must be one of {', '.join(LOAD_BALANCE_METHODS)}, got {method!r}")
        self.dp_size, self.method, self.page_size = dp_size, method, page_size
        self.loads = [0] * dp_size  # outstanding tokens
        self.routed = [0] * dp_size  # requests sent, cumulative
        self.tables = [PrefixTable() for _ in range(dp_size)]
        self._requests: dict[int, _InFlight] = {}
        self._turn = 0

    def route(self, rid: int, input_ids: list[int], unavailable: Collection[int] = (), salt: str | None = None) -> int:
        """The replica to run request ``rid`` (of ``cache_salt`` ``salt``); its tokens count as that replica's work
        from now. None of ``unavailable`` (stalled replicas), unless every replica is."""
        candidates = [d for d in range(self.dp_size) if d not in unavailable] or list(range(self.dp_size))
        hashes = page_hashes(input_ids, self.page_size, salt) if self.method == "cache_aware" else []
        matched = [table.match(hashes) * self.page_size for table in self.tables] if hashes else [0] * self.dp_size
        turn, loads = self._turn, self.loads
        costs = {d: loads[d] - matched[d] for d in candidates}
        slack = BALANCE_SLACK * sum(loads[d] for d in candidates) / len(candidates) if hashes else 0.0
        even = [d for d in candidates if costs[d] <= min(costs.values()) + slack]
        replica = min(even, key=lambda d: (-matched[d], loads[d], (d - turn) % self.dp_size))
        self._turn = (turn + 1) % self.dp_size
        if hashes:
            self.tables[replica].insert(hashes)
        self._requests[rid] = _InFlight(replica, len(input_ids))
        self.loads[replica] += len(input_ids)
        self.routed[replica] += 1
        return replica

    def replica_of(self, rid: int) -> int | None:
        request = self._requests.get(rid)
        return None if request is None else request.replica

    def on_output(self, rid: int, new_tokens: int, finished: bool) -> None:
        """Request ``rid`` generated ``new_tokens`` more; once finished its work is done."""
        request = self._requests.get(rid)
        if request is None:
            return
        if finished:
            del self._requests[rid]
            self.loads[request.replica] -= request.tokens
        else:
            request.tokens += new_tokens
            self.loads[request.replica] += new_tokens

    def set_cache_size(self, replica: int, kv_pages: int) -> None:
        """The replica's KV-cache size in pages: its table remembers no more than that."""
        if kv_pages > 0:
            self.tables[replica].capacity = kv_pages

    def flush(self) -> None:
        """Every replica's cache was flushed."""
        for table in self.tables:
            table.clear()


class Dispatch:
    """Which replicas a message for the schedulers goes to, and the router's view of the outputs.
    ``stalled``: the replicas that make no progress now (the server's liveness check), which get no new requests."""

    def __init__(self, router: Router, stalled: Callable[[], Collection[int]] | None = None) -> None:
        self.router = router
        self._stalled = stalled
        self._avoided: Collection[int] = ()
        self._decoder = msgspec.msgpack.Decoder(SchedulerInput)

    @classmethod
    def for_replicas(cls, engine: EngineConfig, method: str,
                     stalled: Callable[[], Collection[int]] | None = None) -> Dispatch | None:
        """The dispatch of ``engine``'s data-parallel replicas (None with one: rank 0 is reached directly)."""
        return None if engine.dp_size == 1 else cls(Router(engine.dp_size, method, engine.page_size), stalled)

    def _unavailable(self) -> Collection[int]:
        avoided = self._stalled() if self._stalled is not None else ()
        if set(avoided) != set(self._avoided):
            if avoided:
                logger.warning("replica(s) %s make no progress: new requests go to the others",
                               ", ".join(map(str, sorted(avoided))))
            else:
                logger.info("every replica makes progress again")
            self._avoided = avoided
        return avoided

    def destinations(self, msg: SchedulerInput) -> list[int]:
        if isinstance(msg, GenerateRequest):
            return [self.router.route(msg.rid, msg.input_ids, self._unavailable(), msg.params.prefix_key)]
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
