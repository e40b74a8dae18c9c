"""The HTTP layer in-process (FastAPI TestClient + a stub backend): validation, error bodies,
auth, readiness, response and stream formats."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient
from stub_frontend import StubFrontend
from tpserve.engine_config import EngineConfig
from tpserve.server.api import AppState, create_app
from tpserve.launch.args import ServerArgs
from tpserve.server.limits import RequestLimits
from tpserve.parsers.constraints import template_tools
from tpserve.server.serving import Serving

MODEL = "tiny-test"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


LIMITS = RequestLimits(context_len=128, max_sequences=64)


def make_client(api_key: str | None = None, ready: bool = True, stub: StubFrontend | None = None,
                max_request_bytes: int = 1 << 20, **serving):
    args = ServerArgs(engine=EngineConfig(model="/nonexistent"), served_model_name=MODEL,
                      context_len=128, vocab_size=700, api_key=api_key, max_request_bytes=max_request_bytes)
    state = AppState(args)
    stub = stub or StubFrontend()
    if ready:
        state.serving = Serving(stub, state.metrics, MODEL, LIMITS, **serving)  # type: ignore[arg-type]
    return TestClient(create_app(state)), stub


@pytest.fixture()
def client():
    c, _ = make_client()
    return c


def assert_error(resp, status, fragment=None, param=None):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    if fragment:
        assert fragment in body["error"]["message"]
    if param:
        assert body["error"]["param"] == param
    return body["error"]


def sse_events(resp):
    events = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# ---- readiness, auth, admin endpoints ----
def test_not_ready_is_503():
    c, _ = make_client(ready=False)
    assert_error(c.get("/health"), 503)
    assert c.head("/health").status_code == 503
    assert c.get("/ping").status_code == c.post("/ping").status_code == 503
    err = assert_error(c.post(CHAT, json={"messages": USER}), 503)
    assert err["code"] == "not_ready"
    assert c.get("/version").status_code == 200


def test_health_version_metrics(client):
    assert client.get("/health").json() == {"status": "ok"}
    assert client.head("/health").status_code == 200  # load balancers probe with HEAD too
    assert client.get("/ping").json() == client.post("/ping").json() == {"status": "ok"}  # vLLM's (SageMaker's)
    assert "version" in client.get("/version").json()
    text = client.get("/metrics").text
    for name in ("tpserve_num_requests_running", "tpserve_num_requests_waiting", "tpserve_kv_pages_used",
                 "tpserve_kv_pages_total", "tpserve_prompt_tokens_total", "tpserve_generation_tokens_total",
                 "tpserve_time_to_first_token_seconds", "tpserve_inter_token_latency_seconds"):
        assert name in text


def test_api_key():
    c, _ = make_client(api_key="sekret")
    err = assert_error(c.get("/v1/models"), 401)
    assert err["code"] == "invalid_api_key"
    assert_error(c.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(c.post(CHAT, json={"messages": USER}), 401)
    assert c.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
    assert c.get("/health").status_code == 200  # not behind the key
    assert_error(c.post("/flush_cache"), 401)
    assert_error(c.post("/reset_prefix_cache"), 401)


def test_models(client):
    body = client.get("/v1/models").json()
    assert body["object"] == "list" and body["data"][0]["id"] == MODEL
    assert body["data"][0]["max_model_len"] == 128
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert_error(client.get("/v1/models/other"), 404)


def test_flush_cache():
    c, stub = make_client()
    assert c.post("/flush_cache").status_code == 200
    assert c.post("/reset_prefix_cache").status_code == 200  # vLLM's name for it
    assert stub.flushes == 2


# ---- validation ----
@pytest.mark.parametrize(
    "path, body, fragment, param",
    [
        (CHAT, {"messages": []}, None, "messages"),
        (CHAT, {}, "missing required parameter 'messages'", "messages"),
        (CHAT, {"messages": USER, "n": 17}, "n must be at most 16", "n"),
        (CHAT, {"messages": USER, "top_logprobs": 2}, "needs logprobs: true", "top_logprobs"),
        (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs must be in", "top_logprobs"),
        (CHAT, {"messages": USER, "presence_penalty": 2.5}, "presence_penalty", "presence_penalty"),
        (CHAT, {"messages": USER, "frequency_penalty": -3}, "frequency_penalty", "frequency_penalty"),
        (CHAT, {"messages": USER, "repetition_penalty": 0}, "repetition_penalty", "repetition_penalty"),
        (CHAT, {"messages": USER, "logit_bias": {"x": 1}}, "token ids", "logit_bias"),
        # what int() would read as 10: an underscore, spaces, other scripts' digits
        *[(COMPLETIONS, {"prompt": "x", "logit_bias": {key: 1}}, "token ids", "logit_bias")
          for key in ("1_0", " 10 ", "\u0661\u0660", "-1", "+1")],
        (CHAT, {"messages": USER, "logit_bias": {"5": 101}}, "logit_bias", "logit_bias"),
        (CHAT, {"messages": USER, "min_tokens": 9, "max_tokens": 3}, "min_tokens", "min_tokens"),
        (CHAT, {"messages": USER, "temperature": -1}, None, "temperature"),
        (CHAT, {"messages": USER, "top_p": 0}, None, "top_p"),
        (CHAT, {"messages": USER, "top_k": -2}, None, "top_k"),
        (CHAT, {"messages": USER, "min_p": 2}, None, "min_p"),
        (CHAT, {"messages": USER, "max_tokens": 0}, None, "max_tokens"),
        (CHAT, {"messages": USER, "seed": -1}, "seed", "seed"),
        (CHAT, {"messages": USER, "stop": 5}, "stop must be a string or a list of strings", "stop"),
        (CHAT, {"messages": USER, "stop": [""]}, "empty", "stop"),
        (CHAT, {"messages": USER, "stop": [f"s{i}" for i in range(17)]}, "stop may hold at most 16 strings, got 17", "stop"),
        (COMPLETIONS, {"prompt": "x", "stop": ["a", "b" * 513]}, "at most 512 characters, got 513 (stop[1])", "stop"),
        (CHAT, {"messages": USER, "stop_token_ids": list(range(257))}, "stop_token_ids may hold at most 256 token ids",
         "stop_token_ids"),
        (CHAT, {"messages": USER, "tools": [{"type": "function"}]}, "tools[0]", "tools"),
        (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]},
         "--tool-call-parser", "tools"),
        (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}}}, "'g'", "tool_choice"),
        (CHAT, {"messages": USER, "tool_choice": "required"}, "needs tools", "tool_choice"),
        (CHAT, {"messages": USER, "response_format": {"type": "xml"}}, "response_format", "response_format"),
        (CHAT, {"messages": USER, "response_format": {"type": "json_object"}, "regex": "a+"}, "only one", "regex"),
        (CHAT, {"messages": USER, "regex": ""}, "regex must not be empty", "regex"),
        (COMPLETIONS, {"prompt": "x", "ebnf": ""}, "ebnf must not be empty", "ebnf"),
        (CHAT, {"messages": USER, "stream_options": {"include_usage": True}}, "stream=true", None),
        (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, None, None),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "messages[0].content: image_url content is not supported", "messages"),
        (CHAT, {"messages": USER, "max_tokens": 5, "max_completion_tokens": 6}, "not both", None),
        (COMPLETIONS, {"prompt": "x", "best_of": 2}, "best_of", "best_of"),
        (COMPLETIONS, {"prompt": "x", "logprobs": 21}, "logprobs must be in", "logprobs"),
        (COMPLETIONS, {"prompt": "x", "suffix": "y"}, "suffix", "suffix"),
        (COMPLETIONS, {"prompt": []}, "empty", "prompt"),
        (COMPLETIONS, {"prompt": [[1, 2], []]}, "empty", "prompt"),
        # a value matching no member of a union: one message naming the field and what it may be
        (COMPLETIONS, {"prompt": [1, "a"]},
         "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists", "prompt"),
        (COMPLETIONS, {"prompt": {"text": "a"}}, "prompt must be a string", "prompt"),
        (CHAT, {"messages": [{"role": "user", "content": 42}]}, "messages.0.content must be a string or a list",
         "messages.0.content"),
        (CHAT, {"messages": USER, "tool_choice": 5}, "tool_choice must be a string or an object", "tool_choice"),
        (COMPLETIONS, {}, "missing required parameter 'prompt'", "prompt"),
        # types as OpenAI checks them: no string, bool or float where an integer goes, nor a string as a bool
        (CHAT, {"messages": USER, "max_tokens": True}, "max_tokens", "max_tokens"),
        (CHAT, {"messages": USER, "n": "2"}, "n", "n"),
        (CHAT, {"messages": USER, "stream": "yes"}, "stream", "stream"),
        (CHAT, {"messages": USER, "temperature": "0.5"}, "temperature", "temperature"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": 4.0}, "max_tokens", "max_tokens"),
        (COMPLETIONS, {"prompt": "x", "logprobs": True}, "logprobs", "logprobs"),
        # a token id past 64 bits arrives as a string key: a 400, not a failure to pass it to the ranks
        (CHAT, {"messages": USER, "logit_bias": {str(10**23): 1}}, "logit_bias", "logit_bias"),
        (CHAT, {"messages": USER, "allowed_token_ids": []}, "allowed_token_ids must not be empty", "allowed_token_ids"),
        (COMPLETIONS, {"prompt": "x", "allowed_token_ids": [-3]}, "allowed_token_ids", "allowed_token_ids"),
        (CHAT, {"messages": USER, "allowed_token_ids": ["5"]}, None, "allowed_token_ids.0"),
        (CHAT, {"messages": USER, "bad_words": [" "]}, "bad_words must not be empty", "bad_words"),
        (COMPLETIONS, {"prompt": "x", "bad_words": "word"}, None, "bad_words"),
        (CHAT, {"messages": USER, "allowed_token_ids": [1], "regex": "a+"}, "cannot be combined with structured output",
         "allowed_token_ids"),
    ],
)
def test_bad_requests_are_400(client, path, body, fragment, param):
    assert_error(client.post(path, json=body), 400, fragment, param)


def test_invalid_json_is_400(client):
    err = assert_error(client.post(CHAT, content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert "invalid JSON body at character 1" in err["message"]
    assert err["param"] is None  # a character position is not a parameter


def test_a_body_without_content_type_is_read_as_json(client):
    # requests.post(url, data=json.dumps(body)) sends no Content-Type; FastAPI's strict default refused it
    raw = json.dumps({"messages": USER, "max_tokens": 2}).encode()
    resp = client.post(CHAT, content=raw)
    assert resp.status_code == 200, resp.text
    assert resp.json()["object"] == "chat.completion"


@pytest.mark.parametrize(
    "raw, content_type, fragment",
    [
        (b"", "application/json", "the request body is empty"),
        (b'"a string"', "application/json", "the request body must be a JSON object"),
        (b"[1, 2]", "application/json", "the request body must be a JSON object"),
        (b'{"messages": []}', "application/x-www-form-urlencoded", "Content-Type: application/json"),
        (b'{"prompt": "\xff"}', "application/json", "not valid UTF-8"),
        (b"[" * 5000 + b"]" * 5000, "application/json", "nested too deeply"),
    ],
)
def test_bodies_that_are_no_json_object_say_so(client, raw, content_type, fragment):
    err = assert_error(client.post(CHAT, content=raw, headers={"content-type": content_type}), 400, fragment)
    assert err["code"] == "invalid_request" and err["param"] is None


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "description": "d" * 5000}}], "tool_choice": "none"},
         "tools"),
        ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": "' + "x" * 5000 + '"}'}}]},
            *USER]}, "messages"),
        ({"chat_template_kwargs": {"extra": "x" * 5000}}, "chat_template_kwargs"),
    ],
)
def test_chat_text_beyond_the_context_is_refused_before_tokenizing(body, param):
    """Everything the chat template renders counts toward the character limit (4096 here), not
    only the message contents."""
    c, stub = make_client()
    err = assert_error(c.post(CHAT, json={"messages": USER, **body}), 400, "characters", param)
    assert err["code"] == "invalid_request" and not stub.submitted


def test_unknown_model_is_404(client):
    err = assert_error(client.post(CHAT, json={"model": "gpt-4", "messages": USER}), 404, "gpt-4")
    assert err["code"] == "model_not_found"


def test_unknown_route_has_openai_error_body(client):
    assert_error(client.get("/v1/nothing"), 404)


def test_backend_rejection_is_400(client):
    assert_error(client.post(COMPLETIONS, json={"prompt": "REJECT me"}), 400, "too long", "prompt")
    resp = client.post(COMPLETIONS, json={"prompt": "REJECT me", "stream": True})
    assert_error(resp, 400, "too long")


def test_rejection_aborts_the_other_prompts():
    c, stub = make_client()
    assert_error(c.post(COMPLETIONS, json={"prompt": ["fine", "REJECT"]}), 400)


def test_a_rejected_prompt_counts_each_choice_and_aborts_none_of_them():
    c, stub = make_client()
    assert_error(c.post(COMPLETIONS, json={"prompt": "REJECT", "n": 3}), 400)
    assert stub.aborted == []  # the scheduler never saw them
    assert "tpserve_requests_rejected_total 3.0" in c.get("/metrics").text


def metric(client, sample: str) -> float:
    """The value of one sample line of /metrics (0 where the sample is not there yet)."""
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


def test_skip_special_tokens_travels_in_the_sampling_params():
    c, stub = make_client()
    for path, body in ((CHAT, {"messages": USER}), (COMPLETIONS, {"prompt": "hi"}), ("/v1/responses", {"input": "hi"})):
        assert c.post(path, json={**body, "skip_special_tokens": False}).status_code == 200, path
        assert stub.submitted[-1].params.skip_special_tokens is False, path
    assert c.post(CHAT, json={"messages": USER}).status_code == 200
    assert stub.submitted[-1].params.skip_special_tokens is True


def test_echo_with_max_tokens_0_counts_its_prompt_and_no_generated_token():
    c, stub = make_client(stub=StubFrontend(pieces=1, finish="stop"))
    body = c.post(COMPLETIONS, json={"prompt": "hi", "echo": True, "max_tokens": 0}).json()
    assert body["usage"]["completion_tokens"] == 0 and body["choices"][0]["finish_reason"] == "length"
    assert metric(c, 'tpserve_requests_finished_total{finish_reason="length"}') == 1  # as the response says
    assert metric(c, 'tpserve_requests_finished_total{finish_reason="stop"}') == 0
    assert metric(c, "tpserve_generation_tokens_total") == 0  # the hidden token: counted before
    assert metric(c, "tpserve_time_to_first_token_seconds_count") == 0
    assert metric(c, "tpserve_prompt_tokens_total") == stub.prompt_tokens


def test_http_responses_count_every_status_those_the_tokenizer_never_sees_included():
    c, _ = make_client(max_request_bytes=4096)
    assert c.post(COMPLETIONS, json={"prompt": "hi"}).status_code == 200
    assert_error(c.post(COMPLETIONS, json={"prompt": "hi", "temperature": -1}), 400)
    assert_error(c.post(COMPLETIONS, json={"prompt": "hi", "model": "other"}), 404)
    assert c.post(COMPLETIONS, content=b"x" * 5000).status_code == 413
    assert metric(c, 'tpserve_http_responses_total{status="200"}') == 1
    assert metric(c, 'tpserve_http_responses_total{status="400"}') == 1
    assert metric(c, 'tpserve_http_responses_total{status="404"}') == 1
    assert metric(c, 'tpserve_http_responses_total{status="413"}') == 1
    assert metric(c, "tpserve_requests_rejected_total") == 0  # prompts the tokenizer refused only
    for reason in ("stop", "length", "abort", "error"):  # every finish reason's series, before any such finish
        assert f'tpserve_requests_finished_total{{finish_reason="{reason}"}}' in c.get("/metrics").text


# ---- accepted requests ----
def test_chat_response_schema():
    c, stub = make_client()
    body = c.post(CHAT, json={"model": MODEL, "messages": USER, "max_tokens": 7, "temperature": 0,
                              "stop": "x", "seed": 3, "user": "u", "presence_penalty": 0,
                              "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == MODEL and isinstance(body["created"], int)
    choice = body["choices"][0]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert choice["message"] == {"role": "assistant", "content": "Hello 你好!", "refusal": None}
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                             "completion_tokens_details": {"reasoning_tokens": 0},
                             "prompt_tokens_details": {"cached_tokens": 0}}
    req = stub.submitted[0]
    assert req.params.max_tokens == 7 and req.params.temperature == 0 and req.params.stop == ["x"]
    assert req.params.seed == 3 and req.chat_template_kwargs == {"enable_thinking": False}
    assert req.messages == [{"role": "user", "content": "hi"}]


def test_chat_defaults_and_content_parts():
    c, stub = make_client()
    parts = [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
             {"role": "user", "content": "q"}]
    assert c.post(CHAT, json={"messages": parts, "max_completion_tokens": 4}).status_code == 200
    req = stub.submitted[0]
    assert req.messages[0] == {"role": "system", "content": "a\nb"}  # one line a part, as vLLM (were run together)
    assert req.params.max_tokens == 4 and req.params.seed is None
    assert c.post(CHAT, json={"messages": USER, "truncate_prompt_tokens": 5}).status_code == 200
    assert stub.submitted[-1].params.truncate_prompt_tokens == 5  # vLLM's (was ignored)
    assert_error(c.post(CHAT, json={"messages": USER, "truncate_prompt_tokens": 0}), 400, "must be >= 1 or -1",
                 "truncate_prompt_tokens")
    # echo returns the prompt as sent, which a truncated prompt is not
    assert_error(c.post("/v1/completions", json={"prompt": "abcdef", "echo": True, "truncate_prompt_tokens": 2}), 400,
                 "cannot be combined with truncate_prompt_tokens", "truncate_prompt_tokens")


def test_echo_leads_the_content_with_the_continued_assistant_message():
    """vLLM's chat echo (was ignored): a last assistant message (continue_final_message) starts each choice's content,
    whole and streamed; after a user message it echoes nothing."""
    stub = StubFrontend(reply="42}", finish="stop")
    c, _ = make_client(stub=stub)
    msgs = [*USER, {"role": "assistant", "content": [{"type": "text", "text": "Sure: {"}]}]
    body = {"messages": msgs, "add_generation_prompt": False, "continue_final_message": True, "echo": True, "n": 2}
    choices = c.post(CHAT, json=body).json()["choices"]
    assert [ch["message"]["content"] for ch in choices] == ["Sure: {42}"] * 2
    with c.stream("POST", CHAT, json={**body, "stream": True}) as resp:
        events = [e for e in sse_events(resp) if e["choices"]]
    for index in (0, 1):
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                       if e["choices"][0]["index"] == index) == "Sure: {42}"
    plain = c.post(CHAT, json={"messages": USER, "echo": True}).json()
    assert plain["choices"][0]["message"]["content"] == "42}"


def test_continue_final_message_reaches_the_template():
    c, stub = make_client()
    msgs = [*USER, {"role": "assistant", "content": "Sure: {"}]
    assert c.post(CHAT, json={"messages": msgs, "add_generation_prompt": False,
                              "continue_final_message": True}).status_code == 200
    req = stub.submitted[0]
    assert req.continue_final_message and not req.add_generation_prompt
    assert_error(c.post(CHAT, json={"messages": msgs, "continue_final_message": True}), 400,
                 "add_generation_prompt", "continue_final_message")
    assert_error(c.post(CHAT, json={"messages": USER, "add_generation_prompt": False, "continue_final_message": True}),
                 400, "last message", "continue_final_message")


def test_chat_stream_schema():
    c, _ = make_client()
    with c.stream("POST", CHAT, json={"messages": USER, "stream": True,
                                      "stream_options": {"include_usage": True}}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == events[0]["id"] for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == "Hello 你好!"
    finals = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"
    assert all(e["usage"] is None for e in events[:-1])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["total_tokens"] == 8


def test_completion_multi_prompt_indices():
    c, stub = make_client()
    body = c.post(COMPLETIONS, json={"prompt": ["a", "b", "c"], "max_tokens": 3}).json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert [ch["index"] for ch in body["choices"]] == [0, 1, 2]
    assert all(ch["text"] == "Hello 你好!" for ch in body["choices"])
    assert body["usage"]["prompt_tokens"] == 15 and body["usage"]["completion_tokens"] == 9
    assert [r.text for r in stub.submitted] == ["a", "b", "c"]


def test_completion_token_prompts():
    c, stub = make_client()
    assert c.post(COMPLETIONS, json={"prompt": [1, 2, 3]}).status_code == 200
    assert c.post(COMPLETIONS, json={"prompt": [[1, 2], [3]]}).status_code == 200
    assert [r.input_ids for r in stub.submitted] == [[1, 2, 3], [1, 2], [3]]
    assert stub.submitted[0].params.max_tokens == 16  # the OpenAI default for completions


def test_completion_stream_multi_prompt():
    c, _ = make_client()
    with c.stream("POST", COMPLETIONS, json={"prompt": ["a", "b"], "stream": True}) as resp:
        events = sse_events(resp)
    texts = {0: "", 1: ""}
    finishes = {}
    for e in events:
        assert e["object"] == "text_completion"
        for ch in e["choices"]:
            texts[ch["index"]] += ch["text"]
            if ch["finish_reason"]:
                finishes[ch["index"]] = ch["finish_reason"]
    assert texts == {0: "Hello 你好!", 1: "Hello 你好!"}
    assert finishes == {0: "length", 1: "length"}
    assert "usage" not in events[0]


@pytest.mark.parametrize("top", [0, 2])
def test_completion_top_logprobs_always_hold_the_chosen_token(top):
    """OpenAI's legacy completions show the chosen token's logprob among ``top_logprobs`` (up to ``logprobs`` + 1
    entries; ``logprobs: 0``: that one alone), as vLLM's do; they held the alternatives only (``{}`` for 0), whole
    and streamed. (The stub's token is none of its alternatives: logprob -1, theirs -2, -3, ...)"""
    c, _ = make_client()
    body = {"prompt": "hi", "logprobs": top}
    logprobs = c.post(COMPLETIONS, json=body).json()["choices"][0]["logprobs"]
    with c.stream("POST", COMPLETIONS, json={**body, "stream": True}) as resp:
        streamed = [ch["logprobs"] for e in sse_events(resp) for ch in e["choices"] if ch["logprobs"]]
    for shown in (logprobs, *streamed):
        for token, chosen, alternatives in zip(shown["tokens"], shown["token_logprobs"], shown["top_logprobs"]):
            assert alternatives == {**{f"{token}~{i}": -2.0 - i for i in range(top)}, token: chosen} and chosen == -1.0
    assert sum((s["tokens"] for s in streamed), []) == logprobs["tokens"] and len(logprobs["tokens"]) == 3


# ---- issue 12: lenient fields, sampling controls, structured output, tools, reasoning ----
def test_lenient_fields_nulls_and_extra_part_keys():
    c, stub = make_client()
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "x"}}]}],
            "n": None, "temperature": None, "reasoning_effort": "low", "stream_options": None, "top_k": None,
            "min_tokens": 2, "include_stop_str_in_output": True, "presence_penalty": 0.5, "frequency_penalty": -0.5,
            "repetition_penalty": 1.1, "logit_bias": {"5": -100, "6": 2.5}, "stop": "x",
            "allowed_token_ids": [3, 4], "bad_words": ["no"]}
    resp = c.post(CHAT, json=body)
    assert resp.status_code == 200, resp.text
    p = stub.submitted[0].params
    assert p.allowed_token_ids == [3, 4] and p.bad_words == ["no"]
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.1)
    assert p.logit_bias == {5: -100.0, 6: 2.5} and p.min_tokens == 2 and p.include_stop_str_in_output
    assert stub.submitted[0].messages == [{"role": "user", "content": "hi"}]


