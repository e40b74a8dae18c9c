"""Embedding requests (``SamplingParams.pooling``) in the scheduler: a prefill whose answer is the last prompt
token's final hidden state, computed in chunks, after a cached prefix and beside generating requests."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from reference import hf_embedding

from tpserve.engine.engine import Engine
from tpserve.engine_config import EngineConfig
from tpserve.sampling_params import SamplingParams
from tpserve.scheduler.scheduler import Scheduler

EMBED = SamplingParams(pooling="embed")
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(qwen3_dir):
    # chunks of 8 tokens: a 27-token prompt is embedded over 4 steps
    return Engine(EngineConfig(model=qwen3_dir, device="cpu", page_size=4, chunked_prefill_size=8))


def run(scheduler: Scheduler, requests: dict[int, tuple[list[int], SamplingParams]]):
    for rid, (prompt, params) in requests.items():
        scheduler.add_request(rid, prompt, params, seed=rid)
    outputs = {rid: [] for rid in requests}
    while scheduler.has_work:
        for out in scheduler.step():
            outputs[out.rid].append(out)
    return outputs


def test_embeddings_match_transformers_in_chunks_beside_generation(engine, qwen3_dir):
    long, short = list(range(3, 30)), [5, 6, 7]
    scheduler = Scheduler(engine)
    scheduler.check_accounting = True
    alone = run(scheduler, {9: ([9, 10, 11], GREEDY)})[9]
    outputs = run(scheduler, {1: (long, EMBED), 2: (short, EMBED), 9: ([9, 10, 11], GREEDY)})
    errors = []
    for rid, prompt in ((1, long), (2, short)):
        (out,) = outputs[rid]  # one answer: no tokens, finished
        assert out.token_ids == [] and out.finish_reason == "stop" and out.prompt_tokens == len(prompt)
        vector = torch.from_numpy(np.frombuffer(out.embedding, dtype="<f4").copy())
        errors.append(float((vector - hf_embedding(qwen3_dir, prompt, normalize=False)).abs().max()))
    print(f"embedding max abs error vs transformers: {max(errors):.2e}")
    assert max(errors) < 1e-5
    generated = [t for out in outputs[9] for t in out.token_ids]
    assert generated == [t for out in alone for t in out.token_ids]  # embeddings beside it change nothing
    assert not scheduler.running and scheduler.flush_cache()


def test_an_embedding_after_a_cached_prefix_equals_the_uncached_one(engine):
    prompt = list(range(40, 62))
    first = run(Scheduler(engine), {1: (prompt, EMBED)})[1][0]
    scheduler = Scheduler(engine)
    run(scheduler, {1: (prompt[:17] + [99], GREEDY)})  # leaves 16 tokens (4 pages) of prompt cached
    again = run(scheduler, {2: (prompt, EMBED)})[2][0]
    assert again.cached_tokens == 16 and first.cached_tokens == 0
    assert np.allclose(np.frombuffer(again.embedding, "<f4"), np.frombuffer(first.embedding, "<f4"), atol=1e-5)

