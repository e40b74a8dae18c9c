"""Qwen3-MoE wherever dense models run: offline LLM with the radix cache and chunked prefill, and
the OpenAI server; greedy tokens equal to transformers (float32, CPU)."""

from __future__ import annotations

import httpx
import pytest
from server_process import ServerProcess

from reference import hf_greedy
from tpserve import LLM, SamplingParams

SHARED = list(range(200, 240))  # a 40-token prefix: cached after the first round, chunked at 8 tokens
PROMPTS = [SHARED + [7, 8, 9], SHARED + [11], list(range(50, 63))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def moe_dir(tiny_model_factory) -> str:
    return tiny_model_factory("qwen3_moe", num_layers=3)


def test_radix_cache_and_chunked_prefill(moe_dir):
    expected = [hf_greedy(moe_dir, p, 10) for p in PROMPTS]
    with LLM(moe_dir, device="cpu", page_size=4, cache="radix", chunked_prefill_size=8) as llm:
        first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        before = llm.stats().cached_tokens_total
        again = llm.generate(PROMPTS[::-1], GREEDY, use_tqdm=False)
        assert llm.stats().cached_tokens_total - before >= 2 * len(SHARED), "the prefixes should come from the cache"
    assert [o.token_ids for o in first] == expected
    assert [o.token_ids for o in again] == expected[::-1]


def test_server_completions(moe_dir):
    """The server's text is the offline engine's (whose tokens are transformers')."""
    with LLM(moe_dir, device="cpu", page_size=4) as llm:
        expected = [o.text for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert all(expected)
    srv = ServerProcess(["--model", moe_dir, "--device", "cpu", "--page-size", "4", "--served-model-name", "tiny"])
    try:
        srv.wait_ready()
        for prompt, text in zip(PROMPTS, expected):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
            response = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == text
    finally:
        srv.stop()