def test_structured_output_fields_reach_the_params():
    c, stub = make_client()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for body, kind in [
        ({"response_format": {"type": "json_object"}}, "json_object"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}},
         "json_schema"),
        ({"regex": "[ab]+"}, "regex"),
        ({"ebnf": 'root ::= "a"'}, "ebnf"),
    ]:
        assert c.post(CHAT, json={"messages": USER, **body}).status_code == 200
        assert stub.submitted[-1].params.structured.kind == kind
    assert c.post(COMPLETIONS, json={"prompt": "x", "regex": "a"}).status_code == 200
    assert stub.submitted[-1].params.structured.spec == "a"
    # the tokenizer worker checks the spec: it names the field the request gave it in
    assert [r.structured_param for r in stub.submitted] == ["response_format", "response_format", "regex", "ebnf",
                                                            "regex"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}]
    assert c.post(CHAT, json={"messages": USER, "tools": tools, "tool_choice": "required"}).status_code == 200
    assert stub.submitted[-1].structured_param == "tools"


WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
HERMES_REPLY = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_tool_calls_auto_whole_and_streamed():
    stub = StubFrontend(reply=HERMES_REPLY, pieces=7, finish="stop")
    c, _ = make_client(stub=stub, tool_call_parser="hermes")
    body = c.post(CHAT, json={"messages": USER, "tools": WEATHER}).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["matched_stop"] == 7
    msg = choice["message"]
    assert msg["content"] == "Checking." and len(msg["tool_calls"]) == 1
    call = msg["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert stub.submitted[-1].tools == template_tools(WEATHER)
    with c.stream("POST", CHAT, json={"messages": USER, "tools": WEATHER, "stream": True}) as resp:
        events = sse_events(resp)
    deltas = [e["choices"][0]["delta"] for e in events]
    calls = [t for d in deltas for t in d.get("tool_calls") or []]
    assert all(len(d.get("tool_calls") or []) <= 1 for d in deltas)
    assert calls[0]["id"].startswith("call_") and calls[0]["function"]["name"] == "get_weather"
    assert all("id" not in d for d in calls[1:])
    assert json.loads("".join(d["function"]["arguments"] for d in calls)) == {"city": "Paris"}
    assert "".join(d.get("content") or "" for d in deltas) == "Checking."
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_qwen3_coder_calls_are_typed_by_the_requests_tools():
    """--tool-call-parser qwen3_coder: a call's values are text, typed by the request's tool schemas (days: an
    integer; a parameter the tool does not declare stays text), whole and streamed alike."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
    reply = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\n3\n"
             "</parameter>\n<parameter=x>\n5\n</parameter>\n</function>\n</tool_call>")
    c, _ = make_client(stub=StubFrontend(reply=reply, pieces=9, finish="stop"), tool_call_parser="qwen3_coder")
    choice = c.post(CHAT, json={"messages": USER, "tools": tools}).json()["choices"][0]
    call = choice["message"]["tool_calls"][0]["function"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "42", "days": 3, "x": "5"}
    with c.stream("POST", CHAT, json={"messages": USER, "tools": tools, "stream": True}) as resp:
        deltas = [e["choices"][0]["delta"] for e in sse_events(resp)]
    streamed = "".join(t["function"]["arguments"] for d in deltas for t in d.get("tool_calls") or [])
    assert streamed == call["arguments"]


def test_mistral_calls_keep_the_special_token_in_the_text():
    """[TOOL_CALLS] is a special token: under the mistral parser a chat request with tools keeps special tokens in
    its text (as vLLM's adjust_request), so its calls are parsed, not shown as content; without tools it does not."""
    reply = 'Ok.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    c, stub = make_client(stub=StubFrontend(reply=reply, pieces=4, finish="stop"), tool_call_parser="mistral")
    choice = c.post(CHAT, json={"messages": USER, "tools": WEATHER}).json()["choices"][0]
    assert stub.submitted[-1].params.skip_special_tokens is False
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Ok."
    call = choice["message"]["tool_calls"][0]
    assert len(call["id"]) == 9 and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    c.post(CHAT, json={"messages": USER})
    assert stub.submitted[-1].params.skip_special_tokens is True


def test_forced_tool_choice_is_constrained_and_parsed():
    stub = StubFrontend(reply='[{"name": "get_weather", "parameters": {"city": "Rome"}}]', finish="stop")
    c, _ = make_client(stub=stub)  # no --tool-call-parser needed: the output format is ours
    body = c.post(CHAT, json={"messages": USER, "tools": WEATHER, "tool_choice": "required"}).json()
    call = body["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Rome"}
    schema = json.loads(stub.submitted[-1].params.structured.spec)
    assert schema["items"]["anyOf"][0]["properties"]["name"] == {"const": "get_weather"}
    stub.reply = '{"city": "Oslo"}'
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = c.post(CHAT, json={"messages": USER, "tools": WEATHER, "tool_choice": named}).json()
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert json.loads(body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    assert json.loads(stub.submitted[-1].params.structured.spec) == WEATHER[0]["function"]["parameters"]


def test_allowed_tools_narrows_the_tools_and_takes_its_mode():
    """OpenAI's tool_choice allowed_tools (was a 400): the prompt shows the allowed tools only, and its mode is the
    tool_choice (required: a grammar over those)."""
    other = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    stub = StubFrontend(reply='[{"name": "get_weather", "parameters": {"city": "Rome"}}]', finish="stop")
    c, _ = make_client(stub=stub, tool_call_parser="hermes")
    allowed = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "get_weather"}}]}}
    body = c.post(CHAT, json={"messages": USER, "tools": [other, *WEATHER], "tool_choice": allowed}).json()
    assert body["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert stub.submitted[-1].tools == template_tools(WEATHER)
    assert json.loads(stub.submitted[-1].params.structured.spec)["items"]["anyOf"][0]["properties"]["name"] == {
        "const": "get_weather"}
    allowed["allowed_tools"]["mode"] = "auto"
    assert c.post(CHAT, json={"messages": USER, "tools": [other, *WEATHER], "tool_choice": allowed}).status_code == 200
    assert stub.submitted[-1].tools == template_tools(WEATHER) and stub.submitted[-1].params.structured is None
    # every tool given is checked, allowed or not (as /tokenize checks them; a bad one passed when left out)
    bad_tool = {"type": "function", "function": {"name": "g", "parameters": "oops"}}
    assert_error(c.post(CHAT, json={"messages": USER, "tools": [*WEATHER, bad_tool], "tool_choice": allowed}), 400,
                 "tools[1].function.parameters", "tools")
    for bad, fragment in ((dict(allowed, allowed_tools={"mode": "sometimes", "tools": []}), "must be"),
                          (dict(allowed, allowed_tools={"tools": [{"type": "function", "function": {"name": "nope"}}]}),
                           "allows 'nope', which is not in tools")):
        assert_error(c.post(CHAT, json={"messages": USER, "tools": WEATHER, "tool_choice": bad}), 400, fragment,
                     "tool_choice")


def test_tool_choice_none_leaves_the_text_alone():
    stub = StubFrontend(reply=HERMES_REPLY, finish="stop")
    c, _ = make_client(stub=stub, tool_call_parser="hermes")
    body = c.post(CHAT, json={"messages": USER, "tools": WEATHER, "tool_choice": "none"}).json()
    assert body["choices"][0]["message"]["content"] == HERMES_REPLY and body["choices"][0]["finish_reason"] == "stop"


def test_reasoning_content_whole_and_streamed():
    stub = StubFrontend(reply="let me think</think>\n\nThe answer", pieces=9, finish="stop", prompt_in_reasoning=True)
    c, _ = make_client(stub=stub, reasoning_parser="qwen3")
    msg = c.post(CHAT, json={"messages": USER}).json()["choices"][0]["message"]
    assert msg["reasoning_content"] == "let me think" and msg["content"] == "The answer"
    with c.stream("POST", CHAT, json={"messages": USER, "stream": True}) as resp:
        deltas = [e["choices"][0]["delta"] for e in sse_events(resp)]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "let me think"
    assert "".join(d.get("content") or "" for d in deltas) == "The answer"
    msg = c.post(CHAT, json={"messages": USER, "separate_reasoning": False}).json()["choices"][0]["message"]
    assert msg["content"] == stub.reply and "reasoning_content" not in msg
    # constrained output has no think block, even when the template opened one
    msg = c.post(CHAT, json={"messages": USER, "regex": ".*"}).json()["choices"][0]["message"]
    assert msg["content"] == stub.reply


def test_reasoning_tokens_in_chat_usage_whole_and_streamed():
    """usage.completion_tokens_details.reasoning_tokens: the think block's tokens, its tags and the newlines after
    it (2 characters a token: "<t" ... "k>", "\n\n" are 10), per choice, whole and streamed alike (the Responses
    API's count); 0 with the reasoning left in the content."""
    stub = StubFrontend(reply="<think>hmm</think>\n\nAnswer!", pieces=14, finish="stop")
    c, _ = make_client(stub=stub, reasoning_parser="qwen3")
    usage = c.post(CHAT, json={"messages": USER, "n": 2}).json()["usage"]
    assert usage["completion_tokens"] == 28 and usage["completion_tokens_details"] == {"reasoning_tokens": 20}
    body = {"messages": USER, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    with c.stream("POST", CHAT, json=body) as resp:
        streamed = [e for e in sse_events(resp) if e.get("usage")][-1]["usage"]
    assert streamed == usage
    usage = c.post(CHAT, json={"messages": USER, "separate_reasoning": False}).json()["usage"]
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 0}


def test_the_models_sampling_defaults_fill_what_a_request_leaves_unset():
    """--generation-config: Qwen3's recommended temperature, top_p and top_k (and a repetition_penalty) for chat,
    completions and the Responses API, field by field: a request's own value wins, temperature 0 included."""
    defaults = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.05}
    c, stub = make_client(sampling_defaults=defaults)
    for path, body in ((CHAT, {"messages": USER}), ("/v1/completions", {"prompt": "hi"}),
                       ("/v1/responses", {"input": "hi"})):
        assert c.post(path, json=body).status_code == 200
        params = stub.submitted[-1].params
        assert (params.temperature, params.top_k, params.top_p, params.repetition_penalty) == (0.6, 20, 0.95, 1.05)
    assert c.post(CHAT, json={"messages": USER, "temperature": 0, "top_p": 1.0, "repetition_penalty": 1.0}).status_code == 200
    params = stub.submitted[-1].params
    assert (params.temperature, params.top_k, params.top_p, params.repetition_penalty) == (0, 20, 1.0, 1.0)
    c, stub = make_client()  # none: SamplingParams' own (OpenAI's temperature 1, no top-k or top-p)
    assert c.post(CHAT, json={"messages": USER}).status_code == 200
    params = stub.submitted[-1].params
    assert (params.temperature, params.top_k, params.top_p, params.repetition_penalty) == (1.0, -1, 1.0, 1.0)


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk():
    """vLLM's stream_options.continuous_usage_stats (was accepted and ignored): each chunk's usage is its choice's,
    counting the completion tokens streamed so far (the role chunk 0); without it the chunks carry null and only
    the last has the usage."""
    stub = StubFrontend(reply="abcdef", pieces=3, finish="stop")
    c, _ = make_client(stub=stub)
    body = {"messages": USER, "stream": True, "n": 2,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with c.stream("POST", CHAT, json=body) as resp:
        events = list(sse_events(resp))
    for index in (0, 1):
        mine = [e for e in events if e["choices"] and e["choices"][0]["index"] == index]
        assert [e["usage"]["completion_tokens"] for e in mine] == [0, 1, 2, 3, 3]  # role, 3 pieces, finish
        assert all(e["usage"]["total_tokens"] == e["usage"]["prompt_tokens"] + e["usage"]["completion_tokens"]
                   for e in mine)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6  # the whole call's
    completions = {"prompt": "hi", "stream": True, "stream_options": body["stream_options"]}
    with c.stream("POST", "/v1/completions", json=completions) as resp:
        assert [e["usage"]["completion_tokens"] for e in sse_events(resp) if e["choices"]] == [1, 2, 3, 3]
    body["stream_options"]["continuous_usage_stats"] = False
    with c.stream("POST", CHAT, json=body) as resp:
        events = list(sse_events(resp))
    assert all(e["usage"] is None for e in events[:-1]) and events[-1]["usage"]["completion_tokens"] == 6


def test_unserved_openai_endpoints_say_so():
    """OpenAI endpoints of other modalities (audio, moderations, ...) were a bare "Not Found": their 404 names them
    and what is served; any other unknown path names the API's routes."""
    c, _ = make_client()
    for path in ("/v1/audio/transcriptions", "/v1/moderations", "/v1/batches"):
        err = assert_error(c.post(path, json={"input": "hi", "model": MODEL}), 404, f"{path} is not served")
        assert "/v1/chat/completions" in err["message"] and err["type"] == "invalid_request_error"
    assert_error(c.post("/v1/chat/complete", json={}), 404, "no route /v1/chat/complete (the API is under /v1")


def test_a_requests_own_chat_template_needs_the_servers_trust(qwen3_dir):
    """vLLM's chat_template field (was ignored): a 400 naming --trust-request-chat-template, as vLLM refuses it;
    with the flag, chat sends it to the tokenizer workers and /tokenize renders with it."""
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    c, stub = make_client()
    assert_error(c.post(CHAT, json={"messages": USER, "chat_template": template}), 400,
                 "--trust-request-chat-template", "chat_template")
    c, stub = make_client(trust_request_chat_template=True)
    assert c.post(CHAT, json={"messages": USER, "chat_template": template}).status_code == 200
    assert stub.submitted[-1].chat_template == template
    assert c.post(CHAT, json={"messages": USER}).status_code == 200 and stub.submitted[-1].chat_template is None
    assert_error(c.post(CHAT, json={"messages": USER, "chat_template": ""}), 400, "must not be empty", "chat_template")
    from tpserve.tokenizer.loader import load_tokenizer

    tok = load_tokenizer(qwen3_dir)
    for trusted in (False, True):
        args = ServerArgs(engine=EngineConfig(model=qwen3_dir), served_model_name=MODEL, context_len=128,
                          vocab_size=700, trust_request_chat_template=trusted)
        tokenize = TestClient(create_app(AppState(args))).post("/tokenize", json={"messages": USER, "chat_template": template})
        if trusted:
            assert tok.decode(tokenize.json()["tokens"]) == "<<hi>>"
            broken = TestClient(create_app(AppState(args))).post("/tokenize", json={"messages": USER, "chat_template": "{{"})
            assert_error(broken, 400, "cannot apply the chat template", "chat_template")  # the request's, named
        else:
            assert_error(tokenize, 400, "--trust-request-chat-template", "chat_template")


def test_tool_message_history_reaches_the_template():
    c, stub = make_client()
    msgs = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    assert c.post(CHAT, json={"messages": msgs, "tools": WEATHER, "tool_choice": "none"}).status_code == 200
    sent = stub.submitted[-1].messages
    assert sent[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # as an object, for templates
    no_args = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": ""}}]}]
    assert c.post(CHAT, json={"messages": no_args, "tools": WEATHER, "tool_choice": "none"}).status_code == 200
    assert stub.submitted[-1].messages[1]["tool_calls"][0]["function"]["arguments"] == {}  # was "": `"arguments": }`
    assert sent[2] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}


def test_tokenize_detokenize_and_model_aliases(qwen3_dir):
    args = ServerArgs(engine=EngineConfig(model=qwen3_dir), served_model_name=MODEL, context_len=128,
                      vocab_size=700, model_aliases=("alias",))
    state = AppState(args)
    state.serving = Serving(StubFrontend(), state.metrics, MODEL, LIMITS, ("alias",))  # type: ignore[arg-type]
    c = TestClient(create_app(state))
    from tpserve.tokenizer.loader import load_tokenizer

    tok = load_tokenizer(qwen3_dir)
    body = c.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert body == {"tokens": tok.encode("Hello world"), "count": len(tok.encode("Hello world")), "max_model_len": 128,
                    "token_strs": None}  # (review) as vLLM's TokenizeResponse, the key is there unasked
    chat = c.post("/tokenize", json={"messages": USER}).json()
    assert tok.decode(chat["tokens"]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    no_thinking = c.post("/tokenize", json={"messages": USER, "reasoning_effort": "none"}).json()  # as chat renders it
    assert tok.decode(no_thinking["tokens"]).endswith("<think>\n\n</think>\n\n")
    assert c.post("/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": "Hello world"}
    spelled = c.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert spelled["tokens"] == body["tokens"] and spelled["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    assert "".join(spelled["token_strs"]) == "HelloĠworld"  # the vocabulary's byte-level spelling
    assert_error(c.post("/detokenize", json={"tokens": [10**6]}), 400, "out of range", "tokens")
    assert_error(c.post("/tokenize", json={}), 400, "prompt or messages")
    # model and tools are checked as the /v1 routes check them
    assert c.post("/tokenize", json={"prompt": "hi", "model": "alias"}).status_code == 200
    assert_error(c.post("/tokenize", json={"prompt": "hi", "model": "nope"}), 404, "nope")
    assert_error(c.post("/detokenize", json={"tokens": [1], "model": "nope"}), 404, "nope")
    assert_error(c.post("/tokenize", json={"messages": USER, "tools": [{"type": "x"}]}), 400, "tools[0]", "tools")
    # an allowed_tools tool_choice renders its tools only, as chat does
    other = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    allowed = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "get_weather"}}]}}
    narrowed = c.post("/tokenize", json={"messages": USER, "tools": [other, *WEATHER], "tool_choice": allowed}).json()
    assert narrowed["tokens"] == c.post("/tokenize", json={"messages": USER, "tools": WEATHER}).json()["tokens"]
    assert narrowed["tokens"] != c.post("/tokenize", json={"messages": USER, "tools": [other, *WEATHER]}).json()["tokens"]
    assert_error(c.post("/tokenize", json={"messages": USER, "tools": [other], "tool_choice": allowed}), 400,
                 "allows 'get_weather', which is not in tools", "tool_choice")
    assert [m["id"] for m in c.get("/v1/models").json()["data"]] == [MODEL, "alias"]
    assert c.post(CHAT, json={"model": "alias", "messages": USER}).json()["model"] == MODEL


