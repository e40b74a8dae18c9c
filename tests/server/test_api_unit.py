"""The HTTP layer in-process (FastAPI TestClient + a stub backend): validation, error bodies,
auth, readiness, response and stream formats."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from stub_frontend import StubFrontend
from tpserve.config import EngineConfig
from tpserve.server.api import AppState, create_app
from tpserve.launch.args import ServerArgs
from tpserve.server.serving import Serving

MODEL = "tiny-test"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def make_client(api_key: str | None = None, ready: bool = True):
    args = ServerArgs(engine=EngineConfig(model="/nonexistent"), served_model_name=MODEL,
                      context_len=128, vocab_size=700, api_key=api_key)
    state = AppState(args)
    stub = StubFrontend()
    if ready:
        state.serving = Serving(stub, state.metrics, MODEL)  # type: ignore[arg-type]
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
    err = assert_error(c.post(CHAT, json={"messages": USER}), 503)
    assert err["code"] == "not_ready"
    assert c.get("/version").status_code == 200


def test_health_version_metrics(client):
    assert client.get("/health").json() == {"status": "ok"}
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


def test_models(client):
    body = client.get("/v1/models").json()
    assert body["object"] == "list" and body["data"][0]["id"] == MODEL
    assert body["data"][0]["max_model_len"] == 128
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert_error(client.get("/v1/models/other"), 404)


def test_flush_cache():
    c, stub = make_client()
    assert c.post("/flush_cache").status_code == 200
    assert stub.flushes == 1


# ---- validation ----
@pytest.mark.parametrize(
    "path, body, fragment, param",
    [
        (CHAT, {"messages": []}, None, "messages"),
        (CHAT, {}, "missing required parameter 'messages'", "messages"),
        (CHAT, {"messages": USER, "n": 17}, "n must be at most 16", "n"),
        (CHAT, {"messages": USER, "top_logprobs": 2}, "needs logprobs: true", "top_logprobs"),
        (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs must be in", "top_logprobs"),
        (CHAT, {"messages": USER, "presence_penalty": 0.5}, "presence_penalty", "presence_penalty"),
        (CHAT, {"messages": USER, "frequency_penalty": 1}, "frequency_penalty", "frequency_penalty"),
        (CHAT, {"messages": USER, "temperature": -1}, None, "temperature"),
        (CHAT, {"messages": USER, "top_p": 0}, None, "top_p"),
        (CHAT, {"messages": USER, "top_k": -2}, None, "top_k"),
        (CHAT, {"messages": USER, "min_p": 2}, None, "min_p"),
        (CHAT, {"messages": USER, "max_tokens": 0}, None, "max_tokens"),
        (CHAT, {"messages": USER, "seed": -1}, "seed", "seed"),
        (CHAT, {"messages": USER, "stop": 5}, None, None),
        (CHAT, {"messages": USER, "stop": [""]}, "empty", "stop"),
        (CHAT, {"messages": USER, "tools": [{"type": "function"}]}, "tools", "tools"),
        (CHAT, {"messages": USER, "response_format": {"type": "json_object"}}, "response_format", None),
        (CHAT, {"messages": USER, "stream_options": {"include_usage": True}}, "stream=true", None),
        (CHAT, {"messages": USER, "frobnicate": 1}, "unsupported parameter 'frobnicate'", "frobnicate"),
        (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, None, None),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, None, None),
        (CHAT, {"messages": USER, "max_tokens": 5, "max_completion_tokens": 6}, "not both", None),
        (COMPLETIONS, {"prompt": "x", "echo": True}, "echo", "echo"),
        (COMPLETIONS, {"prompt": "x", "best_of": 2}, "best_of", "best_of"),
        (COMPLETIONS, {"prompt": "x", "logprobs": 21}, "logprobs must be in", "logprobs"),
        (COMPLETIONS, {"prompt": "x", "suffix": "y"}, "suffix", "suffix"),
        (COMPLETIONS, {"prompt": []}, "empty", "prompt"),
        (COMPLETIONS, {"prompt": [[1, 2], []]}, "empty", "prompt"),
        (COMPLETIONS, {"prompt": [1, "a"]}, None, None),
        (COMPLETIONS, {}, "missing required parameter 'prompt'", "prompt"),
    ],
)
def test_bad_requests_are_400(client, path, body, fragment, param):
    assert_error(client.post(path, json=body), 400, fragment, param)


def test_invalid_json_is_400(client):
    err = assert_error(client.post(CHAT, content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert "JSON" in err["message"]


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
    assert req.messages[0] == {"role": "system", "content": "ab"}
    assert req.params.max_tokens == 4 and req.params.seed is None


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
