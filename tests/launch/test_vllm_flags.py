"""vLLM's command lines, pasted: its flags act on the tpserve settings they name, are taken as said where tpserve
always does it, are warned about where they have no effect, and are a clear error for what is not served."""

from __future__ import annotations

import shutil

import pytest

from tpserve.launch.args import parse_args


def vllm_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit):
        parse_args(argv)
    return capsys.readouterr().err


def test_a_pasted_vllm_command_line_sets_what_it_names(qwen3_dir):
    args = parse_args([qwen3_dir, "--device", "cpu", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
                       "--block-size", "32", "--enforce-eager", "--disable-custom-all-reduce",
                       "--no-enable-prefix-caching", "--enable-chunked-prefill", "--enable-auto-tool-choice",
                       "--tool-call-parser", "hermes", "--gpu-memory-utilization", "0.5", "--swap-space", "4",
                       "--disable-log-stats", "-O3", "--uvicorn-log-level", "warning", "--pipeline-parallel-size", "1",
                       "--scheduling-policy", "fcfs", "--task", "generate", "--tokenizer", qwen3_dir])
    engine = args.engine
    assert engine.model == qwen3_dir and engine.max_running_requests == 8 and engine.chunked_prefill_size == 64
    assert engine.page_size == 32 and engine.cuda_graph_max_bs == 0 and engine.all_reduce == "nccl"
    assert engine.cache == "naive" and engine.mem_fraction == 0.5 and args.tool_call_parser == "hermes"
    warned = " ".join(args.startup_warnings)
    for flag in ("--swap-space", "--disable-log-stats", "-O", "--uvicorn-log-level"):
        assert f"{flag}: no effect in tpserve" in warned
    defaults = parse_args([qwen3_dir, "--enable-prefix-caching", "--device", "cpu"])
    assert defaults.engine.cache == "radix" and defaults.engine.cuda_graph_max_bs > 0 and not defaults.startup_warnings
    assert engine.schedule_policy == defaults.engine.schedule_policy == "fcfs"
    assert parse_args([qwen3_dir, "--scheduling-policy", "priority"]).engine.schedule_policy == "priority"


@pytest.mark.parametrize("argv, message", [
    (["--lora-modules", "a=/x"], "--lora-modules a=/x: LoRA adapter /x: needs adapter_config.json"),
    (["--lora-modules", "a"], "argument --lora-modules: must be NAME=PATH"),
    (["--lora-modules", "a=/x", "a=/y"], "lora_modules names a LoRA adapter twice"),
    (["--served-model-name", "m", "b", "--lora-modules", "b=/x"],
     "--lora-modules b=/x: 'b' is the served model's name"),
    (["--speculative-config", '{"method": "eagle3", "model": "x", "num_speculative_tokens": 3}'],
     "speculative_config: tpserve serves method \"ngram\" only (method 'eagle3'"),
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size 2: tpserve splits a model by tensor parallelism"),
    (["--scheduling-policy", "priority", "--schedule-policy", "lpm"], "--scheduling-policy priority and --schedule-policy lpm: give one"),
    (["--model", "/elsewhere"], "the model is given twice"),
    (["--task", "embed", "--hf-overrides", '{"architectures": ["Qwen3ForSequenceClassification"]}'],
     "--task embed: this model does not serve it"),
    (["--convert", "classify"], "--convert classify: this model does not serve it"),
    (["--runner", "generate", "--hf-overrides", '{"architectures": ["Qwen3Model"]}'],
     "--runner generate: this model does not serve it"),
])
def test_what_tpserve_does_not_serve_is_a_clear_error(argv, message, qwen3_dir, capsys):
    assert message in vllm_error([qwen3_dir, *argv], capsys)


def test_tasks_the_model_serves_are_taken(qwen3_dir):
    for argv in (["--runner", "pooling"], ["--task", "embed"], ["--task", "score"], ["--convert", "none"]):
        assert parse_args([qwen3_dir, *argv]).engine.model == qwen3_dir