def test_tokenize_add_special_tokens_as_vllm(qwen3_dir, tmp_path):
    """(review) vLLM's add_special_tokens: a prompt's default true; messages' default false, and true adds the
    tokenizer's special tokens (a BOS here) on top of the chat template's (was ignored for messages)."""
    import shutil

    from tpserve.tokenizer.loader import load_tokenizer

    model = tmp_path / "bos"
    shutil.copytree(qwen3_dir, model)
    spec = json.loads((model / "tokenizer.json").read_text())
    bos = next(t for t in spec["added_tokens"] if t["content"] == "<|endoftext|>")
    spec["post_processor"] = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": bos["content"],
                              "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}], "pair": [], "special_tokens": {
                              bos["content"]: {"id": bos["content"], "ids": [bos["id"]], "tokens": [bos["content"]]}}}
    (model / "tokenizer.json").write_text(json.dumps(spec))
    tok = load_tokenizer(str(model))
    assert tok.encode("hi")[0] == bos["id"]  # the tokenizer adds a BOS
    args = ServerArgs(engine=EngineConfig(model=str(model)), served_model_name=MODEL, context_len=128, vocab_size=700)
    c = TestClient(create_app(AppState(args)))

    def tokens(**body) -> list[int]:
        return c.post("/tokenize", json=body).json()["tokens"]

    assert tokens(prompt="hi") == tok.encode("hi") and tokens(prompt="hi", add_special_tokens=False)[0] != bos["id"]
    template = tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    assert tokens(messages=USER) == tok.encode(template, add_special_tokens=False)
    assert tokens(messages=USER, add_special_tokens=False) == tokens(messages=USER)
    assert tokens(messages=USER, add_special_tokens=True) == [bos["id"], *tokens(messages=USER)]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {"prompt": "x" * 5000}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x" * 5000}]}, "messages"),
        ("/tokenize", {"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "description": "d" * 5000}}]},
         "tools"),
        ("/tokenize", {"messages": USER, "chat_template_kwargs": {"extra": "x" * 5000}}, "chat_template_kwargs"),
        ("/detokenize", {"tokens": [1] * 129}, "tokens"),
    ],
)
def test_tokenize_and_detokenize_have_the_prompt_limits(qwen3_dir, path, body, param):
    """The completion endpoints' limits (4096 characters, 128 tokens here), checked before tokenizing."""
    args = ServerArgs(engine=EngineConfig(model=qwen3_dir), served_model_name=MODEL, context_len=128, vocab_size=700)
    state = AppState(args)
    c = TestClient(create_app(state))
    err = assert_error(c.post(path, json=body), 400, "characters" if path == "/tokenize" else "context (128)", param)
    assert err["code"] == "invalid_request"
    assert state.tokenize._tokenizer is None, "refused before the tokenizer is loaded"


