"""``tpserve run-batch``: OpenAI batch files answered offline through the server's own app (real processes, the
tiny model on the CPU)."""

from __future__ import annotations

import json
import os
import shutil
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
    # (review) a prompt holding U+2028 and U+0085 unescaped, as json.dumps(ensure_ascii=False) writes them, is one
    # line; a NaN is that line's 400, deep nesting that line's error, not the batch's end; line numbers count blanks
    unusual = [json.dumps({"custom_id": "separators", "method": "POST", "url": "/v1/completions",
                           "body": {"prompt": "a\u2028b\x85c", "max_tokens": 2}}, ensure_ascii=False),
               '{"custom_id": "nan", "method": "POST", "url": "/v1/completions", "body": {"prompt": "a", '
               '"temperature": NaN}}',
               "[" * 100_000 + "]" * 100_000,
               json.dumps({"custom_id": "background", "method": "POST", "url": "/v1/responses",
                           "body": {"input": "hi", "background": True}})]
    given.write_text("\n".join([*map(json.dumps, LINES), "", "not json", *unusual]) + "\n")
    out = tmp_path / "out.jsonl"
    done = run_batch("-i", str(given), "-o", str(out), "--model", qwen3_dir, "--device", "cpu")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "wrote 11 results" in done.stderr and "(7 failed)" in done.stderr
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == [*(line["custom_id"] for line in LINES), None, "separators", "nan",
                                                 None, "background"]
    assert all(r["id"].startswith("batch_req_") for r in results)
    completion, chat, embedding, refused, no_route, streamed, not_json, separators, nan, deep, background = results
    assert separators["response"]["status_code"] == 200
    assert nan["response"]["status_code"] == 400 and "temperature" in nan["response"]["body"]["error"]["message"]
    assert deep["error"]["message"].startswith("line 11:")
    assert "background is not supported" in background["error"]["message"]
    text = completion["response"]["body"]["choices"][0]["text"]
    expected = load_tokenizer(qwen3_dir).decode(hf_greedy(qwen3_dir, [40, 41, 42, 43], 6))
    assert completion["response"]["status_code"] == 200 and text == expected and completion["error"] is None
    assert chat["response"]["body"]["object"] == "chat.completion"
    assert chat["response"]["request_id"] in chat["response"]["body"]["id"]
    assert len(embedding["response"]["body"]["data"][0]["embedding"]) > 0
    assert refused["response"]["status_code"] == 400 and refused["response"]["body"]["error"]["param"] == "messages"
    assert no_route["response"] is None and "url must be one of" in no_route["error"]["message"]
    assert "stream is not supported" in streamed["error"]["message"]
    assert not_json["error"]["message"].startswith("line 8:")  # after the blank line 7
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask  # as open() makes a file, not a temporary file's 0o600


def test_run_batch_answers_score_and_rerank_lines(qwen3_dir, tmp_path):
    """(review) vLLM's run-batch takes score and rerank requests (any url ending in /score or /rerank): so does this
    one, at each path the server answers them on."""
    score = {"text_1": "a", "text_2": ["b", "c"]}
    rerank = {"query": "a", "documents": ["b", "c"]}
    urls = [("/v1/score", score), ("/score", score), ("/v1/rerank", rerank), ("/rerank", rerank),
            ("/v2/rerank", rerank)]
    given, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    given.write_text("".join(json.dumps({"custom_id": url, "method": "POST", "url": url, "body": body}) + "\n"
                             for url, body in urls))
    done = run_batch("-i", str(given), "-o", str(out), "--model", qwen3_dir, "--device", "cpu")
    assert done.returncode == 0, done.stderr[-2000:]
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == [url for url, _ in urls]
    assert all(r["error"] is None and r["response"]["status_code"] == 200 for r in results), results
    scores = [r["response"]["body"] for r in results]
    first, second = ([d["score"] for d in s["data"]] for s in scores[:2])
    assert len(first) == 2 and first == pytest.approx(second, abs=1e-5)  # batched with others: not bit-equal
    assert all(len(s["results"]) == 2 for s in scores[2:])


def test_a_replaced_output_file_keeps_its_mode(qwen3_dir, tmp_path):
    given, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    given.write_text(json.dumps(LINES[0]) + "\n")
    out.write_text("earlier results\n")
    out.chmod(0o640)
    done = run_batch("-i", str(given), "-o", str(out), "--model", qwen3_dir, "--device", "cpu")
    assert done.returncode == 0, done.stderr[-2000:]
    assert out.stat().st_mode & 0o777 == 0o640 and len(out.read_text().splitlines()) == 1


def test_a_failed_run_leaves_the_output_file_as_it_was(qwen3_dir, tmp_path):
    broken = tmp_path / "model"
    shutil.copytree(qwen3_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    given, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    given.write_text(json.dumps(LINES[0]) + "\n")
    out.write_text("earlier results\n")
    done = run_batch("-i", str(given), "-o", str(out), "--model", str(broken), "--device", "cpu")
    assert done.returncode != 0 and out.read_text() == "earlier results\n"
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".partial"] == []


@pytest.mark.parametrize("argv, message", [
    (["-i", "/nonexistent/in.jsonl", "-o", "/tmp/x.jsonl"], "--input-file '/nonexistent/in.jsonl'"),
    (["-o", "/tmp/x.jsonl"], "the following arguments are required: -i/--input-file"),
    (["-i", __file__, "-o", "/nonexistent/dir/out.jsonl"], "--output-file '/nonexistent/dir/out.jsonl'"),
    (["-i", __file__, "-o", "/tmp"], "--output-file '/tmp' is a directory"),  # was a traceback after all the work
    (["-i", __file__, "-o", "/tmp/x.jsonl", "--shell"], "--shell does not combine with run-batch"),
])
def test_run_batch_usage_errors_name_the_flag(qwen3_dir, argv, message):
    done = run_batch(*argv, "--model", qwen3_dir, "--device", "cpu")
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr


def test_a_500_is_that_lines_answer():
    """(review) The app re-raises what it answers with a 500: through the in-process transport that ended the batch."""
    import asyncio

    from tpserve.engine_config import EngineConfig
    from tpserve.launch.args import ServerArgs
    from tpserve.launch.batch import _answer_all, in_process_client
    from tpserve.server.api import AppState
    from tpserve.server.limits import RequestLimits
    from tpserve.server.serving import Serving

    class BrokenFrontend:
        def new_rid(self) -> int:
            return 1

        async def submit(self, requests, queue) -> None:
            raise RuntimeError("the tokenizer socket is gone")

        async def abort(self, rid: int) -> None:
            pass

    args = ServerArgs(engine=EngineConfig(model="/nonexistent"), served_model_name="m", context_len=128, vocab_size=700)
    state = AppState(args)
    state.serving = Serving(BrokenFrontend(), state.metrics, "m", RequestLimits(128, 8))  # type: ignore[arg-type]
    line = json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {"prompt": "a"}})

    async def answer():
        async with in_process_client(state, None) as client:
            return await _answer_all(client, [(1, line), (2, line)], 4)

    results = asyncio.run(answer())
    assert [r["response"]["status_code"] for r in results] == [500, 500]
    assert results[0]["response"]["body"]["error"]["type"] == "server_error"
