"""End to end: vLLM's runtime LoRA loading (VLLM_ALLOW_RUNTIME_LORA_UPDATING=true) through a real server (tiny model,
CPU, TP 1, one adapter slot): load, generate with it (PEFT's tokens), list, a second adapter whose requests take turns
in the slot with the first's, unload with a stream of it running (the stream ends as PEFT's), the error after unload,
and the checks as 400s and 404s."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_process import running_server

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def adapters(qwen3_dir, tmp_path_factory) -> dict[str, str]:
    from lora_adapters import make_adapter

    all_layers = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    return {"all": make_adapter(qwen3_dir, str(tmp_path_factory.mktemp("all")), all_layers),
            "qv": make_adapter(qwen3_dir, str(tmp_path_factory.mktemp("qv")), ("q_proj", "v_proj"), seed=1),
            "r8": make_adapter(qwen3_dir, str(tmp_path_factory.mktemp("r8")), ("q_proj",), rank=8)}


@pytest.fixture(scope="module")
def url(qwen3_dir, adapters):
    yield from (server.url for server in running_server(
        ["--model", qwen3_dir, "--device", "cpu", "--served-model-name", "tiny", "--max-lora-rank", "4"],
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}))


def completion_tokens(url: str, model: str, max_tokens: int) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "logprobs": 0, "return_tokens_as_token_ids": True})


def chunk_tokens(line: str) -> list[str]:
    """A completion stream's ``data: {...}`` line's tokens (the last chunk has none)."""
    return (json.loads(line.removeprefix("data: "))["choices"][0]["logprobs"] or {}).get("tokens", [])


def ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def test_load_generate_list_unload(url, qwen3_dir, adapters):
    from lora_adapters import peft_greedy
    from reference import hf_greedy

    resp = httpx.post(f"{url}{LOAD}", json={"lora_name": "sql", "lora_path": adapters["all"]})
    assert resp.status_code == 200 and resp.text == "Success: LoRA adapter 'sql' added successfully."
    models = httpx.get(f"{url}/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["tiny", "sql"] and models[1]["root"] == adapters["all"]
    out = completion_tokens(url, "sql", 6).json()
    assert out["model"] == "sql" and ids(out["choices"][0]["logprobs"]["tokens"]) == \
        peft_greedy(qwen3_dir, adapters["all"], PROMPT, 6)[0]
    # a second adapter with the one slot taken: loaded; requests of both at once take turns in the slot
    assert httpx.post(f"{url}{LOAD}", json={"lora_name": "qv", "lora_path": adapters["qv"]}).status_code == 200
    names = ["sql", "qv", "sql", "qv", "tiny"]
    with ThreadPoolExecutor(len(names)) as pool:
        outs = list(pool.map(lambda model: completion_tokens(url, model, 6).json(), names))
    for name, out in zip(names, outs):
        adapter = {"sql": adapters["all"], "qv": adapters["qv"]}.get(name)
        expected = hf_greedy(qwen3_dir, PROMPT, 6) if adapter is None else peft_greedy(qwen3_dir, adapter, PROMPT, 6)[0]
        assert ids(out["choices"][0]["logprobs"]["tokens"]) == expected, name
    info = [line for line in httpx.get(f"{url}/metrics").text.splitlines() if line.startswith("vllm:lora_requests_info")]
    assert len(info) == 1 and info[0].startswith('vllm:lora_requests_info{max_lora="1",running_lora_adapters=""'), info

    # unloaded while a stream of it runs: the stream ends with the adapter's tokens, new requests get a 404
    body = {"model": "sql", "prompt": PROMPT, "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": True,
            "logprobs": 0, "return_tokens_as_token_ids": True}
    streamed: list[str] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as stream:
        lines = (line for line in stream.iter_lines() if line.startswith("data: {"))
        streamed += chunk_tokens(next(lines))
        resp = httpx.post(f"{url}{UNLOAD}", json={"lora_name": "sql"})
        assert resp.status_code == 200 and resp.text == "Success: LoRA adapter 'sql' removed successfully."
        gone = completion_tokens(url, "sql", 2)
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found", gone.text
        for line in lines:
            streamed += chunk_tokens(line)
    assert ids(streamed) == peft_greedy(qwen3_dir, adapters["all"], PROMPT, 64)[0]
    assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["tiny", "qv"]

    # the slot is freed (zeroed): the other adapter, copied in again, runs as PEFT's
    out = completion_tokens(url, "qv", 6).json()
    assert ids(out["choices"][0]["logprobs"]["tokens"]) == peft_greedy(qwen3_dir, adapters["qv"], PROMPT, 6)[0]
    assert httpx.post(f"{url}{UNLOAD}", json={"lora_name": "qv"}).status_code == 200


def test_errors_are_400s_and_404s(url, adapters, tmp_path):
    cases = [
        (LOAD, {"lora_name": "x", "lora_path": str(tmp_path / "nowhere")}, 404, "No adapter found"),
        (LOAD, {"lora_name": "x", "lora_path": str(tmp_path)}, 400, "needs adapter_config.json"),
        (LOAD, {"lora_name": "x", "lora_path": adapters["r8"]}, 400, "more than --max-lora-rank 4"),
        (LOAD, {"lora_name": "tiny", "lora_path": adapters["qv"]}, 400, "is the served model's name"),
        (LOAD, {"lora_name": "x"}, 400, "Both 'lora_name' and 'lora_path' must be provided."),
        (UNLOAD, {"lora_name": "x"}, 404, "The lora adapter 'x' cannot be found."),
    ]
    for path, body, status, message in cases:
        resp = httpx.post(f"{url}{path}", json=body)
        assert resp.status_code == status and message in resp.json()["error"]["message"], (body, resp.text)


def test_a_beam_search_ends_with_the_adapter_it_began_with(url, adapters):
    """A beam search sends a request per step, each naming its adapter: unloaded mid-search (and its name then loaded
    with another adapter), the search still ends with its own adapter's beams (later steps were a 400: 'not
    loaded'); the unload answers once the search is done."""
    body = {"model": "beam", "prompt": PROMPT, "max_tokens": 64, "n": 4, "use_beam_search": True, "ignore_eos": True}

    def load(path: str) -> int:
        return httpx.post(f"{url}{LOAD}", json={"lora_name": "beam", "lora_path": path}).status_code

    def running() -> bool:
        metrics = httpx.get(f"{url}/metrics").text
        return any(line.startswith("tpserve_num_requests_running") and not line.endswith(" 0.0")
                   for line in metrics.splitlines())

    assert load(adapters["all"]) == 200
    expected = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"]
    with ThreadPoolExecutor(1) as pool:
        search = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=120)
        deadline = time.monotonic() + 60
        while not running() and not search.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert httpx.post(f"{url}{UNLOAD}", json={"lora_name": "beam"}, timeout=120).status_code == 200
        assert load(adapters["qv"]) == 200
        resp = search.result()
    assert resp.status_code == 200 and resp.json()["choices"] == expected, resp.text
    assert httpx.post(f"{url}{UNLOAD}", json={"lora_name": "beam"}).status_code == 200
