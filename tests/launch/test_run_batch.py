"""``tpserve run-batch``: OpenAI batch files answered offline through the server's own app (real processes, the
tiny model on the CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

LINES = [
    {"custom_id": "completion", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": [40, 41, 42, 43], "max_tokens": 6, "temperature": 0, "ignore_eos": True}},
    {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}},
    {"custom_id": "embedding", "method": "POST", "url": "/v1/embeddings", "body": {"input": [5, 6, 7]}},
    {"custom_id": "refused", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}},
    {"custom_id": "no-route", "method": "POST", "url": "/v1/models", "body": {}},
    {"custom_id": "streamed", "method": "POST", "url": "/v1/completions", "body": {"prompt": "a", "stream": True}},
]


def run_batch(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "tpserve", "run-batch", *argv], capture_output=True, text=True,
                          timeout=300, env=env)


def test_run_batch_answers_each_line_in_order(qwen3_dir, tmp_path):
    from reference import hf_greedy
    from tpserve.tokenizer.loader import load_tokenizer

    given = tmp_path / "in.jsonl"
    given.write_text("\n".join([*map(json.dumps, LINES), "not json", ""]) + "\n")
    out = tmp_path / "out.jsonl"
    done = run_batch("-i", str(given), "-o", str(out), "--model", qwen3_dir, "--device", "cpu")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "wrote 7 results" in done.stderr and "(4 failed)" in done.stderr
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == [*(line["custom_id"] for line in LINES), None]
    assert all(r["id"].startswith("batch_req_") for r in results)
    completion, chat, embedding, refused, no_route, streamed, not_json = results
    text = completion["response"]["body"]["choices"][0]["text"]
    expected = load_tokenizer(qwen3_dir).decode(hf_greedy(qwen3_dir, [40, 41, 42, 43], 6))
    assert completion["response"]["status_code"] == 200 and text == expected and completion["error"] is None
    assert chat["response"]["body"]["object"] == "chat.completion"
    assert chat["response"]["request_id"] in chat["response"]["body"]["id"]
    assert len(embedding["response"]["body"]["data"][0]["embedding"]) > 0
    assert refused["response"]["status_code"] == 400 and refused["response"]["body"]["error"]["param"] == "messages"
    assert no_route["response"] is None and "url must be one of" in no_route["error"]["message"]
    assert "stream is not supported" in streamed["error"]["message"]
    assert not_json["error"]["message"].startswith("line 7:")


@pytest.mark.parametrize("argv, message", [
    (["-i", "/nonexistent/in.jsonl", "-o", "/tmp/x.jsonl"], "--input-file '/nonexistent/in.jsonl'"),
    (["-o", "/tmp/x.jsonl"], "the following arguments are required: -i/--input-file"),
    (["-i", __file__, "-o", "/nonexistent/dir/out.jsonl"], "--output-file '/nonexistent/dir/out.jsonl'"),
    (["-i", __file__, "-o", "/tmp/x.jsonl", "--shell"], "--shell does not combine with run-batch"),
])
def test_run_batch_usage_errors_name_the_flag(qwen3_dir, argv, message):
    done = run_batch(*argv, "--model", qwen3_dir, "--device", "cpu")
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr
