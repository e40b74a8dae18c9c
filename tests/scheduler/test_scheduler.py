"""Continuous batching on one rank: admission under KV pressure, finishing, rejection."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tpserve.engine_config import EngineConfig
from tpserve.engine.engine import Engine
from tpserve.sampling_params import SamplingParams
from tpserve.scheduler.scheduler import AdmissionError, Scheduler


@pytest.fixture(scope="module")
def small_engine(qwen3_dir):
    # 64 tokens of KV cache in pages of 4: only two 30-token requests fit at once.
    return Engine(EngineConfig(model=qwen3_dir, device="cpu", page_size=4, max_total_tokens=64))


def run(scheduler: Scheduler, requests: dict[int, tuple[list[int], SamplingParams]]):
    for rid, (prompt, params) in requests.items():
        scheduler.add_request(rid, prompt, params, seed=rid)
    tokens: dict[int, list[int]] = {rid: [] for rid in requests}
    finish: dict[int, str] = {}
    concurrency = []
    while scheduler.has_work:
        outs = scheduler.step()
        concurrency.append(sorted(o.rid for o in outs))
        for out in outs:
            tokens.setdefault(out.rid, []).extend(out.token_ids)
            if out.finish_reason:
                finish[out.rid] = out.finish_reason
    return tokens, finish, concurrency


def test_kv_pressure_preempts_and_every_request_finishes(small_engine):
    requests = {
        rid: ([rid + 1, rid + 2, rid + 3, rid + 4, rid + 5, rid + 6], SamplingParams(temperature=0, ignore_eos=True, max_tokens=20 + rid))
        for rid in range(8)
    }
    scheduler = Scheduler(small_engine)
    scheduler.check_accounting = True
    tokens, finish, concurrency = run(scheduler, requests)
    assert all(finish[rid] == "length" and len(tokens[rid]) == 20 + rid for rid in requests)
    assert scheduler.preemptions_total > 0, "64 tokens of KV cache cannot hold 8 growing requests"
    # Continuous batching: a request joins while another is mid-decode.
    assert any(set(a) & set(b) and set(b) - set(a) for a, b in zip(concurrency, concurrency[1:]))
    assert scheduler.flush_cache() and scheduler.allocator.num_free == scheduler.allocator.total
    # Each request's tokens equal those it gets alone (batching and preemption change nothing).
    for rid in (0, 5, 7):
        alone, _, _ = run(Scheduler(small_engine), {rid: requests[rid]})
        assert alone[rid] == tokens[rid]


def test_stop_token_and_max_running(qwen3_dir, small_engine):
    scheduler = Scheduler(small_engine)
    probe, _, _ = run(scheduler, {0: ([7, 8, 9], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))})
    stop_at = probe[0][3]
    first = probe[0].index(stop_at)
    tokens, finish, _ = run(scheduler, {1: ([7, 8, 9], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop_token_ids=[stop_at]))})
    assert finish[1] == "stop" and tokens[1] == probe[0][: first + 1]

    engine = Engine(EngineConfig(model=qwen3_dir, device="cpu", max_running_requests=3))
    _, _, concurrency = run(Scheduler(engine), {r: ([r + 3, 4], SamplingParams(max_tokens=4, ignore_eos=True)) for r in range(7)})
    assert max(len(step) for step in concurrency) == 3


def test_eos_finishes_with_stop(small_engine):
    scheduler = Scheduler(small_engine)
    eos = sorted(small_engine.model_config.eos_token_ids)
    assert len(eos) >= 2, "EOS ids come from generation_config.json (a list) and config.json"
    probe, _, _ = run(scheduler, {0: ([11, 12], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))})
    # Pretend the 3rd greedy token is an EOS id: a scheduler whose EOS set contains it stops there.
    scheduler.eos_ids = frozenset({probe[0][2]})
    tokens, finish, _ = run(scheduler, {1: ([11, 12], SamplingParams(temperature=0, max_tokens=8))})
    assert finish[1] == "stop" and tokens[1] == probe[0][: probe[0].index(probe[0][2]) + 1]


@pytest.mark.parametrize(
    "prompt,params,message",
    [
        ([], SamplingParams(), "empty"),
        ([1] * 5000, SamplingParams(), "context limit"),
        ([1, 10**6], SamplingParams(), "token ids must be in"),
        ([1] * 64, SamplingParams(max_tokens=1), "KV cache holds 64 tokens"),
    ],
)
def test_rejections(small_engine, prompt, params, message):
    with pytest.raises(AdmissionError, match=message):
        Scheduler(small_engine).add_request(0, prompt, params, seed=0)


def test_abort_frees_pages(small_engine):
    scheduler = Scheduler(small_engine)
    scheduler.add_request(0, [1, 2, 3], SamplingParams(max_tokens=40, ignore_eos=True), seed=0)
    scheduler.add_request(1, [1, 2, 3], SamplingParams(max_tokens=40, ignore_eos=True), seed=0)
    scheduler.add_request(2, [1, 2, 3], SamplingParams(max_tokens=40, ignore_eos=True), seed=0)
    scheduler.config = replace(scheduler.config, max_running_requests=2)
    scheduler.step()
    assert scheduler.allocator.num_used > 0 and len(scheduler.waiting) == 1
    assert scheduler.abort(0) and scheduler.abort(1) and scheduler.abort(2)
    assert scheduler.step() == [], "the step in flight is discarded"
    scheduler.flush_cache()
    assert not scheduler.abort(1)
    assert scheduler.allocator.num_free == scheduler.allocator.total and not scheduler.has_work


def record_steps(engine: Engine, monkeypatch) -> list[tuple[int, int]]:
    """(decode rows, prefill tokens) of each step ``engine`` prepares, from now on."""
    steps: list[tuple[int, int]] = []
    prepare = engine.prepare

    def recording_prepare(seqs, *args, **kwargs):
        decodes = sum(len(s.token_ids) == 1 for s in seqs)
        steps.append((decodes, sum(len(s.token_ids) for s in seqs) - decodes))
        return prepare(seqs, *args, **kwargs)

    monkeypatch.setattr(engine, "prepare", recording_prepare)
    return steps


@pytest.mark.parametrize("mixed_prefill_tokens", [0, 8, 64])
def test_long_prefills_run_without_decodes(qwen3_dir, monkeypatch, mixed_prefill_tokens):
    """A step carrying more prefill tokens than mixed_prefill_tokens leaves the decodes out (they
    run in the next step); shorter prefill work shares the step with them."""
    config = EngineConfig(model=qwen3_dir, device="cpu", page_size=4, max_total_tokens=256,
                          mixed_prefill_tokens=mixed_prefill_tokens)
    engine = Engine(config)
    steps = record_steps(engine, monkeypatch)
    scheduler = Scheduler(engine)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    scheduler.add_request(0, [5, 6, 7], params, seed=0)
    for _ in range(4):
        scheduler.step()
    assert steps[-1] == (1, 0)
    tokens, finish, _ = run(scheduler, {1: (list(range(10, 50)), params), 2: ([8, 9], params)})
    assert steps[4][1] == 42, steps  # both prompts in one step
    if mixed_prefill_tokens >= 42:
        assert steps[4][0] == 1, steps
    else:
        assert steps[4][0] == 0, steps
        assert steps[5] == (3, 0), "every running request decodes in the step after"
    assert finish == {0: "length", 1: "length", 2: "length"} and len(tokens[1]) == len(tokens[2]) == 12


def test_a_prompt_of_many_chunks_holds_the_decodes_one_step_at_a_time(qwen3_dir, monkeypatch):
    """Prefill chunks and decode steps alternate: a decode waits one prefill step, not all of a long prompt's."""
    engine = Engine(EngineConfig(model=qwen3_dir, device="cpu", page_size=4, max_total_tokens=256,
                                 chunked_prefill_size=8))
    steps = record_steps(engine, monkeypatch)
    scheduler = Scheduler(engine)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    scheduler.add_request(0, [5, 6, 7], params, seed=0)
    for _ in range(3):
        scheduler.step()
    run(scheduler, {1: (list(range(10, 50)), SamplingParams(max_tokens=2, ignore_eos=True))})
    assert steps[3:13] == [(0, 8), (1, 0)] * 4 + [(0, 8), (2, 0)], steps  # the 40-token prompt's five chunks


@pytest.mark.parametrize("cache", ["naive", "radix"])
def test_a_preempted_prompt_returns_once_it_fits_whole(qwen3_dir, cache):
    """An 80-token prompt arriving while three requests decode into a 128-token cache: preempted, it came back
    with pages for one 8-token chunk and was preempted again by the decodes' growth, 13 times (naive cache)."""
    def run_with(max_total_tokens: int) -> tuple[dict, int]:
        engine = Engine(EngineConfig(model=qwen3_dir, device="cpu", page_size=4, max_total_tokens=max_total_tokens,
                                     chunked_prefill_size=8, cache=cache))
        scheduler = Scheduler(engine)
        for rid in range(3):
            scheduler.add_request(rid, [5 + rid] * 6, SamplingParams(max_tokens=36, ignore_eos=True), seed=rid)
        for _ in range(3):
            scheduler.step()
        tokens, finish, _ = run(scheduler, {9: (list(range(10, 90)), SamplingParams(max_tokens=4, ignore_eos=True))})
        assert set(finish.values()) == {"length"}
        return tokens, scheduler.preemptions_total

    tokens, preemptions = run_with(128)
    assert preemptions <= 2 and tokens == run_with(1024)[0]


def test_prompt_logprobs_in_small_chunks_under_kv_pressure(small_engine, qwen3_dir, monkeypatch):
    import torch

    import tpserve.scheduler.scheduler as scheduler_module
    from reference import hf_logits

    monkeypatch.setattr(scheduler_module, "PROMPT_LOGPROBS_CHUNK", 5)  # 30-token prompts in 6 steps each
    prompts = {rid: list(range(10 + rid, 40 + rid)) for rid in range(3)}
    scheduler = Scheduler(small_engine)
    scheduler.check_accounting = True
    for rid, prompt in prompts.items():
        params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=12, prompt_logprobs=1)
        scheduler.add_request(rid, prompt, params, seed=rid)
    firsts, chunk_steps = {}, 0
    while scheduler.has_work:
        for out in scheduler.step():
            if out.prompt_token_ids is not None:
                firsts[out.rid] = out
        chunk_steps += 1
    assert scheduler.preemptions_total > 0, "64 tokens of KV cache cannot hold three 42-token requests"
    assert chunk_steps > 3 * 6
    for rid, prompt in prompts.items():
        out = firsts[rid]
        assert out.prompt_token_ids == prompt and len(out.prompt_logprobs) == len(prompt) - 1
        ref = torch.log_softmax(hf_logits(qwen3_dir, prompt)[:-1], dim=-1)
        expected = ref.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(out.prompt_logprobs), expected, atol=1e-4)
        assert [top[0][0] for top in out.prompt_top_logprobs] == ref.argmax(-1).tolist()