def test_an_hf_id_is_found_in_download_dir_at_its_revision(qwen3_dir, tmp_path, capsys):
    """--download-dir and --revision look a Hugging Face id up in that cache (offline, as always)."""
    commit = "a" * 40
    repo = tmp_path / "models--tiny-org--tiny-model"
    shutil.copytree(qwen3_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    args = parse_args(["tiny-org/tiny-model", "--download-dir", str(tmp_path), "--revision", commit])
    assert args.engine.model == str(repo / "snapshots" / commit)
    assert parse_args(["tiny-org/tiny-model", "--download-dir", str(tmp_path)]).engine.model == args.engine.model
    assert "is not in the local Hugging Face cache" in vllm_error(
        ["tiny-org/tiny-model", "--download-dir", str(tmp_path), "--revision", "b" * 40], capsys)
    assert "--tokenizer" in vllm_error([qwen3_dir, "--tokenizer", str(repo / "snapshots" / commit)], capsys)


def test_flags_may_be_spelled_with_underscores_as_vllm_takes_them(qwen3_dir):
    args = parse_args([qwen3_dir, "--max_num_seqs", "4", "--hf_overrides={\"max_position_embeddings\": 64}",
                       "--served-model-name", "a_b"])
    assert args.engine.max_running_requests == 4 and args.served_model_name == "a_b"  # values keep theirs
    assert args.engine.load_model_config().max_position_embeddings == 64


def test_plan_reads_the_overridden_config(qwen3_dir, capsys):
    from tpserve.plan.cli import main

    assert main(["--model", qwen3_dir, "--gpu", "cpu", "--hf-overrides", '{"max_position_embeddings": 96}']) == 0
    out = capsys.readouterr().out
    assert "context 96 tokens" in out and """--hf-overrides '{"max_position_embeddings": 96}'""" in out


def test_review_the_pasted_line_cannot_go_wrong_quietly(qwen3_dir, capsys, tmp_path):
    """(review) a model after --served-model-name served the demo model; on/off pairs depended on their order, not
    on which came last; a list flag took one value; a template starting with "--" lost its underscores."""
    assert "give MODEL before --served-model-name" in vllm_error(["--served-model-name", "foo", qwen3_dir], capsys)
    # a Hugging Face id after the first name too (it served the demo model under both names)
    assert "'org/model', a model id" in vllm_error(["--served-model-name", "foo", "org/model"], capsys)
    # vLLM's spellings are checked as tpserve's own flags are, and named as given
    assert "argument --max-num-seqs: must be >= 1, got '0'" in vllm_error(["--max-num-seqs", "0"], capsys)
    assert "argument --block-size: must be >= 1, got '0'" in vllm_error(["--block-size", "0"], capsys)
    last = parse_args([qwen3_dir, "--no-enable-prefix-caching", "--enable-prefix-caching"]).engine
    assert last.cache == "radix"
    off = parse_args([qwen3_dir, "--no-enable-chunked-prefill", "--max-num-batched-tokens", "4096"]).engine
    assert off.chunked_prefill_size == 0
    assert parse_args([qwen3_dir, "--enable-prefix-caching", "--no-enable-prefix-caching"]).engine.cache == "naive"
    sizes = parse_args([qwen3_dir, "--cuda-graph-sizes", "16", "32", "48", "--device", "cpu"])
    assert sizes.engine.model == qwen3_dir and "--cuda-graph-sizes: no effect" in sizes.startup_warnings[0]
    assert "--max-num-batched-tokens" in vllm_error([qwen3_dir, "--max-num-batched-tokens", "0"], capsys)
    template = tmp_path / "t.jinja"
    template.write_text("-- a_b {{ messages[0]['content'] }}")
    assert parse_args([qwen3_dir, "--chat-template", "-- a_b {{ messages_x }}"]).chat_template == "-- a_b {{ messages_x }}"
    assert "--tokenizer: model" in vllm_error([qwen3_dir, "--tokenizer", "/nonexistent"], capsys)
    assert str(tmp_path) in vllm_error(["tiny-org/tiny-model", "--download-dir", str(tmp_path)], capsys)
    two_classes = '{"architectures": ["Qwen3ForSequenceClassification"], "num_labels": 2}'
    assert "--task score: this model does not serve it" in vllm_error(
        [qwen3_dir, "--task", "score", "--hf-overrides", two_classes], capsys)
    assert "id2label" in vllm_error(
        [qwen3_dir, "--hf-overrides", '{"architectures": ["Qwen3ForSequenceClassification"], "id2label": ["a"]}'],
        capsys)


def test_a_pasted_vllm_serve_line_keeps_its_serve_word(qwen3_dir, monkeypatch):
    """`tpserve serve MODEL ...` (vLLM's `vllm serve` line) serves MODEL (it was "unrecognized arguments: MODEL")."""
    import tpserve.__main__ as entry

    served = []
    monkeypatch.setattr(entry, "serve", lambda args: served.append(args) or 0)
    assert entry.main(["serve", qwen3_dir, "--device", "cpu", "--max-num-seqs", "4"]) == 0
    assert served[0].engine.model == qwen3_dir and served[0].engine.max_running_requests == 4


def test_cors_is_off_unless_origins_are_allowed(qwen3_dir):
    """vLLM's CORS flags: a browser's preflight is answered for the allowed origins only."""
    from fastapi.testclient import TestClient

    from tpserve.server.api import AppState, create_app

    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    for argv, allowed in (([], None), (["--allowed-origins", '["https://app.example"]'], "https://app.example"),
                          (["--allowed-origins", '["https://other.example"]'], None)):
        client = TestClient(create_app(AppState(parse_args([qwen3_dir, *argv]))))
        answer = client.options("/v1/chat/completions", headers=preflight)
        assert answer.headers.get("access-control-allow-origin") == allowed, argv
        health = client.get("/health", headers={"Origin": "https://app.example"})
        assert health.headers.get("access-control-allow-origin") == allowed, argv
    with pytest.raises(SystemExit):
        parse_args([qwen3_dir, "--allowed-origins", "https://app.example"])  # not a JSON list


def test_vllm_server_flags_reach_the_server(qwen3_dir, capsys):
    args = parse_args([qwen3_dir, "--return-tokens-as-token-ids", "--enable-force-include-usage", "--root-path", "/llm",
                       "--enable-request-id-headers", "--response-role", "assistant",
                       "--chat-template-content-format", "string"])
    assert args.return_tokens_as_token_ids and args.enable_force_include_usage and args.root_path == "/llm"
    from fastapi.testclient import TestClient

    from tpserve.server.api import AppState, create_app

    client = TestClient(create_app(AppState(args)))  # a proxy's prefix, kept or stripped: the same routes (review)
    for path in ("/llm/v1/models", "/v1/models"):
        assert client.get(path).status_code == 200, path
    assert "is not served" in client.get("/llm/v1/images/generations").json()["error"]["message"]
    assert "role of chat answers is assistant" in vllm_error([qwen3_dir, "--response-role", "bot"], capsys)
    assert "--chat-template-content-format openai" in vllm_error(
        [qwen3_dir, "--chat-template-content-format", "openai"], capsys)


def test_chat_template_defaults_load_tracking_and_graph_size_flags(qwen3_dir, capsys):
    args = parse_args([qwen3_dir, "--device", "cpu", "--default-chat-template-kwargs", '{"enable_thinking": false}',
                       "--exclude-tools-when-tool-choice-none", "--enable-server-load-tracking",
                       "--max-cudagraph-capture-size", "16"])
    assert args.default_chat_template_kwargs == {"enable_thinking": False} and args.exclude_tools_when_tool_choice_none
    assert args.enable_server_load_tracking and args.engine.cuda_graph_max_bs == 16
    plain = parse_args([qwen3_dir, "--device", "cpu"])
    assert plain.default_chat_template_kwargs is None and not plain.exclude_tools_when_tool_choice_none
    assert not plain.enable_server_load_tracking
    assert "must be a JSON object" in vllm_error([qwen3_dir, "--default-chat-template-kwargs", "[1]"], capsys)
    with pytest.raises(SystemExit):
        parse_args([qwen3_dir, "--default-chat-template-kwargs", '{"tools": [], "messages": []}'])
    assert "--default-chat-template-kwargs may not set messages, tools" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--cpu-offload-gb", "4"], "--cpu-offload-gb: weights are not offloaded"),
    (["--rope-scaling", '{"rope_type": "yarn"}'], "--rope-scaling: give it as config.json's: --hf-overrides"),
    (["--headless"], "--headless: data parallelism across nodes is not served"),
    (["--tool-parser-plugin", "p.py"], "--tool-parser-plugin: tpserve runs no plugin code"),
    (["--logprobs-mode", "processed_logprobs"], "--logprobs-mode processed_logprobs: tpserve returns the model's own"),
])
def test_more_vllm_flags_tpserve_does_not_serve_are_errors(argv, message, qwen3_dir, capsys):
    assert message in vllm_error([qwen3_dir, *argv], capsys)


def test_more_vllm_flags_with_no_effect_are_warnings(qwen3_dir):
    args = parse_args([qwen3_dir, "--device", "cpu", "--distributed-executor-backend", "mp", "--fully-sharded-loras",
                       "--ignore-patterns", "original/*", "*.pth", "--logprobs-mode", "raw_logprobs",
                       "--structured-outputs-config", '{"backend": "xgrammar"}', "--max-num-partial-prefills", "2"])
    warned = " ".join(args.startup_warnings)
    for flag in ("--distributed-executor-backend", "--fully-sharded-loras", "--ignore-patterns",
                 "--structured-outputs-config", "--max-num-partial-prefills"):
        assert f"{flag}: no effect in tpserve" in warned


def test_short_parallel_flags_and_human_readable_lengths(qwen3_dir, capsys):
    """vLLM's -tp and -dp, and --max-model-len as its human_readable_int reads it (lower case x 1000, upper x 1024)."""
    args = parse_args([qwen3_dir, "--device", "cpu", "-tp", "2", "-dp", "1", "--max-model-len", "1.5k"])
    assert args.engine.tp_size == 2 and args.engine.dp_size == 1 and args.engine.max_model_len == 1500
    assert parse_args([qwen3_dir, "--device", "cpu", "--max-model-len", "2K"]).engine.max_model_len == 2048
    assert parse_args([qwen3_dir, "--device", "cpu", "--max-model-len", "1000"]).engine.max_model_len == 1000
    for bad in ("1.5K", "2x", "k"):
        assert "--max-model-len/--context-length: must be an integer" in vllm_error(
            [qwen3_dir, "--max-model-len", bad], capsys)
