"""Sliding-window attention (Mistral, Phi-3, Qwen2's upper layers, Gemma 3's local layers): a windowed layer attends to
its token and the window - 1 before it. test_vs_transformers checks logits and tokens at TP 1 and 2 on tiny windowed
models; here the scheduler's paths that cut a sequence differently: chunked prefill, the radix cache's reused prefixes,
preemption in a small pool, and decode batches of sequences on both sides of the window. The attention kernels
themselves: tests/attention (torch masks, the Triton decode kernel), tests/gpu/test_sliding_window_gpu.py (FlashInfer
and CUDA graphs)."""

from __future__ import annotations

import pytest

from reference import hf_greedy
from tpserve import LLM, SamplingParams

WINDOW = 8


@pytest.fixture(scope="module")
def windowed_dir(tiny_model_factory):
    return tiny_model_factory("qwen2", sliding_window=WINDOW)  # layer 0 whole context, layer 1 within 8 tokens


def prompts() -> list[list[int]]:
    """Shared prefixes (reused by the radix cache) of lengths on both sides of the window, and a long prompt."""
    stem = list(range(40, 70))
    return [stem[:5] + [7], stem[:20] + [9, 11], stem + [3], stem[:20] + [13], list(range(100, 160)), [5, 6]]


@pytest.mark.parametrize("engine", [
    {"chunked_prefill_size": 5},  # prompts cut into chunks shorter than the window
    {"cache": "radix", "max_total_tokens": 96, "chunked_prefill_size": 7},  # prefixes reused, requests preempted
])
def test_window_across_chunks_cached_prefixes_and_preemption(windowed_dir, engine):
    greedy = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    with LLM(windowed_dir, device="cpu", page_size=4, **engine) as llm:
        first = llm.generate(prompts(), greedy, use_tqdm=False)
        again = llm.generate(prompts(), greedy, use_tqdm=False)  # from the radix cache where it holds them
        stats = llm.stats()
    expected = [hf_greedy(windowed_dir, p, 14) for p in prompts()]
    assert [o.token_ids for o in first] == expected
    assert [o.token_ids for o in again] == expected
    if engine.get("cache") == "radix":
        assert stats.cached_tokens_total > 0 and stats.preemptions_total > 0, stats


def test_a_window_no_sequence_reaches_is_no_window(windowed_dir):
    """A window at least the context limit never cuts a sequence: its layers plan no window (and keep XQA's decode
    over FP8 pages on a GPU); one token shorter, the window is planned."""
    from tpserve.engine.engine import Engine
    from tpserve.engine_config import EngineConfig

    for max_model_len, per_layer in ((WINDOW, (0, 0)), (WINDOW + 1, (0, WINDOW))):
        engine = Engine(EngineConfig(model=windowed_dir, device="cpu", page_size=4, max_model_len=max_model_len))
        assert engine.model_config.windows_within(max_model_len) == per_layer
        assert engine.attention.windows == sorted(set(per_layer)), max_model_len
