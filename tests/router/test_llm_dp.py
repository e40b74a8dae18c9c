"""The offline LLM with data-parallel replicas: same greedy outputs as one replica, requests
spread over both, flush and stats over every replica, a dead replica named."""

from __future__ import annotations

import os
import signal

import pytest

from tpserve import LLM, SamplingParams


def test_dp2_equals_dp1_and_spreads(qwen3_dir):
    prompts = [[5 + i, 6, 7 + i % 3] + [9] * (i % 5) for i in range(10)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(qwen3_dir, device="cpu") as one:
        expected = [o.token_ids for o in one.generate(prompts, greedy, use_tqdm=False)]
    with LLM(qwen3_dir, device="cpu", dp_size=2) as two:
        got = [o.token_ids for o in two.generate(prompts, greedy, use_tqdm=False)]
        assert two._driver.dispatch.router.routed == [5, 5], "equal prompts-and-outputs: an even split"
        per_replica = two.replica_stats()
        assert [s.replica for s in per_replica] == [0, 1]
        assert all(s.prompt_tokens_total > 0 for s in per_replica), "both replicas ran requests"
        assert two.stats().prompt_tokens_total == sum(s.prompt_tokens_total for s in per_replica)
        assert two.flush_cache()
        assert two._driver.dispatch.router.loads == [0, 0]
    assert got == expected


def test_dead_replica_is_named(qwen3_dir):
    llm = LLM(qwen3_dir, device="cpu", dp_size=2)
    procs = llm._driver.backend.procs
    try:
        os.kill(procs[1].pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="tp rank 0 of replica 1 died"):
            llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=200, ignore_eos=True), use_tqdm=False)
    finally:
        llm.close()
    assert all(not p.is_alive() for p in procs)


def test_bad_dp_settings(qwen3_dir):
    with pytest.raises(ValueError, match="dp_size must be >= 1"):
        LLM(qwen3_dir, device="cpu", dp_size=0)
    with pytest.raises(ValueError, match="load_balance_method must be one of cache_aware, minimum_tokens"):
        LLM(qwen3_dir, device="cpu", dp_size=2, load_balance_method="random")


def test_replicas_stats_add_counts_and_join_adapter_names():
    from tpserve.llm import sum_stats
    from tpserve.message import SchedulerStats

    one = SchedulerStats(running=1, waiting=2, kv_pages_used=3, kv_pages_total=10, draft_tokens_total=4,
                         running_loras=["b"], waiting_loras=["a"])
    two = SchedulerStats(running=2, waiting=0, kv_pages_used=1, kv_pages_total=10, replica=1, accepted_tokens_total=5,
                         running_loras=["a", "b"])
    total = sum_stats([one, two])
    assert (total.running, total.waiting, total.kv_pages_total, total.draft_tokens_total) == (3, 2, 20, 4)
    assert (total.accepted_tokens_total, total.running_loras, total.waiting_loras, total.replica) == (5, ["a", "b"], ["a"], 0)
