"""Radix prefix cache, chunked prefill and preemption: same greedy outputs, no page leaks."""

from __future__ import annotations

import random

import pytest

from tpserve.engine_config import EngineConfig
from tpserve.engine.engine import Engine
from tpserve.kvcache.pool import PageAllocator
from tpserve.kvcache.radix import RadixCache
from tpserve.sampling_params import SamplingParams
from tpserve.scheduler.scheduler import Scheduler


def test_radix_tree_match_insert_evict():
    cache = RadixCache(page_size=2)
    alloc = PageAllocator(20)
    a = alloc.allocate(3)
    assert cache.insert([1, 2, 3, 4, 5, 6], a) == []
    assert cache.num_pages == 3 and cache.num_evictable == 3
    m = cache.match([1, 2, 3, 4, 9, 9, 9])  # two whole pages match
    assert m.pages == a[:2]
    cache.lock(m.node)
    assert cache.num_evictable == 1, "the locked prefix is not evictable"
    b = alloc.allocate(3)
    dup = cache.insert([1, 2, 3, 4, 7, 7], b)  # shares two pages with the tree
    assert dup == b[:2]
    assert cache.evict(10) and cache.num_pages == 2, "only the locked prefix stays"
    cache.unlock(m.node)
    assert sorted(cache.evict(10)) == sorted(a[:2]) and cache.num_pages == 0


def test_lru_eviction_order():
    cache = RadixCache(page_size=1)
    cache.clock = 1
    cache.insert([1, 2], [10, 11])
    cache.clock = 2
    cache.insert([3, 4], [12, 13])
    cache.clock = 3
    cache.match([1, 2])  # touch the first
    assert cache.evict(1) == [12, 13], "least recently used leaf first"


def test_salted_requests_share_prefixes_only_with_their_salt():
    """vLLM's cache_salt: a salted request's pages sit in its salt's own tree (no other request matches them, nor
    they others'); locking, eviction and the page counts span every tree, and an evicted salt's tree is dropped."""
    cache = RadixCache(page_size=2)
    cache.insert([1, 2, 3, 4], [10, 11])
    cache.insert([1, 2, 3, 4], [20, 21], salt="tenant-a")
    assert cache.match([1, 2, 3, 4, 5]).pages == [10, 11]
    assert cache.match([1, 2, 3, 4, 5], "tenant-a").pages == [20, 21]
    assert cache.match([1, 2, 3, 4, 5], "tenant-b").pages == []
    assert cache.insert([1, 2, 3, 4], [30, 31], salt="tenant-a") == [30, 31]  # already held: the copies go back
    assert cache.num_pages == cache.num_evictable == 4
    match = cache.match([1, 2, 3, 4], "tenant-a")
    cache.lock(match.node)
    assert cache.num_evictable == 2 and sorted(cache.evict(10)) == [10, 11]  # the locked salted prefix stays
    cache.unlock(match.node)
    assert sorted(cache.evict(10)) == [20, 21] and cache.num_pages == 0 and cache.salted == {}
    assert cache.insert([], [], salt="tenant-c") == [] and cache.salted == {}  # a request shorter than a page


