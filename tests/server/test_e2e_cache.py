"""End to end at TP=2 over a deliberately small KV cache: prefix reuse across chat turns,
preemption and eviction under load, 400 for a request larger than the pool while others
proceed, and a flush that returns every page. Ranks are checked to agree every step."""

from __future__ import annotations

import asyncio
import random

import httpx
import openai
import pytest
from server_process import metrics, running_server


@pytest.fixture(scope="module")
def server(qwen3_dir):
    yield from running_server(["--model", qwen3_dir, "--device", "cpu", "--tp-size", "2", "--max-total-tokens", "256",
                               "--page-size", "4", "--max-prefill-tokens", "16", "--cache", "radix",
                               "--debug-check-invariants", "--served-model-name", "tiny"])


def test_second_chat_turn_reuses_the_first(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Describe the old clock tower in the town square."}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And the bells?"}]
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens // 4 * 4 - 4, (cached, first.usage.prompt_tokens)
    assert metrics(server.url)["tpserve_prefix_cache_hit_rate"] > 0


def test_cache_salt_keeps_prefixes_apart(server):
    """vLLM's cache_salt (was ignored): the same prompt hits the cache only under the salt it ran with."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    prompt = [(7 * i) % 500 + 3 for i in range(40)]

    def cached(salt: str | None) -> int:
        extra = {} if salt is None else {"cache_salt": salt}
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=1, extra_body=extra
                                         ).usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0 and cached(None) == 0  # another salt, or none, does not see tenant a's pages
    assert cached("tenant-a") >= 32 and cached(None) >= 32  # each its own


async def _load(url: str) -> tuple[list[int], httpx.Response]:
    rng = random.Random(5)
    shared = [[rng.randrange(3, 600) for _ in range(rng.randint(8, 24))] for _ in range(3)]
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        async def one(i: int) -> int:
            prompt = rng.choice(shared) + [rng.randrange(3, 600) for _ in range(rng.randint(1, 12))]
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 30 + i % 10, "temperature": 0, "ignore_eos": True}
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()["usage"]["completion_tokens"]

        tasks = [asyncio.create_task(one(i)) for i in range(24)]
        await asyncio.sleep(0.5)
        too_big = await client.post("/v1/completions", json={"model": "tiny", "prompt": [5] * 300, "max_tokens": 1})
        return await asyncio.gather(*tasks), too_big


def test_load_over_a_small_pool_then_flush(server):
    before = metrics(server.url)
    counts, too_big = asyncio.run(_load(server.url))
    assert counts == [30 + i % 10 for i in range(24)], "every accepted request completes in full"
    assert too_big.status_code == 400
    assert "more than the context (256)" in too_big.json()["error"]["message"]  # capped at the KV cache
    after = metrics(server.url)
    assert after["tpserve_preemptions_total"] > before.get("tpserve_preemptions_total", 0)
    assert after["tpserve_kv_pages_evicted_total"] > before.get("tpserve_kv_pages_evicted_total", 0)
    assert httpx.post(f"{server.url}/flush_cache").status_code == 200
    # A tiny request afterwards carries fresh scheduler stats to the metrics.
    httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": 1}, timeout=60)
    final = metrics(server.url)
    assert final["tpserve_kv_pages_used"] == 0 and final["tpserve_num_requests_running"] == 0
    assert final["tpserve_kv_pages_cached"] <= 1, "only the last request's own page may stay cached"