def test_priority_policy_admits_by_priority_and_preempts_the_least_urgent(small_engine):
    """vLLM's priority scheduling: waiting requests are admitted lowest priority value first (ties by arrival), and
    under KV pressure the running request of the highest value is preempted, not the newest; the tokens are those
    each request gets alone. Under fcfs a priority other than 0 is refused."""
    scheduler = Scheduler(small_engine)
    scheduler.config = replace(scheduler.config, schedule_policy="priority", max_running_requests=1)
    priorities = {0: 5, 1: 0, 2: -3, 3: 0}
    params = {rid: SamplingParams(temperature=0, ignore_eos=True, max_tokens=3, priority=p)
              for rid, p in priorities.items()}
    tokens, finish, concurrency = run(scheduler, {rid: ([rid + 1] * 5, params[rid]) for rid in priorities})
    firsts = [rid for step in concurrency for rid in step]
    assert list(dict.fromkeys(firsts)) == [2, 1, 3, 0], concurrency  # -3, then the two 0s as they came, then 5

    # 64 tokens of KV cache: two 30-token requests grow past it. The urgent one (admitted last) keeps running.
    scheduler = Scheduler(small_engine)
    scheduler.config = replace(scheduler.config, schedule_policy="priority")
    scheduler.check_accounting = True
    preempted = []
    preempt = scheduler._preempt
    scheduler._preempt = lambda req: preempted.append(req.rid) or preempt(req)
    long = {rid: (list(range(10 + rid, 30 + rid)), SamplingParams(temperature=0, ignore_eos=True, max_tokens=20,
                                                                   priority=p)) for rid, p in ((0, 1), (1, 1))}
    early = []
    for rid in (0, 1):
        scheduler.add_request(rid, *long[rid], seed=rid)
        early += scheduler.step()
    urgent = (list(range(50, 70)), SamplingParams(temperature=0, ignore_eos=True, max_tokens=20, priority=0))
    tokens, finish, _ = run(scheduler, {2: urgent})
    for out in reversed(early):
        tokens[out.rid][:0] = out.token_ids
    assert preempted and 2 not in preempted, preempted
    assert preempted[0] == 1  # of the two equally urgent, the newer
    for rid, request in {**long, 2: urgent}.items():
        alone, _, _ = run(Scheduler(small_engine), {rid: (request[0], replace_priority(request[1]))})
        assert alone[rid] == tokens[rid]

    with pytest.raises(AdmissionError, match="priority 2 needs the priority schedule policy"):
        Scheduler(small_engine).add_request(9, [1, 2], SamplingParams(priority=2), seed=0)


def test_priority_policy_preempts_by_arrival_not_admission(small_engine):
    """vLLM's victim under the priority policy is the running request of the highest (priority, arrival): of two
    equally urgent ones, the later to arrive, even when the earlier was admitted after it (as a request whose grammar
    compiles is); admission order is fcfs's rule."""
    scheduler = Scheduler(small_engine)
    scheduler.config = replace(scheduler.config, schedule_policy="priority")
    preempted = []
    preempt = scheduler._preempt
    scheduler._preempt = lambda req: preempted.append(req.rid) or preempt(req)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=20)
    scheduler.add_request(0, list(range(10, 30)), params, seed=0)
    scheduler.add_request(1, list(range(40, 60)), params, seed=1)
    held = scheduler.waiting.popleft()  # request 0 waits out of the queue (its grammar compiling)
    outputs = scheduler.step()
    scheduler.waiting.append(held)
    while scheduler.has_work and not preempted:
        outputs += scheduler.step()
    assert scheduler.admissions >= 2 and preempted[0] == 1, preempted


def replace_priority(params: SamplingParams) -> SamplingParams:
    import msgspec

    return msgspec.structs.replace(params, priority=0)