def random_workload(n: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    system_prompts = [[rng.randrange(3, 600) for _ in range(rng.randint(5, 30))] for _ in range(4)]
    work = []
    for _ in range(n):
        prompt = rng.choice(system_prompts) + [rng.randrange(3, 600) for _ in range(rng.randint(1, 20))]
        work.append((prompt, SamplingParams(temperature=0, max_tokens=rng.randint(1, 12), ignore_eos=True)))
    return work


def run_workload(engine: Engine, work, arrival_batches: int = 5):
    """Requests arrive in waves, so later ones find earlier ones' prefixes in the cache."""
    scheduler = Scheduler(engine)
    scheduler.check_accounting = True
    tokens: dict[int, list[int]] = {}
    cached: dict[int, int] = {}
    wave = -(-len(work) // arrival_batches)
    for start in range(0, len(work), wave):
        for rid in range(start, min(start + wave, len(work))):
            scheduler.add_request(rid, work[rid][0], work[rid][1], seed=rid)
            tokens[rid] = []
        for _ in range(3):
            for out in scheduler.step():
                tokens[out.rid].extend(out.token_ids)
                if out.prompt_tokens:
                    cached[out.rid] = out.cached_tokens
    while scheduler.has_work:
        for out in scheduler.step():
            tokens[out.rid].extend(out.token_ids)
            if out.prompt_tokens:
                cached[out.rid] = out.cached_tokens
    assert all(len(tokens[rid]) == work[rid][1].max_tokens for rid in tokens), "every request completes"
    assert scheduler.flush_cache(), "every page is free after a flush"
    return tokens, scheduler, cached


@pytest.fixture(scope="module")
def reference_outputs(qwen3_dir):
    work = random_workload(200, seed=7)
    engine = Engine(EngineConfig(model=qwen3_dir, device="cpu", page_size=4, cache="naive", chunked_prefill_size=0,
                                 disable_overlap=True))
    tokens, _, _ = run_workload(engine, work)
    return work, tokens


@pytest.mark.parametrize(
    "cache,chunk,total,policy,overlap",
    [
        ("radix", 8192, 4096, "fcfs", True),
        ("radix", 3, 4096, "fcfs", True),
        ("radix", 7, 160, "lpm", True),  # small pool: eviction and preemption
        ("radix", 7, 160, "fcfs", False),
        ("naive", 16, 240, "fcfs", True),
    ],
)
def test_same_outputs_under_every_cache_chunk_and_pool(qwen3_dir, reference_outputs, cache, chunk, total, policy, overlap):
    work, expected = reference_outputs
    engine = Engine(EngineConfig(model=qwen3_dir, device="cpu", page_size=4, cache=cache, disable_overlap=not overlap,
                                 chunked_prefill_size=chunk, max_total_tokens=total, schedule_policy=policy))
    tokens, scheduler, cached = run_workload(engine, work)
    mismatched = [rid for rid in expected if tokens[rid] != expected[rid]]
    assert not mismatched, f"{len(mismatched)} requests differ, e.g. {mismatched[:5]}"
    if cache == "radix":
        assert scheduler.cached_tokens_total > 0 and any(cached.values())
    else:
        assert scheduler.cached_tokens_total == 0
    if total < 1000:
        assert scheduler.evicted_pages_total > 0 or cache == "naive"
        assert scheduler.preemptions_total > 0 or cache == "naive"


def test_multi_turn_reuses_history(qwen3_dir):
    engine = Engine(EngineConfig(model=qwen3_dir, device="cpu", page_size=4))
    scheduler = Scheduler(engine)
    turn1 = list(range(10, 40))
    scheduler.add_request(0, turn1, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), seed=0)
    answer, first = [], []
    while scheduler.has_work:
        for out in scheduler.step():
            answer.extend(out.token_ids)
            first.append(out.cached_tokens)
    assert first[0] == 0
    turn2 = turn1 + answer + [50, 51, 52]
    scheduler.add_request(1, turn2, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), seed=0)
    outs = []
    while scheduler.has_work:
        outs.extend(scheduler.step())
    # Everything but the last (unsampled) answer token is cached, in whole pages of 4.
    assert outs[0].cached_tokens == (len(turn1) + len(answer) - 1) // 4 * 4
    assert outs[0].prompt_tokens == len(turn2)


def test_long_prompt_is_chunked_while_others_decode(qwen3_dir):
    engine = Engine(EngineConfig(model=qwen3_dir, device="cpu", page_size=4, chunked_prefill_size=8,
                                 mixed_prefill_tokens=8))  # chunks share steps with decodes
    scheduler = Scheduler(engine)
    scheduler.add_request(0, [5, 6, 7], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), seed=0)
    scheduler.step()  # request 0 is now decoding
    scheduler.add_request(1, list(range(100, 160)), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), seed=0)
    decoded_during_prefill = 0
    while 1 in scheduler.running or scheduler.waiting:
        outs = scheduler.step()
        assert scheduler.running.get(1) is None or scheduler.running[1].num_cached <= 60
        decoded_during_prefill += sum(1 for o in outs if o.rid == 0)
    assert decoded_during_prefill >= 60 // 8 - 1, "request 0 kept decoding while the long prompt was chunked"
