"""A hostile client against a real server (TP 2 on the CPU): malformed and oversized requests
get a 4xx with an OpenAI-shaped body, nothing they started keeps running, a huge body does not
delay anyone else, and /health tells when a rank stops making progress."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import pytest
from server_process import metrics, running_server

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
MAX_BYTES = 1_000_000
HEALTH_TIMEOUT_S = 3
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(qwen3_dir):
    yield from running_server(["--model", qwen3_dir, "--device", "cpu", "--tp-size", "2", "--max-total-tokens", "2048",
                             "--max-request-bytes", str(MAX_BYTES), "--health-timeout", str(HEALTH_TIMEOUT_S)])


@pytest.fixture(scope="module")
def url(server) -> str:
    return server.url


def chat(**fields):
    return CHAT, {"messages": USER, "max_tokens": 4, **fields}


def completion(**fields):
    return COMPLETIONS, {"prompt": "hello", "max_tokens": 4, **fields}


HOSTILE = [
    # integers outside 64 bits, anywhere
    (*chat(max_tokens=10**20), "max_tokens"),
    (*chat(top_k=10**30), "top_k"),
    (*chat(stop_token_ids=[2**70]), "stop_token_ids"),
    (*chat(seed=2**64), "seed"),
    (*completion(prompt=[[1, 2, 3], [2**70]], max_tokens=3000, ignore_eos=True), "prompt"),
    (*completion(prompt=[2**63]), "prompt"),
    (*chat(logit_bias={"5": 10**40}), "logit_bias"),
    # text UTF-8 cannot encode
    (CHAT, {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    (*chat(stop="\udfff"), "stop"),
    (*completion(prompt="a\ud800b"), "prompt"),
    (*completion(prompt=["ok", "\udc00"]), "prompt"),
    # values out of range or of the wrong type
    (*chat(temperature="hot"), "temperature"),
    (*chat(temperature=-1), "temperature"),
    (*chat(temperature=1e309), "temperature"),
    (*chat(top_p=0), "top_p"),
    (*chat(top_p=2), "top_p"),
    (*chat(min_p=-0.5), "min_p"),
    (*chat(max_tokens=0), "max_tokens"),
    (*chat(max_tokens=-5), "max_tokens"),
    (*chat(max_tokens="ten"), "max_tokens"),
    (*chat(n=0), "n"),
    (*chat(n=10**6), "n"),
    (*chat(logit_bias={"abc": 1}), "logit_bias"),
    (*chat(presence_penalty=5), "presence_penalty"),
    (*chat(response_format={"type": "bogus"}), "response_format"),
    (*chat(tools="not a list"), "tools"),
    (*chat(chat_template_kwargs="x"), "chat_template_kwargs"),
    (*chat(top_logprobs=5), "top_logprobs"),
    # malformed messages
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": "hi"}, "messages"),
    (CHAT, {"messages": [{"content": "no role"}]}, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": 42}]}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages"),
    # prompts
    (*completion(prompt=[]), "prompt"),
    (*completion(prompt=[[]]), "prompt"),
    (*completion(prompt=[-1]), "prompt"),
    (*completion(prompt=[10**9]), "prompt"),
    (*completion(prompt=["x"] * 256, n=16), "n"),
    (*completion(prompt="word " * 80_000), "prompt"),  # more characters than the context can hold
    (*completion(prompt=list(range(1, 3000))), "prompt"),  # more tokens than the (KV-capped) context
    (*completion(prompt=[10**9], echo=True), "prompt"),
    (*completion(best_of=3), "best_of"),
    (*completion(logprobs=1000), "logprobs"),
    (*completion(suffix="x"), "suffix"),
    # the Responses API
    (RESPONSES, {"input": "hi", "max_output_tokens": 10**20}, "max_output_tokens"),
    (RESPONSES, {"input": "\ud800"}, "input"),
    (RESPONSES, {"input": [{"role": "user", "content": 42}]}, "input"),
    (RESPONSES, {"input": [{"type": "function_call_output"}]}, "input"),
    (RESPONSES, {"input": "hi", "tools": "x"}, "tools"),
    (RESPONSES, {"input": "hi", "tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools"),
    (RESPONSES, {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}},
     "text.format"),
    (RESPONSES, {"input": "word " * 80_000}, "input"),  # more characters than the context can hold
    (RESPONSES, {"input": "a " * 3000}, "input"),  # more tokens than the (KV-capped) context
    (RESPONSES, {"input": "hi", "previous_response_id": "resp_unknown"}, "previous_response_id"),
    (RESPONSES, {"input": "hi", "background": True, "store": False}, "background"),
]


def assert_openai_error(resp: httpx.Response, status: int | None = None) -> dict:
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text[:300])
    if status is not None:
        assert resp.status_code == status, resp.text[:300]
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error" and error["code"], error
    return error


def metric(url: str, name: str) -> float:
    return metrics(url).get(name, float("nan"))


def test_metrics_show_the_pool_before_any_request(url):
    assert metric(url, "tpserve_kv_pages_total") > 0


@pytest.mark.parametrize("path,body,field", HOSTILE, ids=[f"{i}-{c[2]}" for i, c in enumerate(HOSTILE)])
def test_hostile_request_is_a_4xx(url, path, body, field):
    # json.dumps as a raw client would send it: \ud800 escapes, Infinity for 1e309
    raw = json.dumps(body).encode()
    resp = httpx.post(f"{url}{path}", content=raw, headers={"content-type": "application/json"}, timeout=30)
    error = assert_openai_error(resp)
    assert field in (error["param"] or "") + error["message"], error


@pytest.mark.parametrize("raw", [b"{not json", b"[]", b"null", b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}'])
def test_bodies_that_are_not_requests(url, raw):
    resp = httpx.post(f"{url}{CHAT}", content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert_openai_error(resp, 400)


def test_server_is_healthy_and_idle_after_the_hostile_requests(url):
    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    assert httpx.post(f"{url}{COMPLETIONS}", json=body, timeout=60).json()["usage"]["completion_tokens"] == 8
    assert httpx.get(f"{url}/health").status_code == 200
    deadline = time.monotonic() + 10
    while metric(url, "tpserve_num_requests_running") != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(url, "tpserve_num_requests_running") == 0, "a rejected request left a sequence running"
    assert metric(url, "tpserve_kv_pages_used") == 0


def test_a_huge_body_does_not_delay_a_small_request(url):
    small = {"prompt": "hello", "max_tokens": 2, "temperature": 0}
    start = time.monotonic()
    httpx.post(f"{url}{COMPLETIONS}", json=small, timeout=60).raise_for_status()
    alone = time.monotonic() - start

    results: dict[str, object] = {}

    def send_huge() -> None:
        huge = {"messages": [{"role": "user", "content": "x" * 20_000_000}]}
        results["huge"] = httpx.post(f"{url}{CHAT}", json=huge, timeout=120)

    thread = threading.Thread(target=send_huge)
    thread.start()
    time.sleep(0.05)
    start = time.monotonic()
    httpx.post(f"{url}{COMPLETIONS}", json=small, timeout=60).raise_for_status()
    delayed = time.monotonic() - start
    thread.join(60)
    assert delayed - alone < 1.0, (alone, delayed)
    resp = results["huge"]
    assert isinstance(resp, httpx.Response)
    assert assert_openai_error(resp, 413)["code"] == "request_too_large"
    # Under the byte cap but far over what the context can hold: rejected before tokenizing.
    start = time.monotonic()
    big = {"messages": [{"role": "user", "content": "y" * (MAX_BYTES - 1000)}]}
    assert_openai_error(httpx.post(f"{url}{CHAT}", json=big, timeout=60), 400)
    assert time.monotonic() - start < 2.0


def test_connections_that_send_nothing_are_closed_and_do_not_crowd_others_out(url):
    """uvicorn timed out idle keep-alive connections only after a response: ones that never sent a request stayed
    open, and a client holding as many as the open-files limit locked every other client out (a probe)."""
    import socket

    host, port = url.removeprefix("http://").rsplit(":", 1)
    idle = [socket.create_connection((host, int(port)), timeout=30) for _ in range(20)]
    try:
        assert httpx.post(url + COMPLETIONS, json={"prompt": "hi", "max_tokens": 2}, timeout=60).status_code == 200
        start = time.monotonic()
        for conn in idle:
            assert conn.recv(1) == b"", "the server closes an idle connection (recv returns at its end)"
        assert time.monotonic() - start < 25  # uvicorn's keep-alive timeout, 5 s
    finally:
        for conn in idle:
            conn.close()


def test_advertised_context_is_what_the_kv_cache_holds(url):
    model = httpx.get(f"{url}/v1/models").json()["data"][0]
    assert model["max_model_len"] == 2048 and "/" not in model["id"]


def test_flush_cache_updates_the_gauges(url):
    body = {"prompt": "The same prefix for the cache " * 4, "max_tokens": 2}
    httpx.post(f"{url}{COMPLETIONS}", json=body, timeout=60).raise_for_status()
    deadline = time.monotonic() + 10
    while metric(url, "tpserve_kv_pages_cached") == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(url, "tpserve_kv_pages_cached") > 0
    assert httpx.post(f"{url}/flush_cache").status_code == 200
    deadline = time.monotonic() + 10
    while metric(url, "tpserve_kv_pages_cached") != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(url, "tpserve_kv_pages_cached") == 0


def test_defaults_and_tiny_temperatures_mean_what_they_say(url):
    body = {"prompt": "Once upon a time", "max_tokens": None, "ignore_eos": True}
    usage = httpx.post(f"{url}{COMPLETIONS}", json=body, timeout=60).json()["usage"]
    assert usage["completion_tokens"] == 16  # OpenAI's default for /v1/completions, not the context
    greedy = {"prompt": "Once upon a time", "max_tokens": 12, "ignore_eos": True, "temperature": 0}
    tiny = {**greedy, "temperature": 1e-50}
    texts = [httpx.post(f"{url}{COMPLETIONS}", json=b, timeout=60).json()["choices"][0]["text"] for b in (greedy, tiny)]
    assert texts[0] == texts[1]


@pytest.mark.parametrize("child, named", [("scheduler-tp1", "scheduler rank 1"), ("tokenizer-0", "tokenizer 0"),
                                          ("detokenizer", "the detokenizer")])
def test_a_stopped_process_turns_health_503(server, url, child, named):
    """Last in the module: SIGSTOP on a rank, a tokenizer, the detokenizer; /health must name it within the window."""
    pid = int(re.search(rf"tpserve-{child} \(pid (\d+)\)", server.log).group(1))
    assert httpx.get(f"{url}/health").status_code == 200
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + HEALTH_TIMEOUT_S + 5
        status = 200
        while time.monotonic() < deadline and status == 200:
            time.sleep(0.25)
            resp = httpx.get(f"{url}/health")
            status = resp.status_code
        assert status == 503, f"health stayed 200 with a stopped {child}"
        assert resp.json()["error"]["code"] == "backend_stalled"
        assert resp.json()["error"]["message"].startswith(f"{named} has made no progress")
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while httpx.get(f"{url}/health").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.25)
    assert httpx.get(f"{url}/health").status_code == 200