class SilentFrontend(StubFrontend):
    """Accepts requests and never answers: a backend that makes no progress."""

    async def submit(self, requests, queue) -> None:
        self.submitted.extend(requests)


@pytest.mark.parametrize("stream", [False, True])
def test_request_timeout_aborts_with_504(stream):
    stub = SilentFrontend()
    c, _ = make_client(stub=stub, request_timeout=0.3)
    start = time.monotonic()
    resp = c.post(CHAT, json={"messages": USER, "stream": stream})
    assert time.monotonic() - start < 5
    assert_error(resp, 504, "--request-timeout")
    assert resp.json()["error"]["code"] == "request_timeout"
    assert stub.aborted == [r.rid for r in stub.submitted]


class BrokenFrontend(StubFrontend):
    async def submit(self, requests, queue) -> None:
        self.submitted.extend(requests)
        raise RuntimeError("the tokenizer socket is gone")


def test_a_failed_submit_aborts_what_it_started():
    stub = BrokenFrontend()
    c, _ = make_client(stub=stub)
    c = TestClient(c.app, raise_server_exceptions=False)
    resp = c.post(COMPLETIONS, json={"prompt": ["a", "b"], "max_tokens": 3})
    assert resp.status_code == 500
    assert sorted(stub.aborted) == sorted(r.rid for r in stub.submitted) and stub.aborted
    assert metric(c, 'tpserve_http_responses_total{status="500"}') == 1  # answered past the middleware: counted


