"""End to end: a real server (real scheduler, tiny random model, CPU) driven by the official
``openai`` client. One server per TP size (1 and 2) for the whole module."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from server_process import ABORTED, metrics, metrics_after_an_abort, running_server

API_KEY = "test-key"
GREEDY = {"temperature": 0}
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def adapter_dir(qwen3_dir, tmp_path_factory) -> str:
    """A LoRA adapter of every projection, made by PEFT (tests/lora_adapters.py)."""
    from lora_adapters import make_adapter

    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    return make_adapter(qwen3_dir, str(tmp_path_factory.mktemp("lora")), targets)


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def server(qwen3_dir, adapter_dir, request):
    yield from running_server(["--model", qwen3_dir, "--device", "cpu", "--api-key", API_KEY, "--tp-size", str(request.param),
                             "--served-model-name", "tiny", "--num-tokenizers", "2", "--lora-modules", f"sql={adapter_dir}"])


@pytest.fixture(scope="module")
def url(server) -> str:
    return server.url


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(qwen3_dir):
    from tpserve.tokenizer.loader import load_tokenizer

    return load_tokenizer(qwen3_dir)


def metric(url: str, name: str) -> float:
    return metrics(url).get(name, 0.0)


def chat_stream(client, **kwargs):
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return chunks, text, finish, chunks[-1].usage


MESSAGES = [{"role": "user", "content": "Tell me about the clockmaker 你好"}]


def test_models_and_health(client, url):
    assert [m.id for m in client.models.list().data] == ["tiny", "sql"]  # the model, then its LoRA adapter
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/version").json()["version"]


def test_chat_stream_equals_non_stream(client, tokenizer):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=24, seed=7, extra_body=IGNORE_EOS)
    full = client.chat.completions.create(**kwargs)
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    chunks, text, finish, usage = chat_stream(client, **kwargs)
    assert text == choice.message.content
    assert finish == ["length"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)
    prompt_ids = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    n_prompt = len(tokenizer.encode(prompt_ids, add_special_tokens=False))
    for u in (full.usage, usage):
        assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (n_prompt, 24, n_prompt + 24)
        assert u.prompt_tokens_details.cached_tokens >= 0


def test_seeded_sampling_is_reproducible(client):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=16, temperature=1.0, seed=1234, extra_body=IGNORE_EOS)
    a = client.chat.completions.create(**kwargs).choices[0].message.content
    b = client.chat.completions.create(**kwargs).choices[0].message.content
    assert a == b


def test_enable_thinking_changes_the_prompt(client):
    base = dict(model="tiny", messages=MESSAGES, max_tokens=1)
    plain = client.chat.completions.create(**base).usage.prompt_tokens
    no_think = client.chat.completions.create(
        **base, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).usage.prompt_tokens
    assert no_think > plain


def test_completions_text_ids_and_lists(client, tokenizer):
    prompt = "Once upon a time"
    ids = tokenizer.encode(prompt)
    kwargs = dict(model="tiny", max_tokens=12, extra_body=IGNORE_EOS, **GREEDY)
    by_text = client.completions.create(prompt=prompt, **kwargs)
    assert by_text.object == "text_completion" and by_text.id.startswith("cmpl-")
    by_ids = client.completions.create(prompt=ids, **kwargs)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_text.usage.prompt_tokens == len(ids) and by_text.usage.completion_tokens == 12
    other = "The quick brown fox"
    many = client.completions.create(prompt=[prompt, other], **kwargs)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == by_text.choices[0].text
    single_other = client.completions.create(prompt=other, **kwargs).choices[0].text
    assert many.choices[1].text == single_other
    lists = client.completions.create(prompt=[ids, tokenizer.encode(other)], **kwargs)
    assert [c.text for c in lists.choices] == [c.text for c in many.choices]
    assert many.usage.completion_tokens == 24
    streamed = {0: "", 1: ""}
    for chunk in client.completions.create(prompt=[prompt, other], stream=True, **kwargs):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == {0: many.choices[0].text, 1: many.choices[1].text}


def test_return_tokens_as_token_ids(client, tokenizer):
    """vLLM's return_tokens_as_token_ids (RL trainers read the sampled ids from the logprobs): every token and
    alternative is "token_id:N", the ids decode to the text, and the sampled token is the top alternative (greedy)."""
    prompt = "Once upon a time"
    kwargs = dict(model="tiny", max_tokens=8, extra_body={**IGNORE_EOS, "return_tokens_as_token_ids": True}, **GREEDY)
    legacy = client.completions.create(prompt=prompt, logprobs=2, **kwargs).choices[0]
    ids = [int(t.removeprefix("token_id:")) for t in legacy.logprobs.tokens]
    assert len(ids) == 8 and tokenizer.decode(ids) == legacy.text
    assert all(max(top, key=top.get) == f"token_id:{i}" for top, i in zip(legacy.logprobs.top_logprobs, ids))
    chat = client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=2, **kwargs).choices[0]
    ids = [int(e.token.removeprefix("token_id:")) for e in chat.logprobs.content]
    assert tokenizer.decode(ids) == chat.message.content
    assert all(e.top_logprobs[0].token == e.token for e in chat.logprobs.content)


def test_stop_strings(client):
    kwargs = dict(model="tiny", prompt="Weather report: Monday", max_tokens=40, extra_body=IGNORE_EOS, **GREEDY)
    text = client.completions.create(**kwargs).choices[0].text
    # a 3-character stop string from the middle of the output
    stop = next(text[i : i + 3] for i in range(len(text) // 3, len(text) - 3)
                if "\ufffd" not in text[i : i + 3] and text[i : i + 3].strip())
    expected = text[: text.find(stop)]
    cut = client.completions.create(stop=[stop, "never-generated-xyz"], **kwargs)
    assert cut.choices[0].text == expected and cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < 40
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=stop, stream=True, **kwargs)
                       if c.choices)
    assert streamed == expected


def test_matches_offline_llm_and_transformers(client, qwen3_dir, tokenizer):
    from reference import hf_greedy
    from tpserve import LLM, SamplingParams

    ids = tokenizer.encode("A serving engine keeps many requests")
    served = client.completions.create(model="tiny", prompt=ids, max_tokens=16, extra_body=IGNORE_EOS, **GREEDY)
    hf_text = tokenizer.decode(hf_greedy(qwen3_dir, ids, 16), skip_special_tokens=True)
    assert served.choices[0].text == hf_text
    sampled = client.completions.create(model="tiny", prompt=ids, max_tokens=16, temperature=0.8, seed=99,
                                        extra_body=IGNORE_EOS)
    with LLM(qwen3_dir, device="cpu") as llm:
        offline = llm.generate([ids], SamplingParams(temperature=0.8, seed=99, max_tokens=16, ignore_eos=True),
                               use_tqdm=False)[0]
    assert sampled.choices[0].text == offline.text


def test_32_concurrent_streams(url, client):
    prompts = [f"Question {i}: what is the capital of France?" for i in range(32)]
    kwargs = dict(model="tiny", max_tokens=16, extra_body=IGNORE_EOS, **GREEDY)
    expected = {p: client.completions.create(prompt=p, **kwargs).choices[0].text for p in prompts[:4]}

    async def one(aclient, prompt):
        text, finish, usage = "", None, None
        stream = await aclient.completions.create(prompt=prompt, stream=True,
                                                  stream_options={"include_usage": True}, **kwargs)
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage
        return text, finish, usage

    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))
        finally:
            await aclient.close()

    results = asyncio.run(main())
    assert all(finish == "length" and usage.completion_tokens == 16 for _, finish, usage in results)
    for p, (text, _, _) in zip(prompts, results, strict=True):
        if p in expected:
            assert text == expected[p]


def test_client_disconnect_aborts(url):
    before = metric(url, 'tpserve_requests_finished_total{finish_reason="abort"}')
    # ~4000 tokens: many seconds of work, unless the abort frees the request at once
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        for _ in range(5):
            next(lines)
    # the server saw the disconnect and the scheduler freed the request
    for _ in range(100):
        aborted = metric(url, 'tpserve_requests_finished_total{finish_reason="abort"}')
        if aborted > before and metric(url, "tpserve_num_requests_running") == 0:
            break
        time.sleep(0.1)
    assert aborted == before + 1
    assert metric(url, "tpserve_client_disconnects_total") >= 1
    assert metric(url, "tpserve_num_requests_running") == 0
    assert metric(url, "tpserve_kv_pages_used") == 0


def test_client_timeout_on_non_streaming_request_aborts(url):
    before = metric(url, 'tpserve_requests_finished_total{finish_reason="abort"}')
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=0.5)
    assert metrics_after_an_abort(url, before)[ABORTED] == before + 1
    assert metric(url, "tpserve_num_requests_running") == 0


@pytest.mark.parametrize(
    "path, body, status, fragment",
    [
        ("/v1/completions", {"prompt": "word " * 5000, "max_tokens": 1}, 400, "context length"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 5000}, 400, "context length"),
        ("/v1/completions", {"prompt": [1, 2, 10**6]}, 400, "out of range"),
        ("/v1/completions", {"prompt": "hi", "suffix": "!"}, 400, "suffix"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 99}, 400, "n must be at most"),
        ("/v1/chat/completions", {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}, 404, "gpt-4o"),
        ("/v1/chat/completions", {"messages": "nope"}, 400, "messages"),
    ],
)
def test_bad_requests_then_still_serving(client, url, path, body, status, fragment):
    resp = httpx.post(f"{url}{path}", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert resp.status_code == status, resp.text
    assert fragment in resp.json()["error"]["message"]
    ok = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_bad_requests_via_openai_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="word " * 5000, max_tokens=1)
    assert "context length" in e.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True, max_tokens=10**6)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=MESSAGES)


@pytest.mark.parametrize("arguments", ['{"n": 123456789012345678901234567890}', '{"q": "\\ud800"}', "not json",
                                       "[" * 1200 + "]" * 1200])  # nested past the JSON parser's depth (1,000)
def test_tool_call_arguments_the_messages_cannot_carry_are_rendered_as_written(client, arguments):
    """A past call's arguments holding an integer past 64 bits or a lone surrogate escape were a 500 (the parsed
    value could not reach the tokenizer worker): every later turn of such a conversation failed."""
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    ok = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_invalid_json(url):
    resp = httpx.post(f"{url}/v1/completions", content=b"{oops", timeout=10,
                      headers={"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"


def test_api_key_required(url):
    bad = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert httpx.get(f"{url}/health").status_code == 200


def test_flush_cache_and_metrics(url, client):
    client.completions.create(model="tiny", prompt="hello", max_tokens=3)
    resp = httpx.post(f"{url}/flush_cache", headers={"Authorization": f"Bearer {API_KEY}"})
    assert resp.status_code == 200
    assert metric(url, "tpserve_prompt_tokens_total") > 0
    assert metric(url, "tpserve_generation_tokens_total") > 0
    assert metric(url, "tpserve_kv_pages_total") > 0
    assert metric(url, "tpserve_time_to_first_token_seconds_count") > 0
    assert metric(url, "tpserve_inter_token_latency_seconds_count") > 0
    # the same series under vLLM's names (its dashboards and autoscalers read them), labelled with the model
    text = httpx.get(f"{url}/metrics").text
    for ours, vllm in (("tpserve_prompt_tokens_total", "vllm:prompt_tokens_total"),
                       ("tpserve_generation_tokens_total", "vllm:generation_tokens_total"),
                       ("tpserve_time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_count")):
        assert f'{vllm}{{model_name="tiny"}} {metric(url, ours)}' in text, vllm
    assert 'vllm:request_success_total{finished_reason="stop",model_name="tiny"}' in text
    assert 'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"}' in text


def test_logprobs_chat_and_completions(client, qwen3_dir):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=8, logprobs=True, top_logprobs=2,
                  extra_body=IGNORE_EOS, **GREEDY)
    full = client.chat.completions.create(**kwargs)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens == 8
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.token == entry.top_logprobs[0].token, "greedy picks the most likely token"
        assert abs(entry.logprob - entry.top_logprobs[0].logprob) < 1e-6 and entry.logprob <= 0
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token  # a partial character's own bytes
        assert entry.top_logprobs[0].bytes == entry.bytes
    streamed = [e for c in client.chat.completions.create(stream=True, **kwargs) if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert plain.choices[0].logprobs is None

    from tpserve import LLM, SamplingParams

    ids = [12, 13, 14, 15]
    served = client.completions.create(model="tiny", prompt=ids, max_tokens=6, logprobs=3, extra_body=IGNORE_EOS,
                                       **GREEDY).choices[0].logprobs
    with LLM(qwen3_dir, device="cpu") as llm:
        offline = llm.generate([ids], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3),
                               use_tqdm=False)[0]
    assert len(served.tokens) == len(served.token_logprobs) == len(served.top_logprobs) == 6
    assert all(abs(a - b) < 1e-4 for a, b in zip(served.token_logprobs, offline.token_logprobs))
    # keyed by token text (the legacy layout), so two byte-piece tokens that both read as U+FFFD merge
    assert all(1 <= len(top) <= 3 for top in served.top_logprobs)
    assert served.text_offset == sorted(served.text_offset) and served.text_offset[0] == 0



def test_completions_echo(client, qwen3_dir):
    import torch

    from reference import hf_logits

    prompts = ["The clockmaker", "你好 world"]
    echoed = client.completions.create(model="tiny", prompt=prompts, max_tokens=3, echo=True, n=2, **GREEDY)
    assert [c.text[: len(prompts[c.index // 2])] for c in echoed.choices] == [p for p in prompts for _ in range(2)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=prompts[0], max_tokens=3, echo=True, stream=True, **GREEDY) if c.choices)
    assert streamed == echoed.choices[0].text

    # With logprobs: the prompt's tokens first (the first without a log-probability), then the completion's.
    ids = [40, 41, 42, 43, 44, 45]
    lp = client.completions.create(model="tiny", prompt=ids, max_tokens=3, echo=True, logprobs=1,
                                   extra_body=IGNORE_EOS, **GREEDY).choices[0].logprobs
    plain = client.completions.create(model="tiny", prompt=ids, max_tokens=3, logprobs=1, extra_body=IGNORE_EOS,
                                      **GREEDY).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = torch.log_softmax(hf_logits(qwen3_dir, ids)[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None])
    assert torch.allclose(torch.tensor(lp.token_logprobs[1 : len(ids)]), ref.squeeze(1), atol=1e-4)
    assert all(abs(a - b) < 1e-4 for a, b in zip(lp.token_logprobs[len(ids):], plain.token_logprobs))
    assert lp.text_offset == sorted(lp.text_offset)
    stream_lp = [t for c in client.completions.create(model="tiny", prompt=ids, max_tokens=3, echo=True, logprobs=1,
                                                      stream=True, extra_body=IGNORE_EOS, **GREEDY)
                 if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert stream_lp == lp.tokens

    # max_tokens 0: the prompt and its log-probabilities alone (lm-eval's older loglikelihood requests)
    scored = client.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=1, **GREEDY)
    assert scored.choices[0].logprobs.tokens == lp.tokens[: len(ids)]
    assert scored.choices[0].logprobs.token_logprobs == lp.token_logprobs[: len(ids)]
    assert scored.choices[0].text == client.completions.create(
        model="tiny", prompt=ids, max_tokens=1, echo=True, **GREEDY).choices[0].text[: len(scored.choices[0].text)]
    assert scored.choices[0].finish_reason == "length" and scored.usage.completion_tokens == 0
    streamed = [c for c in client.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=1,
                                                     stream=True, stream_options={"include_usage": True}, **GREEDY)]
    assert "".join(c.choices[0].text for c in streamed if c.choices) == scored.choices[0].text
    assert streamed[-1].usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError, match="max_tokens 0 needs echo"):
        client.completions.create(model="tiny", prompt=ids, max_tokens=0)

def test_vllm_prompt_logprobs_with_ranks(client, url, tokenizer, qwen3_dir):
    """vLLM's prompt_logprobs (was ignored): completions give each choice, chat the response, per prompt token None
    for the first, then {id: {logprob, rank, decoded_token}} of the token and the k most likely, as transformers
    computes them; echo with logprobs keeps its own count of alternatives; with stream it is a 400, as in vLLM."""
    import torch

    from reference import hf_logits

    ids = [40, 41, 42, 43, 44, 45]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "tiny", "prompt": ids, "max_tokens": 2, "prompt_logprobs": 2, "echo": True, "logprobs": 1}
    choice = httpx.post(f"{url}/v1/completions", headers=headers, json=body).json()["choices"][0]
    shown = choice["prompt_logprobs"]
    logprobs = torch.log_softmax(hf_logits(qwen3_dir, ids)[:-1], dim=-1)
    assert shown[0] is None and len(shown) == len(ids)
    for position, entry in enumerate(shown[1:]):
        row, token = logprobs[position], ids[position + 1]
        mine = entry[str(token)]
        assert abs(mine["logprob"] - float(row[token])) < 1e-4 and mine["decoded_token"] == tokenizer.decode([token])
        assert mine["rank"] == int((row > row[token]).sum()) + 1
        top = row.topk(2).indices.tolist()
        assert all(entry[str(t)]["rank"] == r for r, t in enumerate(top, start=1) if t != token)
        assert set(entry) == {str(token), *map(str, top)}
    legacy = choice["logprobs"]  # echo's logprobs=1: the most likely token, and the token itself where it is another
    assert all(top is None or token in top and len(top) <= 2
               for token, top in zip(legacy["tokens"], legacy["top_logprobs"]))

    chat = httpx.post(f"{url}/v1/chat/completions", headers=headers, json={
        "model": "tiny", "messages": MESSAGES, "max_tokens": 2, "prompt_logprobs": 0}).json()
    prompt = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False)
    assert len(chat["prompt_logprobs"]) == len(prompt) and chat["prompt_logprobs"][0] is None
    assert [list(entry) for entry in chat["prompt_logprobs"][1:]] == [[str(t)] for t in prompt[1:]]
    assert "prompt_logprobs" not in chat["choices"][0]
    for stream_body in ({**body, "stream": True}, {**body, "prompt_logprobs": 21}):
        resp = httpx.post(f"{url}/v1/completions", headers=headers, json=stream_body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt_logprobs"


def test_n_choices(client):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=6, temperature=1.0, seed=11, extra_body=IGNORE_EOS)
    three = client.chat.completions.create(n=3, **kwargs)
    one = client.chat.completions.create(**kwargs)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert three.choices[0].message.content == one.choices[0].message.content, "choice 0 uses the seed itself"
    assert len({c.message.content for c in three.choices}) > 1
    assert three.usage.prompt_tokens == one.usage.prompt_tokens, "the prompt counts once"
    assert three.usage.completion_tokens == 18
    chunks = list(client.chat.completions.create(n=2, stream=True, **kwargs))
    texts = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {i: three.choices[i].message.content for i in (0, 1)}
    done = client.completions.create(model="tiny", prompt=["a b", "c d"], n=2, max_tokens=3, extra_body=IGNORE_EOS,
                                     **GREEDY)
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    assert done.choices[0].text == done.choices[1].text and done.choices[2].text == done.choices[3].text
    # the choices of a prompt are prepared from one tokenization: a prompt too long is each one's 400, and the
    # server goes on serving
    for _ in range(2):
        with pytest.raises(openai.BadRequestError, match="context length"):
            client.completions.create(model="tiny", prompt=["a b", "word " * 5000], n=3, max_tokens=1)
    assert len(client.chat.completions.create(n=2, **kwargs).choices) == 2


def test_embeddings_match_transformers(client, url, tokenizer, qwen3_dir):
    """/v1/embeddings through the official client at TP 1 and 2: each input's vector is transformers' base model's
    final hidden state of its last token, normalized (float32: within 1e-5); base64 carries the same floats;
    ``dimensions`` cuts then normalizes again; a chat request running beside them is unchanged."""
    import base64

    import numpy as np
    import torch
    from reference import hf_embedding

    texts = ["The clockmaker's shop 你好", "tick tock " * 20]
    ids = [tokenizer.encode(t) for t in texts] + [[5, 6, 7]]
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=12, extra_body=IGNORE_EOS, **GREEDY)
    alone = client.chat.completions.create(**kwargs).choices[0].message.content

    async def together():
        aclient = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        chat = aclient.chat.completions.create(**kwargs)
        embedded = aclient.embeddings.create(model="tiny", input=texts)
        return await asyncio.gather(chat, embedded)

    before = metrics(url)
    chat, result = asyncio.run(together())
    assert chat.choices[0].message.content == alone
    by_ids = client.embeddings.create(model="tiny", input=ids[2])
    errors = []
    for item, prompt in zip([*result.data, *by_ids.data], ids):
        expected = hf_embedding(qwen3_dir, prompt)
        errors.append(float((torch.tensor(item.embedding) - expected).abs().max()))
    print(f"embedding max abs error vs transformers: {max(errors):.2e}")
    assert max(errors) < 1e-5
    assert result.usage.prompt_tokens == result.usage.total_tokens == len(ids[0]) + len(ids[1])
    # the embeddings' prompts count as prompt tokens, and they finish "stop" (review: 0 tokens, "length")
    after, stop = metrics(url), 'tpserve_requests_finished_total{finish_reason="stop"}'
    prompt_delta = after["tpserve_prompt_tokens_total"] - before["tpserve_prompt_tokens_total"]
    assert prompt_delta - chat.usage.prompt_tokens == result.usage.prompt_tokens + by_ids.usage.prompt_tokens
    assert after[stop] - before.get(stop, 0.0) >= 3

    raw = httpx.post(f"{url}/v1/embeddings", headers={"Authorization": f"Bearer {API_KEY}"},
                     json={"input": texts[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    # (alone, and over a cached prefix: the sums run in another order than in the batch above)
    assert np.allclose(decoded, np.array(result.data[0].embedding, dtype=np.float32), atol=1e-5)
    cut = client.embeddings.create(model="tiny", input=texts[0], dimensions=8).data[0].embedding
    head = hf_embedding(qwen3_dir, ids[0], normalize=False)[:8]
    assert float((torch.tensor(cut) - head / head.norm()).abs().max()) < 1e-5


def test_embeddings_of_a_conversation_match_transformers(url, tokenizer, qwen3_dir):
    """vLLM's ``messages`` on /v1/embeddings: the conversation rendered by the chat template (no generation prompt),
    embedded as one prompt."""
    from reference import hf_embedding

    messages = [{"role": "user", "content": "where is the clockmaker"}, {"role": "assistant", "content": "here"}]
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
    body = httpx.post(f"{url}/v1/embeddings", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"messages": messages}, timeout=60).json()
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["data"][0]["embedding"] == pytest.approx(hf_embedding(qwen3_dir, ids).tolist(), abs=1e-5)


def test_score_and_rerank_match_transformers_cosines(url, tokenizer, qwen3_dir):
    """vLLM's score and rerank APIs for an embedding model: the cosine of transformers' normalized last-token hidden
    states, documents ranked by it."""
    from reference import hf_embedding

    headers = {"Authorization": f"Bearer {API_KEY}"}
    query, documents = "where is the clockmaker", ["the clockmaker's shop", "tick tock", "你好 world"]
    embed = {t: hf_embedding(qwen3_dir, tokenizer.encode(t)) for t in [query, *documents]}
    expected = [float(embed[query] @ embed[d]) for d in documents]
    scores = httpx.post(f"{url}/v1/score", headers=headers, json={"text_1": query, "text_2": documents}).json()
    assert [d["score"] for d in scores["data"]] == pytest.approx(expected, abs=1e-5)
    ranked = httpx.post(f"{url}/v1/rerank", headers=headers, json={"query": query, "documents": documents}).json()
    assert [r["index"] for r in ranked["results"]] == sorted(range(3), key=lambda i: expected[i], reverse=True)
    assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx(sorted(expected, reverse=True), abs=1e-5)


def test_embeddings_errors_are_400s(client):
    with pytest.raises(openai.BadRequestError, match="the input has 5001 tokens, but this model's context length"):
        client.embeddings.create(model="tiny", input="x " * 5000)
    with pytest.raises(openai.BadRequestError, match="dimensions must be in"):
        client.embeddings.create(model="tiny", input="hi", dimensions=100_000)
    with pytest.raises(openai.BadRequestError, match="out of range"):
        client.embeddings.create(model="tiny", input=[[10**6]])


def test_beam_search_matches_transformers(client, url, qwen3_dir):
    """vLLM's use_beam_search: the n choices are the n best beams, the same as transformers' num_beams search
    (every beam running max_tokens: ignore_eos), best first, at TP 1 and 2; chat answers n beams too, streamed as
    one chunk each; fields a beam search does not apply are a 400 naming them."""
    from reference import hf_beam_search

    prompt = [5, 6, 7, 8]
    done = client.completions.create(model="tiny", prompt=prompt, n=3, max_tokens=5, logprobs=1, extra_body={
        "use_beam_search": True, "ignore_eos": True, "length_penalty": 0.0, "return_tokens_as_token_ids": True})
    beams = [[int(t.removeprefix("token_id:")) for t in c.logprobs.tokens] for c in done.choices]
    assert beams == [tokens for tokens, _ in hf_beam_search(qwen3_dir, prompt, beams=3, max_new_tokens=5)]
    assert [c.finish_reason for c in done.choices] == ["length"] * 3 and done.usage.completion_tokens == 15
    assert done.usage.prompt_tokens == len(prompt)
    # a prompt whose beams take ids of the model's vocabulary past the tokenizer's (its padding rows: 642-703 here):
    # the steps take them back as the model gave them, and each prompt of a call is searched on its own
    other = [40, 41, 42]
    both = client.completions.create(model="tiny", prompt=[prompt, other], n=2, max_tokens=3, logprobs=1, extra_body={
        "use_beam_search": True, "ignore_eos": True, "length_penalty": 0.0, "return_tokens_as_token_ids": True})
    beams = [[int(t.removeprefix("token_id:")) for t in c.logprobs.tokens] for c in both.choices]
    expected = [tokens for p in (prompt, other)
                for tokens, _ in hf_beam_search(qwen3_dir, p, beams=2, max_new_tokens=3)]
    assert beams == expected and any(t >= 642 for beam in beams for t in beam), beams
    assert both.usage.prompt_tokens == len(prompt) + len(other) and both.usage.completion_tokens == 12
    kwargs = dict(model="tiny", messages=MESSAGES, n=2, max_tokens=4, extra_body={"use_beam_search": True})
    whole = client.chat.completions.create(**kwargs)
    assert len(whole.choices) == 2 and whole.choices[0].message.content != whole.choices[1].message.content
    texts = {0: "", 1: ""}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {i: whole.choices[i].message.content for i in (0, 1)}
    for extra, param in (({"stop": ["x"]}, "stop"), ({"top_k": 5}, "top_k"), ({"n": 11}, "n")):
        resp = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"prompt": "hi", "use_beam_search": True, **extra})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_lora_adapter_served_by_its_name(client, url, qwen3_dir, adapter_dir):
    """--lora-modules: a request whose model names the adapter runs with it (PEFT's greedy tokens, at TP 1 and 2),
    one naming the model without; the answer names what served it; /v1/models lists the adapter with the model as
    its parent; a pooling endpoint refuses it."""
    from lora_adapters import peft_greedy
    from reference import hf_greedy

    prompt = [5, 6, 7, 8, 9]
    kwargs = dict(prompt=prompt, max_tokens=6, logprobs=0, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
                  **GREEDY)
    adapted = client.completions.create(model="sql", **kwargs)
    base = client.completions.create(model="tiny", **kwargs)
    tokens = lambda out: [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]  # noqa: E731
    assert tokens(adapted) == peft_greedy(qwen3_dir, adapter_dir, prompt, 6)[0] and adapted.model == "sql"
    assert tokens(base) == hf_greedy(qwen3_dir, prompt, 6) and base.model == "tiny"
    chat = client.chat.completions.create(model="sql", messages=MESSAGES, max_tokens=3)
    assert chat.model == "sql" and chat.choices[0].message.content is not None
    cards = {m.id: m for m in client.models.list().data}
    assert cards["sql"].parent == "tiny" and cards["sql"].root == adapter_dir
    resp = httpx.post(f"{url}/v1/embeddings", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"model": "sql", "input": "hi"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "model"
