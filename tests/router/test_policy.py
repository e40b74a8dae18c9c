"""The router's policy: least outstanding work, then the longest cached prefix, page hashes."""

from __future__ import annotations

import pytest

from tpserve.message import (
    AbortRequest, FlushCache, GenerateRequest, GetStats, LoadLoRA, SchedulerStats, UnloadLoRA,
)
from tpserve.router.policy import Dispatch, PrefixTable, Router, page_hashes
from tpserve.sampling_params import SamplingParams


def test_page_hashes_chain_whole_pages():
    a = page_hashes(list(range(10)), 4)
    assert len(a) == 2, "the last partial page is not hashed"
    b = page_hashes([99] + list(range(1, 10)), 4)
    assert a[0] != b[0] and a[1] != b[1], "a page's hash covers every token before it"
    assert page_hashes(list(range(8)) + [7, 7, 7, 7], 4)[:2] == a


def test_prefix_table_matches_leading_pages_and_forgets_the_oldest():
    table = PrefixTable(capacity=3)
    first, second = page_hashes(list(range(12)), 4), page_hashes([50] * 8, 4)
    table.insert(first)
    assert table.match(first) == 3 and table.match(page_hashes(list(range(8)) + [0] * 4, 4)) == 2
    table.insert(second)  # 5 pages in a table of 3: the oldest two go
    assert len(table) == 3 and table.match(first) == 0 and table.match(second) == 2


def test_least_outstanding_work_wins():
    router = Router(2, "minimum_tokens", page_size=4)
    assert router.route(1, [1] * 100) == 0
    assert router.route(2, [2] * 10) == 1
    assert router.route(3, [3] * 10) == 1, "replica 1 holds 10 tokens, replica 0 holds 100"
    assert router.loads == [100, 20]
    router.on_output(2, 5, finished=False)
    assert router.loads == [100, 25]
    router.on_output(1, 3, finished=True)
    assert router.loads == [0, 25] and router.replica_of(1) is None and router.replica_of(2) == 1
    router.on_output(99, 1, finished=True)  # not routed here: ignored
    assert router.loads == [0, 25]


def test_ties_go_round_the_replicas():
    router = Router(3, "minimum_tokens")
    picks = []
    for rid in range(6):
        picks.append(router.route(rid, [7] * 8))
        router.on_output(rid, 0, finished=True)  # every replica idle again
    assert picks == [0, 1, 2, 0, 1, 2]


def test_cache_aware_prefers_the_cached_prefix_when_loads_are_even():
    shared = list(range(64))
    aware, plain = Router(2, "cache_aware", page_size=16), Router(2, "minimum_tokens", page_size=16)
    for router in (aware, plain):
        router.route(1, shared + [1])  # replica 0 caches the shared prefix
        router.route(2, [200] * 65)  # replica 1: as much work, nothing shared
    assert aware.route(3, shared + [3]) == 0, "even loads: the replica holding the prefix"
    assert plain.route(3, shared + [3]) == 0, "a tie: round the replicas, back to 0"
    for router in (aware, plain):
        router.on_output(3, 0, finished=True)  # even again
    assert plain.route(4, shared + [4]) == 1 and aware.route(4, shared + [4]) == 0
    assert aware.route(5, shared + [5]) == 0, "130 against 65: within the saving plus half the mean load"
    assert aware.route(6, shared + [6]) == 1, "195 against 65: too far ahead"


def test_cache_aware_still_balances_when_the_load_is_uneven():
    router = Router(2, "cache_aware", page_size=16)
    prefix = list(range(32))
    sent = [router.route(rid, prefix + [rid] * 16) for rid in range(6)]
    # Replica 0 would save 32 of 48 tokens, but it is 48 ahead (more than 32 + half the mean 24).
    assert sent[:2] == [0, 1] and sent.count(0) == sent.count(1) == 3
    assert router.loads == [144, 144]


def test_bad_settings():
    with pytest.raises(ValueError, match="dp_size must be >= 1"):
        Router(0)
    with pytest.raises(ValueError, match="load balance method must be one of cache_aware, minimum_tokens"):
        Router(2, "round_robin")


def test_dispatch_routes_each_message():
    dispatch = Dispatch(Router(2, "cache_aware", page_size=4))
    params = SamplingParams(max_tokens=4)
    assert dispatch.destinations(GenerateRequest(1, [1, 2, 3, 4, 5], params)) == [0]
    assert dispatch.destinations(GenerateRequest(2, [9, 9, 9, 9, 9], params)) == [1]
    assert dispatch.destinations(AbortRequest(2)) == [1]
    assert dispatch.destinations(AbortRequest(77)) == [0, 1], "not routed yet: every replica"
    assert dispatch.destinations(GetStats()) == [0, 1]
    assert dispatch.destinations(LoadLoRA(8, "a", "/a")) == dispatch.destinations(UnloadLoRA(9, "a")) == [0, 1]
    assert dispatch.router.tables[0].match(page_hashes([1, 2, 3, 4], 4)) == 1
    # a salted prompt's pages are its salt's (as the replicas cache them): they credit no other request's route
    assert dispatch.destinations(GenerateRequest(3, [9, 9, 9, 9, 9], SamplingParams(cache_salt="a"))) == [0]
    assert dispatch.router.tables[0].match(page_hashes([9, 9, 9, 9], 4, "a")) == 1
    assert dispatch.router.tables[0].match(page_hashes([9, 9, 9, 9], 4)) == 0
    assert dispatch.destinations(FlushCache()) == [0, 1]
    assert len(dispatch.router.tables[0]) == 0, "a flush empties the prefix tables"
    dispatch.on_stats(SchedulerStats(running=0, waiting=0, kv_pages_used=0, kv_pages_total=123, replica=1))
    assert dispatch.router.tables[1].capacity == 123


@pytest.mark.parametrize("method", ["cache_aware", "minimum_tokens"])
def test_a_stalled_replica_gets_no_new_requests_unless_every_one_is(method):
    stalled: set[int] = set()
    dispatch = Dispatch(Router(3, method, page_size=4), stalled=lambda: stalled)
    params = SamplingParams(max_tokens=4)
    prefix = [5, 6, 7, 8]
    assert dispatch.destinations(GenerateRequest(1, prefix + [1], params)) == [0]  # replica 0 caches the prefix
    stalled.add(0)
    picks = [dispatch.destinations(GenerateRequest(rid, prefix + [rid], params))[0] for rid in range(2, 8)]
    assert 0 not in picks and set(picks) == {1, 2}, "the cached prefix does not draw requests to a stalled replica"
    stalled.update({1, 2})
    assert dispatch.destinations(GenerateRequest(8, [3] * 5, params)) in ([0], [1], [2]), "all stalled: route anyway"
    stalled.clear()
    assert dispatch.destinations(GenerateRequest(9, [4] * 5, params)) == [0], "back: the least loaded again"