def test_openapi_schema_needs_no_key_only_without_one():
    open_client, _ = make_client()
    assert open_client.get("/openapi.json").status_code == 200
    keyed, _ = make_client(api_key="k")
    assert keyed.get("/openapi.json").status_code == 404


def test_body_over_the_cap_is_413_before_parsing():
    c, stub = make_client(max_request_bytes=2000)
    resp = c.post(CHAT, json={"messages": [{"role": "user", "content": "x" * 5000}]})
    assert_error(resp, 413, "--max-request-bytes")
    assert resp.json()["error"]["code"] == "request_too_large" and not stub.submitted

    def chunked(text: str):  # no Content-Length: the limit holds as the body comes (it was FastAPI's 400)
        yield b'{"messages": [{"role": "user", "content": "'
        yield text.encode()
        yield b'"}], "max_tokens": 2}'

    resp = c.post(CHAT, content=chunked("x" * 5000), headers={"content-type": "application/json"})
    assert_error(resp, 413, "--max-request-bytes")
    assert not stub.submitted
    assert c.post(CHAT, content=chunked("hi"), headers={"content-type": "application/json"}).status_code == 200


def test_health_503_when_a_rank_stalls():
    c, _ = make_client()
    state = c.app.state.server
    state.liveness = lambda: None
    assert c.get("/health").status_code == 200
    state.liveness = lambda: "scheduler rank 1 has made no progress for 61.0 s"
    resp = c.get("/health")
    assert_error(resp, 503, "rank 1")


def test_x_request_id_is_returned_and_names_the_completion():
    """vLLM's X-Request-Id: the client's id comes back in the header and as the body's id (streamed chunks too);
    without one the server makes one; a malformed one is a 400 that still carries no forged header."""
    c, _ = make_client()
    resp = c.post(CHAT, json={"messages": USER}, headers={"X-Request-Id": "trace-42.a:b"})
    assert resp.status_code == 200 and resp.headers["x-request-id"] == "trace-42.a:b"
    assert resp.json()["id"] == "chatcmpl-trace-42.a:b"
    resp = c.post(COMPLETIONS, json={"prompt": "x", "stream": True}, headers={"X-Request-Id": "s1"})
    assert resp.headers["x-request-id"] == "s1" and {e["id"] for e in sse_events(resp)} == {"cmpl-s1"}
    resp = c.post(CHAT, json={"messages": USER})
    made = resp.headers["x-request-id"]
    assert len(made) == 32 and resp.json()["id"] == f"chatcmpl-{made}"
    assert c.post(CHAT, json={"messages": USER}).headers["x-request-id"] != made
    assert_error(c.post(CHAT, json={"max_tokens": 0}, headers={"X-Request-Id": "e1"}), 400)  # errors carry it too
    assert c.post(CHAT, json={"max_tokens": 0}, headers={"X-Request-Id": "e1"}).headers["x-request-id"] == "e1"
    assert c.get("/health", headers={"X-Request-Id": "h"}).headers["x-request-id"] == "h"
    for bad in ("a b", "x" * 129, "a\u00e9"):
        resp = c.post(CHAT, json={"messages": USER}, headers={"X-Request-Id": bad.encode("utf-8")})
        assert_error(resp, 400, "X-Request-Id must be 1-128 characters", "X-Request-Id")
        assert "x-request-id" not in resp.headers


def test_reasoning_effort_refusals_and_unserved_chat_fields():
    """reasoning_effort switches thinking as Responses' reasoning.effort does (it was ignored); an assistant's refusal
    part is text; the deprecated functions, audio output and web search are 400s, not answers without them."""
    c, stub = make_client()
    for effort, kwargs, thinking in (("none", None, False), ("high", None, True), ("max", None, True),
                                     ("none", {"enable_thinking": True}, True)):
        body = {"messages": USER, "reasoning_effort": effort, "chat_template_kwargs": kwargs}
        assert c.post(CHAT, json=body).status_code == 200
        assert stub.submitted[-1].chat_template_kwargs == {"enable_thinking": thinking}
    assert c.post(CHAT, json={"messages": USER}).status_code == 200 and stub.submitted[-1].chat_template_kwargs is None
    assert_error(c.post(CHAT, json={"messages": USER, "reasoning_effort": "huge"}), 400, "reasoning_effort must be one of",
                 "reasoning_effort")
    replay = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
              {"role": "user", "content": "why"}]
    assert c.post(CHAT, json={"messages": replay}).status_code == 200
    assert stub.submitted[-1].messages[1] == {"role": "assistant", "content": "No."}
    for extra, param in (({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
                         ({"function_call": {"name": "f"}}, "function_call"), ({"audio": {"voice": "alloy"}}, "audio"),
                         ({"modalities": ["text", "audio"]}, "modalities"), ({"web_search_options": {}}, "web_search_options")):
        assert_error(c.post(CHAT, json={"messages": USER, **extra}), 400, None, param)
    assert c.post(CHAT, json={"messages": USER, "modalities": ["text"]}).status_code == 200
    # vLLM's fields for features not enabled: 400s when they ask for them, accepted at their off values; a beam
    # search refuses the fields it would not apply, its neutral values taken
    for path, base in ((CHAT, {"messages": USER}), ("/v1/completions", {"prompt": "hi"})):
        assert_error(c.post(path, json={**base, "priority": 5}), 400, "--schedule-policy priority", "priority")
        assert c.post(path, json={**base, "use_beam_search": False, "priority": 0}).status_code == 200
        beam = {**base, "use_beam_search": True}
        for extra, param in (({"stop": "x"}, "stop"), ({"top_p": 0.5}, "top_p"), ({"min_tokens": 2}, "min_tokens"),
                             ({"presence_penalty": 1.0}, "presence_penalty"), ({"logit_bias": {"3": 1}}, "logit_bias"),
                             ({"regex": "a+"}, "regex"), ({"n": 11}, "n"), ({"length_penalty": "x"}, "length_penalty")):
            assert_error(c.post(path, json={**beam, **extra}), 400, None, param)
        # past the checks: this stub server has no tokenizer to search with
        assert_error(c.post(path, json={**beam, "top_p": 1.0, "top_k": -1, "stop": [], "presence_penalty": 0.0}), 400,
                     "use_beam_search is not served here", "use_beam_search")


def test_priority_reaches_the_scheduler_under_the_priority_policy():
    """vLLM's ``priority`` on every generating and pooling endpoint: with --schedule-policy priority each backend
    request carries it (every choice of n); without, a priority other than 0 is a 400 naming it (above)."""
    c, stub = make_client(priority_scheduling=True)
    for path, body in ((CHAT, {"messages": USER, "n": 2}), ("/v1/completions", {"prompt": "hi"}),
                       ("/v1/embeddings", {"input": "hi"}), ("/v1/score", {"text_1": "a", "text_2": "b"}),
                       ("/v1/rerank", {"query": "q", "documents": ["a"]}), ("/v1/responses", {"input": "hi"})):
        before = len(stub.submitted)
        assert c.post(path, json={**body, "priority": -7}).status_code == 200, path
        assert {r.params.priority for r in stub.submitted[before:]} == {-7}, path
    assert_error(c.post(CHAT, json={"messages": USER, "priority": 1.5}), 400, None, "priority")


def test_embeddings_request_and_response_shapes():
    """/v1/embeddings (was a 404): one backend request per input (text or token ids, named ``input`` in errors),
    OpenAI's list object in input order, the vector L2-normalized unless ``normalize`` is false, cut to
    ``dimensions`` first, base64 as little-endian float32; usage counts each input's prompt tokens."""
    import base64

    import numpy as np

    c, stub = make_client()
    resp = c.post("/v1/embeddings", json={"input": ["a", "b"], "model": MODEL})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "list" and body["model"] == MODEL and body["id"].startswith("embd-")
    assert [d["index"] for d in body["data"]] == [0, 1] and all(d["object"] == "embedding" for d in body["data"])
    first, second = stub.submitted[-2:]
    assert first.params.pooled and first.text == "a" and second.text == "b" and first.prompt_param == "input"
    for d, req in zip(body["data"], (first, second)):
        raw = np.array([req.rid, 1, 2, 3], dtype=np.float64)
        assert np.allclose(d["embedding"], raw / np.linalg.norm(raw), atol=1e-7)
    # vLLM's UsageInfo: OpenAI's two counts, and its completion_tokens and prompt_tokens_details
    assert body["usage"] == {"prompt_tokens": 10, "total_tokens": 10, "completion_tokens": 0,
                             "prompt_tokens_details": None}

    body = c.post("/v1/embeddings", json={"input": [4, 5, 6], "dimensions": 2, "encoding_format": "base64"}).json()
    assert stub.submitted[-1].input_ids == [4, 5, 6] and stub.submitted[-1].text is None
    vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    rid = stub.submitted[-1].rid
    assert np.allclose(vector, np.array([rid, 1]) / np.hypot(rid, 1), atol=1e-7)
    c.post("/v1/embeddings", json={"input": "a", "cache_salt": "tenant", "add_special_tokens": False})
    assert stub.submitted[-1].params.cache_salt == "tenant" and not stub.submitted[-1].add_special_tokens
    assert stub.submitted[-2].add_special_tokens
    body = c.post("/v1/embeddings", json={"input": [[4], [5]], "normalize": False}).json()
    assert [d["embedding"] for d in body["data"]] == [[r.rid, 1, 2, 3] for r in stub.submitted[-2:]]
    assert [r.input_ids for r in stub.submitted[-2:]] == [[4], [5]]


@pytest.mark.parametrize("body, param, message", [
    ({"input": []}, "input", "input must not be empty"),
    ({"input": ""}, "input", "must not hold an empty string"),
    ({"input": ["a", ""]}, "input", "must not hold an empty string"),
    ({"input": [[1], []]}, "input", "an empty token list"),
    ({"input": "a", "dimensions": 0}, "dimensions", "greater than or equal to 1"),
    ({"input": "a", "dimensions": 5}, "dimensions", "dimensions must be in [1, 4]"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format", "'float' or 'base64'"),
    ({"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "must be >= 1 or -1"),
    ({"input": 3}, "input", "input"),
    ({"input": "REJECT me"}, "input", "too long"),
    ({"input": "a", "priority": 1}, "priority", "priority scheduling is not enabled"),
    ({"input": "a", "priority": 2**63}, "priority", "priority"),
    ({"input": "a", "cache_salt": ""}, "cache_salt", "cache_salt must be a non-empty string"),
    ({"input": ["a"] * 65}, "input", "exceed this server's limit of 64"),
])
def test_embeddings_bad_requests_are_400s(body, param, message):
    c, stub = make_client()
    assert_error(c.post("/v1/embeddings", json=body), 400, message, param)


def test_embeddings_check_the_model_and_the_key():
    c, _ = make_client(api_key="k")
    assert c.post("/v1/embeddings", json={"input": "a"}).status_code == 401
    resp = c.post("/v1/embeddings", json={"input": "a", "model": "other"}, headers={"Authorization": "Bearer k"})
    assert_error(resp, 404, "does not exist", "model")


def test_a_tool_schema_may_hold_uint64_bounds():
    """Integers up to 2**64 - 1 cross to the tokenizer workers (msgpack's uint64): a tool parameter's uint64 maximum
    was a 400; 2**64 still is. (A forced call compiles the schema: xgrammar refuses integers past int64, a 400
    there.)"""
    import msgspec

    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 2**64 - 1}}}}}
    c, stub = make_client(tool_call_parser="hermes")
    assert c.post(CHAT, json={"messages": USER, "tools": [tool]}).status_code == 200
    sent = stub.submitted[-1]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(sent), type=type(sent)).tools == template_tools([tool])
    tool["function"]["parameters"]["properties"]["n"]["maximum"] = 2**64
    assert_error(c.post(CHAT, json={"messages": USER, "tools": [tool]}), 400, "outside the 64-bit range",
                 "tools[0].function.parameters.properties.n.maximum")


def _stub_vector(rid: int):
    import numpy as np

    v = np.array([rid, 1, 2, 3], dtype=np.float64)
    return v / np.linalg.norm(v)


def test_score_pairs_texts_by_the_cosine_of_their_embeddings():
    """vLLM's score API for an embedding model: one text_1 against each text_2, or pairs; every path vLLM serves."""
    c, stub = make_client()
    for path in ("/v1/score", "/score"):
        body = c.post(path, json={"text_1": "q", "text_2": ["a", "b"], "model": MODEL}).json()
        q, a, b = stub.submitted[-3:]
        assert [r.text for r in (q, a, b)] == ["q", "a", "b"] and q.params.pooled
        assert [r.prompt_param for r in (q, a, b)] == ["text_1", "text_2", "text_2"]
        assert body["object"] == "list" and body["id"].startswith("score-")
        assert [d["index"] for d in body["data"]] == [0, 1] and all(d["object"] == "score" for d in body["data"])
        expected = [float(_stub_vector(q.rid) @ _stub_vector(r.rid)) for r in (a, b)]
        assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=1e-6)
        # as vLLM counts a bi-encoder's usage: each pair's two texts (the query once per pair), 2 x (5 + 5)
        assert body["usage"] == {"prompt_tokens": 20, "total_tokens": 20, "completion_tokens": 0,
                                 "prompt_tokens_details": None}
    body = c.post("/v1/score", json={"text_1": ["x", "y"], "text_2": ["z", "w"]}).json()
    x, y, z, w = stub.submitted[-4:]
    expected = [float(_stub_vector(x.rid) @ _stub_vector(z.rid)), float(_stub_vector(y.rid) @ _stub_vector(w.rid))]
    assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=1e-6)


def test_rerank_orders_documents_by_relevance():
    c, stub = make_client()
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        body = c.post(path, json={"query": "q", "documents": ["a", "b", "c"], "top_n": 2}).json()
        q, *docs = stub.submitted[-4:]
        scores = [float(_stub_vector(q.rid) @ _stub_vector(d.rid)) for d in docs]
        best = sorted(range(3), key=lambda i: scores[i], reverse=True)[:2]
        assert [r["index"] for r in body["results"]] == best and body["id"].startswith("rerank-")
        assert [r["document"]["text"] for r in body["results"]] == [["a", "b", "c"][i] for i in best]
        assert [r["relevance_score"] for r in body["results"]] == pytest.approx([scores[i] for i in best], abs=1e-6)
        assert body["usage"] == {"prompt_tokens": 30, "total_tokens": 30}  # each pair's tokens, 3 x (5 + 5)
    assert len(c.post("/v1/rerank", json={"query": "q", "documents": ["a", "b"]}).json()["results"]) == 2
    bare = c.post("/v1/rerank", json={"query": "q", "documents": ["a", "b"], "return_documents": False}).json()
    assert [sorted(r) for r in bare["results"]] == [["index", "relevance_score"]] * 2


def test_score_takes_each_of_vllms_names_for_its_two_sides():
    """(review) Newer vLLM's score requests name the sides queries and documents (or items), or data_1 and data_2;
    only text_1 and text_2 were read (the others a 400 saying text_1 is missing)."""
    c, stub = make_client()
    for first, second in (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2")):
        body = c.post("/v1/score", json={first: "q", second: ["a", "b"]}).json()
        q, a, b = stub.submitted[-3:]
        assert [r.text for r in (q, a, b)] == ["q", "a", "b"]
        assert [r.prompt_param for r in (q, a, b)] == [first, second, second]
        expected = [float(_stub_vector(q.rid) @ _stub_vector(r.rid)) for r in (a, b)]
        assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=1e-6)
    assert_error(c.post("/v1/score", json={"queries": ["a", "b"], "documents": ["c", "d", "e"]}), 400,
                 "queries must hold one text or as many as documents (3)", "queries")
    assert_error(c.post("/v1/score", json={"queries": "q"}), 400, "documents is required", "documents")
    assert_error(c.post("/v1/score", json={"data_2": "q"}), 400, "data_1 is required", "data_1")
    assert_error(c.post("/v1/score", json={}), 400, "text_1 and text_2", "text_1")


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/score", {"text_1": [], "text_2": "a"}, "text_1", "at least one text"),
    ("/v1/score", {"text_1": "a", "text_2": ["b", ""]}, "text_2", "no empty one"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1", "one text or as many as text_2 (3)"),
    ("/v1/score", {"text_1": "a"}, "text_2", "text_2"),
    ("/v1/score", {"text_1": "a", "text_2": "b", "priority": 2}, "priority", "priority scheduling is not enabled"),
    ("/v1/rerank", {"query": "", "documents": ["a"]}, "query", "query must not be empty"),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents", "at least one text"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n", "top_n must be >= 0"),
    ("/v1/rerank", {"query": "q", "documents": ["REJECT"]}, "documents", "too long"),
    ("/rerank", {"query": "q", "documents": ["a"], "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", ">= 1"),
])
def test_score_and_rerank_bad_requests_are_400s(path, body, param, message):
    c, _ = make_client()
    assert_error(c.post(path, json=body), 400, message, param)


def test_score_and_rerank_need_the_key_and_the_model():
    c, _ = make_client(api_key="k")
    for path in ("/v1/score", "/score", "/v1/rerank", "/rerank", "/v2/rerank"):
        assert c.post(path, json={"query": "q", "documents": ["a"], "text_1": "a", "text_2": "b"}).status_code == 401
    resp = c.post("/v1/rerank", json={"query": "q", "documents": ["a"], "model": "x"},
                  headers={"Authorization": "Bearer k"})
    assert_error(resp, 404, "does not exist", "model")


def test_score_and_rerank_errors_name_the_input_that_failed():
    """(review) Too many documents named the query; an input that ended without a hidden state was numbered across
    all the texts ("documents 1" for documents[0])."""
    from tpserve.server.errors import APIError
    from tpserve.server.formats import Choice
    from tpserve.server.metrics import RequestTimer, ServerMetrics
    from tpserve.server.scores import RerankFormat, RerankRequest, ScoreFormat, cosine_scorer, cross_scorer

    c, _ = make_client()
    assert_error(c.post("/v1/rerank", json={"query": "q", "documents": ["d"] * 64}), 400, "exceed", "documents")
    assert_error(c.post("/v1/score", json={"text_1": "q", "text_2": ["d"] * 64}), 400, "exceed", "text_2")
    timer = RequestTimer(ServerMetrics())
    choices = [Choice(0, 1, timer, embedding=b"\0" * 16), Choice(1, 2, timer, finish_reason="length")]
    body = RerankRequest(query="q", documents=["a"])
    with pytest.raises(APIError, match=r"documents\[0\] could not be embedded") as caught:
        query, document = ("query", "q"), ("documents[0]", "a")
        RerankFormat("m", body, cosine_scorer([query, document], [(query, document)])).response(choices, {"prompt_tokens": 2})
    assert caught.value.param == "documents"
    first, second = ("text_1[0]", "q"), ("text_2[0]", "a")
    with pytest.raises(APIError, match=r"text_2\[0\] could not be embedded"):
        ScoreFormat("m", cosine_scorer([first, second], [(first, second)])).response(choices, {"prompt_tokens": 2})
    with pytest.raises(APIError, match=r"text_2\[1\] could not be scored"):  # a cross-encoder: one request a pair
        ScoreFormat("m", cross_scorer(["text_2[0]", "text_2[1]"], True)).response(choices, {"prompt_tokens": 2})


def test_server_wide_token_ids_and_forced_usage():
    """vLLM's --return-tokens-as-token-ids and --enable-force-include-usage: each request as if it asked."""
    c, _ = make_client(tokens_as_ids=True, force_include_usage=True)
    body = c.post(CHAT, json={"messages": USER, "logprobs": True}).json()
    assert body["choices"][0]["logprobs"]["content"][0]["token"].startswith("token_id:")
    response = c.post("/v1/responses", json={"input": "hi", "include": ["message.output_text.logprobs"]}).json()
    assert response["output"][-1]["content"][0]["logprobs"][0]["token"].startswith("token_id:")  # (review)
    with c.stream("POST", CHAT, json={"messages": USER, "stream": True,
                                      "stream_options": {"continuous_usage_stats": True}}) as resp:
        assert all(e["usage"] is not None for e in sse_events(resp))  # continuous, as the usage is forced (review)
    for path, request in ((CHAT, {"messages": USER}), (COMPLETIONS, {"prompt": "x"})):
        with c.stream("POST", path, json={**request, "stream": True}) as resp:
            events = sse_events(resp)
        assert events[-1]["choices"] == [] and events[-1]["usage"]["total_tokens"] == 8, path
    plain, _ = make_client()
    with plain.stream("POST", CHAT, json={"messages": USER, "stream": True}) as resp:
        assert all(e.get("usage") is None for e in sse_events(resp))


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("stop_token_ids, reason", [([7], 7), (None, None)])
def test_stop_reason_names_a_requested_stop_token_as_vllm(path, stop_token_ids, reason):
    """vLLM's ``stop_reason`` (read by its clients beside ``finish_reason``): the stop_token_ids id that ended the
    choice, None at EOS (token 7 here, which ``matched_stop`` names either way). It was missing: always null."""
    c, _ = make_client(stub=StubFrontend(finish="stop"))
    body = {"messages": USER} if path == CHAT else {"prompt": "hi"}
    body["stop_token_ids"] = stop_token_ids
    choice = c.post(path, json=body).json()["choices"][0]
    assert (choice["finish_reason"], choice["matched_stop"], choice["stop_reason"]) == ("stop", 7, reason)
    with c.stream("POST", path, json={**body, "stream": True}) as resp:
        last = [e for e in sse_events(resp) if e["choices"]][-1]["choices"][0]
    assert (last["finish_reason"], last["matched_stop"], last["stop_reason"]) == ("stop", 7, reason)


@pytest.mark.parametrize("path, field", [("/v1/embeddings", "input"), ("/classify", "input"),
                                         ("/v1/completions", "prompt")])
def test_token_prompts_longer_than_the_context_are_truncated_when_asked(path, field):
    """(review) With truncate_prompt_tokens a text longer than the context is cut by the tokenizer, but token ids
    were refused before it ("the prompt has 300 tokens: more than the context (256)") though vLLM cuts them too.
    Without it such ids stay a 400; with it they are bounded as a text's characters are."""
    from tpserve.pooling import ModelHead

    c, stub = make_client(**({"head": ModelHead(4, ("a", "b"))} if path == "/classify" else {}))
    ids = [5] * 300  # context 128
    resp = c.post(path, json={field: ids, "truncate_prompt_tokens": -1})
    assert resp.status_code == 200, resp.text
    assert stub.submitted[-1].input_ids == ids and stub.submitted[-1].params.truncate_prompt_tokens == -1
    assert_error(c.post(path, json={field: ids}), 400, "more than the context (128)", field)
    too_many = [5] * (LIMITS.max_prompt_chars + 1)
    assert_error(c.post(path, json={field: too_many, "truncate_prompt_tokens": 8}), 400, "a truncated prompt", field)


def test_chat_messages_and_tools_reach_the_template_as_vllm_normalizes_them():
    """As vLLM's chat parser hands them to the chat template: tools as ChatCompletionToolsParam.model_dump() (Qwen3's
    template writes each with tojson, so a missing description showed as no key, not vLLM's null, and extra keys or
    another key order changed the prompt); a past call's arguments that are no JSON or null as {} (were rendered as
    written / as null); an empty tool_calls dropped; reasoning under both names, ``reasoning`` winning (transformers
    picked reasoning_content); documents passed to the template (were ignored)."""
    c, stub = make_client()
    tools = [{"function": {"parameters": {"type": "object"}, "name": "f", "x": 1}, "type": "function", "cache": 1},
             {"type": "function", "function": {"strict": True, "name": "g", "description": "d"}}]
    msgs = [*USER, {"role": "assistant", "content": "", "reasoning": "new", "reasoning_content": "old", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{city: Paris"}},
        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": None}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "input_text", "text": "ok"}]},
        {"role": "assistant", "content": "done", "tool_calls": []}]
    docs = [{"title": "t", "text": "x"}]
    assert c.post(CHAT, json={"messages": msgs, "tools": tools, "tool_choice": "none", "documents": docs}).status_code == 200
    sent = stub.submitted[-1]
    assert sent.tools == [
        {"type": "function", "function": {"name": "f", "description": None, "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "g", "description": "d", "parameters": None, "strict": True}}]
    assert [call["function"]["arguments"] for call in sent.messages[1]["tool_calls"]] == [{}, {}]
    assert sent.messages[1]["reasoning"] == sent.messages[1]["reasoning_content"] == "new"
    assert sent.messages[2]["content"] == "ok" and "tool_calls" not in sent.messages[3]
    assert sent.documents == docs


@pytest.mark.parametrize("message, fragment", [
    ({"role": "tool", "content": "ok"}, "messages[1].tool_call_id"),
    ({"role": "tool", "tool_call_id": 5, "content": "ok"}, "messages[1].tool_call_id"),
    ({"role": "assistant", "tool_calls": "call"}, "messages[1].tool_calls must be a list"),
    ({"role": "assistant", "tool_calls": ["call"]}, "messages[1].tool_calls[0] must be"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}, "messages[1].tool_calls[0] must be"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}, "tool_calls[0] must be"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": 5, "arguments": "{}"}}]}, "tool_calls[0]"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": [1]}}]},
     "tool_calls[0].function.arguments must be a string"),
])
def test_malformed_tool_messages_and_calls_are_a_400(message, fragment):
    """A tool message without its tool_call_id, or a tool call that is no {"function": {"name", "arguments"}}, was
    rendered (a call without a name as `"name": ""`) or failed in the template with an unhelpful message."""
    c, stub = make_client()
    for path in (CHAT, "/tokenize"):
        assert_error(c.post(path, json={"messages": [*USER, message]}), 400, fragment, "messages")
    assert stub.submitted == []
    legacy = {"role": "function", "name": "now", "content": "12:00"}  # the legacy result: no tool_call_id to give
    assert c.post(CHAT, json={"messages": [*USER, legacy]}).status_code == 200
    bad_tool = {"type": "function", "function": {"name": "f", "description": 5}}
    assert_error(c.post(CHAT, json={"messages": USER, "tools": [bad_tool]}), 400, "description must be a string", "tools")


def test_default_chat_template_kwargs_reach_tokenize(qwen3_dir):
    """--default-chat-template-kwargs renders /tokenize's chats as the tokenizer workers render chat's; a request's
    reasoning_effort (or chat_template_kwargs) still wins."""
    args = ServerArgs(engine=EngineConfig(model=qwen3_dir), served_model_name=MODEL, context_len=128,
                      vocab_size=700, default_chat_template_kwargs={"enable_thinking": False})
    c = TestClient(create_app(AppState(args)))
    from tpserve.tokenizer.loader import load_tokenizer

    tok = load_tokenizer(qwen3_dir)
    assert tok.decode(c.post("/tokenize", json={"messages": USER}).json()["tokens"]).endswith("<think>\n\n</think>\n\n")
    thinking = c.post("/tokenize", json={"messages": USER, "reasoning_effort": "high"}).json()
    assert tok.decode(thinking["tokens"]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tool_choice_none_renders_no_tools_with_the_flag():
    """vLLM's --exclude-tools-when-tool-choice-none: the template gets no tools when tool_choice is "none" (by
    default it gets them, and any other tool_choice keeps them)."""
    c, stub = make_client()
    assert c.post(CHAT, json={"messages": USER, "tools": WEATHER, "tool_choice": "none"}).status_code == 200
    assert stub.submitted[-1].tools == template_tools(WEATHER)
    c, stub = make_client(exclude_tools_when_tool_choice_none=True, tool_call_parser="hermes")
    assert c.post(CHAT, json={"messages": USER, "tools": WEATHER, "tool_choice": "none"}).status_code == 200
    assert stub.submitted[-1].tools is None
    assert c.post(CHAT, json={"messages": USER, "tools": WEATHER, "tool_choice": "auto"}).status_code == 200
    assert stub.submitted[-1].tools == template_tools(WEATHER)


@pytest.mark.parametrize("tracking", [False, True])
def test_load_counts_the_calls_in_flight(tracking):
    """vLLM's GET /load: with --enable-server-load-tracking, the generating and pooling calls in flight (a stream
    until its last chunk); 0 without the flag."""
    args = ServerArgs(engine=EngineConfig(model="/nonexistent"), served_model_name=MODEL, context_len=128,
                      vocab_size=700, enable_server_load_tracking=tracking)
    state = AppState(args)
    state.serving = Serving(StubFrontend(), state.metrics, MODEL, LIMITS)  # type: ignore[arg-type]
    c = TestClient(create_app(state))
    seen = []
    with c.stream("POST", CHAT, json={"messages": USER, "stream": True}) as resp:
        for _ in resp.iter_lines():
            seen.append(c.get("/load").json()["server_load"])
    assert seen and set(seen) == ({1} if tracking else {0})
    assert c.get("/load").json() == {"server_load": 0}
    assert_error(c.post(CHAT, json={"messages": "no"}), 400)
    assert c.get("/load").json() == {"server_load": 0}  # a refused call counted only while it ran


@pytest.mark.parametrize("path", ["/v1/classify", "/classify", "/v1/score", "/v1/rerank", "/v2/rerank",
                                  "/v1/embeddings", "/v1/completions", "/api/v1/classify"])
def test_load_counts_every_served_pooling_path(path):
    """Every path tpserve serves a load-aware API under is counted (/v1/classify as /classify), a root_path
    prefix stripped."""
    import asyncio

    from tpserve.server.metrics import ServerMetrics, TrackServerLoad

    metrics = ServerMetrics(MODEL)
    seen = []

    async def inner(scope, receive, send):
        seen.append(metrics.server_load)

    scope = {"type": "http", "path": path, "root_path": "/api" if path.startswith("/api") else ""}
    asyncio.run(TrackServerLoad(inner, metrics)(scope, None, None))
    assert seen == [1] and metrics.server_load == 0


def test_granite_reasoning_whole_and_streamed():
    """--reasoning-parser granite: Granite 3.2's phrases split the reasoning from the answer, whole and streamed alike,
    the phrases cut across the stream's pieces."""
    reply = "Here is my thought process:\nAdd them.\nHere is my response:\n4"
    c, _ = make_client(stub=StubFrontend(reply=reply, pieces=11, finish="stop"), reasoning_parser="granite")
    msg = c.post(CHAT, json={"messages": USER}).json()["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("\nAdd them.\n", "\n4")
    with c.stream("POST", CHAT, json={"messages": USER, "stream": True}) as resp:
        deltas = [e["choices"][0]["delta"] for e in sse_events(resp)]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "\nAdd them.\n"
    assert "".join(d.get("content") or "" for d in deltas) == "\n4"


@pytest.mark.parametrize("parser, reply, content", [
    ("pythonic", 'Checking.[get_weather(city="Paris"), get_weather(city="Zürich, CH")]', "Checking."),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_weather", "arguments": {"city": "Zürich, CH"}}]', None),
    ("phi4_mini_json", 'Checking.functools[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                       '{"name": "get_weather", "arguments": {"city": "Zürich, CH"}}]', "Checking."),
])
def test_more_tool_parsers_whole_and_streamed(parser, reply, content):
    """--tool-call-parser pythonic, granite, phi4_mini_json through the chat API: the same calls whole and streamed
    (the stream's pieces cut through the calls), finish_reason tool_calls; and in the Responses API."""
    c, stub = make_client(stub=StubFrontend(reply=reply, pieces=9, finish="stop"), tool_call_parser=parser)
    choice = c.post(CHAT, json={"messages": USER, "tools": WEATHER}).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == content
    calls = choice["message"]["tool_calls"]
    assert [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Zürich, CH"})]
    assert stub.submitted[-1].params.skip_special_tokens is True  # none needs special tokens kept
    with c.stream("POST", CHAT, json={"messages": USER, "tools": WEATHER, "stream": True}) as resp:
        events = sse_events(resp)
    streamed: dict[int, dict] = {}
    for delta in (e["choices"][0]["delta"] for e in events):
        for t in delta.get("tool_calls") or []:
            call = streamed.setdefault(t["index"], {"name": "", "arguments": ""})
            call["name"] += t["function"].get("name", "")
            call["arguments"] += t["function"]["arguments"]
    assert [(s["name"], s["arguments"]) for s in streamed.values()] == [
        (t["function"]["name"], t["function"]["arguments"]) for t in calls]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == (content or "")
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    body = c.post("/v1/responses", json={"input": "hi", "tools": [
        {"type": "function", "name": "get_weather", "parameters": WEATHER[0]["function"]["parameters"]}]}).json()
    assert [(o["name"], json.loads(o["arguments"])) for o in body["output"] if o["type"] == "function_call"] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Zürich, CH"})]
