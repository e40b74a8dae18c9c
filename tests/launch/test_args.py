"""Command-line parsing: aliases, defaults, validation errors without tracebacks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from tpserve.launch.args import API_KEY_ENV, DEMO_MODEL_NAME, build_parser, parse_args


def test_aliases_and_values(qwen3_dir):
    for flag in ("--tp-size", "--tensor-parallel-size", "--tp"):
        assert parse_args(["--model", qwen3_dir, flag, "2"]).engine.tp_size == 2
    a = parse_args(["--model-path", qwen3_dir, "--device", "cpu", "--dtype", "float32", "--host", "0.0.0.0",
                    "--port", "0", "--num-tokenizers", "2", "--max-running-requests", "8", "--page-size", "4",
                    "--mem-fraction", "0.5", "--max-total-tokens", "1024", "--load-format", "dummy",
                    "--served-model-name", "m", "--api-key", "k", "--log-level", "debug",
                    "--max-model-len", "100", "--debug-check-invariants", "--shell"])
    e = a.engine
    assert (e.model, e.device, e.dtype, e.max_running_requests, e.page_size) == (qwen3_dir, "cpu", "float32", 8, 4)
    assert (e.mem_fraction, e.max_total_tokens, e.load_format, e.max_model_len) == (0.5, 1024, "dummy", 100)
    assert e.debug_check_invariants and a.shell
    assert (a.host, a.port, a.num_tokenizers, a.served_model_name, a.api_key) == ("0.0.0.0", 0, 2, "m", "k")
    assert a.log_level == "debug" and a.context_len == 100 and a.startup_warnings == ()
    short = parse_args(["--model", qwen3_dir, "--max-total-tokens", "10", "--log-level", "ERROR"])
    assert short.log_level == "error" and short.context_len == 10  # the level in any case, as Python's logging takes it
    # logged once logging is set up (it was printed bare while parsing, whatever --log-level said)
    assert short.startup_warnings == ("--max-total-tokens 10 is below the context length 4096: requests are limited "
                                      "to 10 tokens",)


def test_advanced_engine_flags(qwen3_dir):
    e = parse_args(["--model", qwen3_dir, "--chunked-prefill-size", "64", "--prefix-cache", "naive",
                    "--schedule-policy", "lpm", "--attention-backend", "torch", "--cuda-graph-max-bs", "0",
                    "--disable-overlap"]).engine
    assert (e.chunked_prefill_size, e.cache, e.schedule_policy) == (64, "naive", "lpm")
    assert (e.attention_backend, e.cuda_graph_max_bs, e.disable_overlap) == ("torch", 0, True)


def test_vllms_fp8_kv_cache_dtype_is_e4m3(qwen3_dir):
    assert parse_args(["--model", qwen3_dir, "--kv-cache-dtype", "fp8"]).engine.kv_cache_dtype == "fp8_e4m3"


def test_defaults(qwen3_dir, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    a = parse_args(["--model", qwen3_dir])
    assert (a.host, a.port, a.num_tokenizers, a.shell, a.api_key) == ("127.0.0.1", 8000, 1, False, None)
    assert a.engine.tp_size == 1 and a.engine.device is None and a.engine.dtype is None
    assert a.served_model_name == os.path.basename(qwen3_dir) and not a.demo_model  # no local path shown
    assert a.context_len == 4096 and a.vocab_size >= 600


def test_api_key_from_env(qwen3_dir, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert parse_args(["--model", qwen3_dir]).api_key == "from-env"
    assert parse_args(["--model", qwen3_dir, "--api-key", "flag"]).api_key == "flag"


def test_default_is_the_tiny_demo_model(monkeypatch, tmp_path):
    monkeypatch.setenv("TPSERVE_CACHE", str(tmp_path))
    a = parse_args([])
    assert a.demo_model and a.served_model_name == DEMO_MODEL_NAME
    assert a.model_dir.startswith(str(tmp_path))


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--tp", "0"], "--tp-size/--tensor-parallel-size/--tp/-tp: must be >= 1, got '0'"),
        (["--tp-size", "two"], "must be an integer, got 'two'"),
        (["--port", "70000"], "must be in [0, 65535], got '70000'"),
        (["--mem-fraction", "1.5"], "must be in (0, 1], got '1.5'"),
        (["--page-size", "0"], "--page-size: must be >= 1"),
        (["--device", "tpu"], "invalid choice: 'tpu'"),
        (["--dtype", "int8"], "invalid choice: 'int8'"),
        (["--num-tokenizers", "0"], "--num-tokenizers: must be >= 1"),
        (["--max-model-len", "999999"], "exceeds the model's context length"),
        (["--tp-size", "3"], "--tp-size 3 does not divide num_attention_heads 4"),
        (["--device", "cpu", "--attention-backend", "flashinfer"], "--attention-backend flashinfer runs on CUDA"),
        (["--device", "cpu", "--decode-attention", "xqa"], "--decode-attention xqa: XQA is a kernel of the flashinfer attention backend, on CUDA; use --decode-attention auto"),
        (["--decode-attention", "fast"], "invalid choice: 'fast'"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--quantization", "awq"], "argument --quantization/-q: invalid choice: 'awq'"),
        # torch's generator takes a signed 64-bit seed: a larger one was a traceback in the rank (dummy weights)
        (["--seed", str(2**64)], f"argument --seed: must be in [0, 2**63), got '{2**64}'"),
        (["--generation-config", "/nowhere"], "--generation-config '/nowhere': no generation_config.json there"),
        (["--override-generation-config", "temperature=0.5"], "must be a JSON object, got 'temperature=0.5'"),
        (["--override-generation-config", '{"temperature": -1}'], "temperature must be a finite number >= 0"),
        (["--override-generation-config", '{"max_tokens": 5}'], "'max_tokens' is not one of temperature"),
    ],
)
def test_bad_values_are_usage_errors(qwen3_dir, capsys, argv, fragment):
    with pytest.raises(SystemExit) as e:
        parse_args(["--model", qwen3_dir, *argv])
    assert e.value.code == 2
    assert fragment in capsys.readouterr().err


def test_generation_config_flags(qwen3_dir, tmp_path):
    """The model's generation_config.json's sampling fields become the server's request defaults (the tiny
    model's has none); vllm turns them off; the override goes over either."""
    model = tmp_path / "model"
    shutil.copytree(qwen3_dir, model)
    generation = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**generation, "temperature": 0.6, "top_k": 20}))
    assert parse_args(["--model", qwen3_dir]).sampling_defaults == {}
    assert parse_args(["--model", str(model)]).sampling_defaults == {"temperature": 0.6, "top_k": 20}
    assert parse_args(["--model", str(model), "--generation-config", "vllm"]).sampling_defaults == {}
    assert parse_args(["--model", str(model), "--override-generation-config", '{"temperature": 0.3}']
                      ).sampling_defaults == {"temperature": 0.3, "top_k": 20}
    assert parse_args(["--model", qwen3_dir, "--generation-config", str(model)]).sampling_defaults == {
        "temperature": 0.6, "top_k": 20}


def test_expert_parallel_flag(tiny_model_factory, capsys):
    moe = tiny_model_factory("qwen3_moe", num_layers=3)  # 8 experts
    assert not parse_args(["--model", moe]).engine.expert_parallel
    for flag in ("--expert-parallel", "--enable-expert-parallel"):  # vLLM's spelling too
        assert parse_args(["--model", moe, "--tp-size", "2", flag]).engine.expert_parallel
    with pytest.raises(SystemExit):  # tiny_model_factory's models have 4 heads: TP 4 at most
        parse_args(["--model", tiny_model_factory("qwen3_moe", num_layers=3, num_experts=6), "--tp-size", "4",
                    "--expert-parallel"])
    assert "--tp-size 4 does not divide num_experts 6" in capsys.readouterr().err


def test_quantization_flag(qwen3_dir):
    assert parse_args(["--model", qwen3_dir]).engine.quantization is None
    assert parse_args(["--model", qwen3_dir, "--quantization", "fp8"]).engine.quantization == "fp8"
    assert parse_args(["--model", qwen3_dir, "-q", "fp8"]).engine.quantization == "fp8"


def test_missing_model(capsys, tmp_path):
    for model, fragment in (
        (str(tmp_path / "nope"), "is not a local directory"),
        (str(tmp_path), "has no config.json"),
        ("no-such-org/no-such-model", "not in the local Hugging Face cache"),
    ):
        with pytest.raises(SystemExit):
            parse_args(["--model", model])
        err = capsys.readouterr().err
        assert fragment in err
    with pytest.raises(SystemExit):
        parse_args(["--model", "no-such-org/no-such-model"])
    assert "offline" in capsys.readouterr().err


def test_help_explains_every_flag():
    text = build_parser().format_help()
    for flag in ("--model", "--model-path", "--tp-size", "--tensor-parallel-size", "--tp", "--device", "--dtype",
                 "--host", "--port", "--shell", "--num-tokenizers", "--max-running-requests", "--page-size",
                 "--mem-fraction", "--max-total-tokens", "--load-format", "--served-model-name", "--api-key",
                 "--log-level", "--max-model-len", "--debug-check-invariants"):
        assert flag in text
    parser = build_parser()
    assert [a.option_strings for a in parser._actions if not a.help] == []
    # the planner is a subcommand argparse does not list: --help points to it
    assert "python -m tpserve plan --help" in " ".join(text.split())


def test_cli_error_has_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "tpserve", "--tp", "-3"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "must be >= 1, got '-3'" in proc.stderr


def test_cuda_without_cuda_is_a_usage_error(qwen3_dir, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        parse_args(["--model", qwen3_dir, "--device", "cuda"])
    assert e.value.code == 2
    assert "--device cuda: CUDA is not available" in capsys.readouterr().err


def test_model_without_weights_names_the_flag(qwen3_dir, tmp_path, capsys):
    for name in os.listdir(qwen3_dir):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(qwen3_dir, name), tmp_path / name)
    with pytest.raises(SystemExit) as e:
        parse_args(["--model", str(tmp_path)])
    assert e.value.code == 2
    assert "pass --load-format dummy for random weights" in capsys.readouterr().err
    assert parse_args(["--model", str(tmp_path), "--load-format", "dummy"]).engine.load_format == "dummy"


@pytest.mark.parametrize(
    "name, text, fragment",
    [
        ("config.json", "{bad", "config.json is not valid JSON: Expecting property name"),
        ("config.json", "[1, 2]", "config.json must hold a JSON object, not a list"),
        ("generation_config.json", "{bad", "generation_config.json is not valid JSON"),
        ("model.safetensors", "not safetensors", "model.safetensors is not a readable safetensors file"),
        ("tokenizer.json", "{bad", "cannot load the tokenizer in"),
    ],
)
def test_damaged_model_files_are_usage_errors_naming_the_file(qwen3_dir, tmp_path, capsys, name, text, fragment):
    model_dir = shutil.copytree(qwen3_dir, tmp_path / "m")
    (model_dir / name).write_text(text)
    with pytest.raises(SystemExit) as e:
        parse_args(["--model", str(model_dir)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err and str(model_dir / name) in err


def test_mistyped_config_value_is_a_usage_error(qwen3_dir, tmp_path, capsys):
    model_dir = shutil.copytree(qwen3_dir, tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "hidden_size": "big"}))
    with pytest.raises(SystemExit) as e:
        parse_args(["--model", str(model_dir)])  # was a traceback from huggingface_hub's strict dataclass
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, "one line"
    assert "config.json cannot be read as a qwen3 config" in err and "'hidden_size' expected int, got str" in err


def test_non_positive_model_size_is_a_usage_error(qwen3_dir, tmp_path, capsys):
    model_dir = shutil.copytree(qwen3_dir, tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "num_attention_heads": 0}))
    with pytest.raises(SystemExit) as e:
        parse_args(["--model", str(model_dir)])  # was a crash in every rank
    assert e.value.code == 2
    assert "config.json: num_attention_heads must be a positive integer, got 0" in capsys.readouterr().err


def test_model_without_tokenizer_files_is_a_usage_error(qwen3_dir, tmp_path, capsys):
    """transformers 5 makes an empty tokenizer for such a directory: every prompt would encode to
    no tokens and every answer decode to no text."""
    model_dir = shutil.copytree(qwen3_dir, tmp_path / "m", ignore=shutil.ignore_patterns("tokenizer*"))
    with pytest.raises(SystemExit) as e:
        parse_args(["--model", str(model_dir)])
    assert e.value.code == 2
    assert f"--model: no tokenizer in {model_dir} (none of tokenizer.json" in capsys.readouterr().err


def test_bad_tp_size_fails_before_any_process_starts(qwen3_dir):
    """One line on stderr, exit 2, fast: the check runs when the arguments are parsed."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "tpserve", "--model", qwen3_dir, "--tp-size", "3", "--device", "cpu"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    error_lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert error_lines == ["tpserve: error: --tp-size 3 does not divide num_attention_heads 4"]
    assert time.monotonic() - start < 30


def test_api_flags_of_issue_12(qwen3_dir, tmp_path):
    a = parse_args(["--model", qwen3_dir])
    assert a.tool_call_parser == "hermes"  # the tiny model's template writes <tool_call> blocks
    assert a.reasoning_parser is None and a.chat_template is None and a.model_aliases == ()
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    a = parse_args(["--model", qwen3_dir, "--served-model-name", "a", "b", "--chat-template", str(template),
                    "--reasoning-parser", "qwen3"])
    assert (a.served_model_name, a.model_aliases, a.reasoning_parser) == ("a", ("b",), "qwen3")
    assert a.chat_template.startswith("{% for") and a.tool_call_parser is None  # the new template has no tools
    assert parse_args(["--model", qwen3_dir, "--tool-call-parser", "llama3_json"]).tool_call_parser == "llama3_json"
    assert parse_args(["--model", qwen3_dir, "--tool-call-parser", "none"]).tool_call_parser is None
    with pytest.raises(SystemExit):
        parse_args(["--model", qwen3_dir, "--chat-template", str(tmp_path / "missing.jinja")])
    inline = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # the template itself, as vLLM takes it
    assert parse_args(["--model", qwen3_dir, "--chat-template", inline]).chat_template == inline


def test_a_bad_inline_chat_template_is_a_usage_error(qwen3_dir, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--model", qwen3_dir, "--chat-template", "{{ messages | no_such_filter }}"])
    assert e.value.code == 2
    assert "--chat-template is not a valid chat template: No filter named 'no_such_filter'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "content, fragment",
    [
        ("{% for m in messages %}{{ m.content }", "is not a valid chat template: unexpected '}' (line 1)"),
        ("{{ messages | no_such_filter }}", "is not a valid chat template: No filter named 'no_such_filter'"),
        (b"\xff\xfe{{ x }}", "is not UTF-8 text"),
    ],
)
def test_bad_chat_template_is_a_usage_error(qwen3_dir, tmp_path, capsys, content, fragment):
    """Not a server whose every chat request fails with the template's error."""
    template = tmp_path / "t.jinja"
    template.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(SystemExit) as e:
        parse_args(["--model", qwen3_dir, "--chat-template", str(template)])
    assert e.value.code == 2
    assert f"--chat-template: {template} {fragment}" in capsys.readouterr().err


def test_empty_served_model_name_is_a_usage_error(qwen3_dir, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--model", qwen3_dir, "--served-model-name", "m", ""])
    assert e.value.code == 2
    assert "--served-model-name: a name must not be empty" in capsys.readouterr().err


@pytest.mark.parametrize(
    "alias, original",
    [
        (["--context-length", "100"], ["--max-model-len", "100"]),
        (["--gpu-memory-utilization", "0.5"], ["--mem-fraction", "0.5"]),
        (["--mem-fraction-static", "0.5"], ["--mem-fraction", "0.5"]),
        (["--dtype", "half"], ["--dtype", "float16"]),
        (["--dtype", "float"], ["--dtype", "float32"]),
        (["--dtype", "bf16"], ["--dtype", "bfloat16"]),
        (["--trust-remote-code"], []),
    ],
)
def test_vllm_and_sglang_spellings_parse_to_the_same_config(qwen3_dir, alias, original):
    assert parse_args(["--model", qwen3_dir, *alias]) == parse_args(["--model", qwen3_dir, *original])


def test_errors_are_one_line_and_abbreviations_are_refused(qwen3_dir, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--model", qwen3_dir, "--mem", "0.5"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["tpserve: error: unrecognized arguments: --mem"]  # (0.5 reads as the positional MODEL, as vLLM's)


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--tp-size", "2", "--nnodes", "4", "--dist-init-addr", "h:1"],
         "--tp-size 2 is not a multiple of --nnodes 4: every node runs --tp-size / --nnodes ranks"),
        (["--tp-size", "2", "--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "h:1"],
         "--node-rank must be in [0, 2), got 2"),
        (["--tp-size", "2", "--nnodes", "2"], "--nnodes 2 needs --dist-init-addr (node 0's HOST:PORT)"),
        (["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", "nohost"], "--dist-init-addr: expected HOST:PORT"),
        (["--nnodes", "0"], "--nnodes: must be >= 1"),
        (["--dist-timeout", "0"], "--dist-timeout: must be in (0, 2,000,000] seconds, got '0'"),
        (["--dist-timeout", "1e300"], "--dist-timeout: must be in (0, 2,000,000] seconds"),  # was torch's OverflowError
        (["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", "no.such.host.invalid:29555"],
         "--dist-init-addr no.such.host.invalid:29555: cannot resolve 'no.such.host.invalid'"),  # was the ranks' error
        (["--tp-size", "2", "--nnodes", "2", "--dp-size", "2", "--dist-init-addr", "127.0.0.1:1"],
         "data-parallel replicas run on one node: --dp-size 2 with --nnodes 2 is not supported"),
        (["--tp-size", "2", "--nnodes", "2", "--all-reduce", "one_shot", "--dist-init-addr", "127.0.0.1:1"],
         "--all-reduce one_shot goes through peer GPU memory, which does not span nodes"),
        (["--tp-size", "2", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "127.0.0.1:1", "--shell"],
         "--shell runs on node 0; --node-rank 1 only runs its ranks: drop --shell"),
    ],
)
def test_bad_node_flags_are_usage_errors(qwen3_dir, capsys, monkeypatch, argv, fragment):
    monkeypatch.delenv("TPSERVE_DIST_TOKEN", raising=False)  # the flags are checked first
    with pytest.raises(SystemExit) as e:
        parse_args(["--model", qwen3_dir, *argv])
    if "TPSERVE_DIST_TOKEN" in capsys.readouterr().err:
        assert "--shell" in argv  # only the shell's own check comes after the token's
    monkeypatch.setenv("TPSERVE_DIST_TOKEN", "a-long-enough-token")
    with pytest.raises(SystemExit) as e:
        parse_args(["--model", qwen3_dir, *argv])
    assert e.value.code == 2
    assert fragment in capsys.readouterr().err


def test_node_flags(qwen3_dir, monkeypatch, capsys):
    argv = ["--model", qwen3_dir, "--tp-size", "4", "--nnodes", "2", "--node-rank", "1",
            "--dist-init-addr", "10.0.0.7:29500", "--dist-timeout", "20"]
    monkeypatch.delenv("TPSERVE_DIST_TOKEN", raising=False)
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert "TPSERVE_DIST_TOKEN is not set: a multi-node job needs the same secret on every node" in capsys.readouterr().err
    monkeypatch.setenv("TPSERVE_DIST_TOKEN", "short")
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert "TPSERVE_DIST_TOKEN is shorter than 16 characters" in capsys.readouterr().err
    monkeypatch.setenv("TPSERVE_DIST_TOKEN", "a-long-enough-token")
    e = parse_args(argv).engine
    assert (e.nnodes, e.node_rank, e.dist_init_addr, e.dist_timeout) == (2, 1, "tcp://10.0.0.7:29500", 20.0)
    one = parse_args(["--model", qwen3_dir]).engine
    assert (one.nnodes, one.node_rank, one.dist_init_addr) == (1, 0, None)


def test_docs_list_every_flag_and_choice():
    """docs/api.md's flag table (multi-node flags: docs/deploy.md) against the parser: a flag or a
    choice added to the CLI and not to the docs fails here."""
    root = os.path.join(os.path.dirname(__file__), "..", "..", "docs")
    api = open(os.path.join(root, "api.md"), encoding="utf-8").read()
    docs = api + open(os.path.join(root, "deploy.md"), encoding="utf-8").read()
    rows = {line.split("|")[1]: line for line in api.splitlines() if line.startswith("| `--")}
    for action in build_parser()._actions:
        flags = [f for f in action.option_strings if f.startswith("--") and f != "--help"]
        if not flags:
            continue
        assert all(f"`{flag}" in docs for flag in flags), flags
        if action.choices:
            row = next(line for key, line in rows.items() if f"`{flags[0]}`" in key or f"`{flags[0]} " in key)
            missing = [c for c in action.choices if f"`{c}`" not in row and c not in ("auto", "none")]
            assert missing == [], f"{flags[0]}: {missing} not in docs/api.md"


def test_hf_overrides_replace_config_keys(qwen3_dir):
    overrides = '{"architectures": ["Qwen3ForSequenceClassification"], "num_labels": 2}'
    args = parse_args(["--model", qwen3_dir, "--hf-overrides", overrides])
    assert json.loads(args.engine.hf_overrides) == json.loads(overrides)
    assert args.engine.load_model_config().labels == ("LABEL_0", "LABEL_1") and args.head.classifies
    with pytest.raises(SystemExit):
        parse_args(["--model", qwen3_dir, "--hf-overrides", "[1]"])


def test_the_shell_needs_a_model_that_generates(qwen3_dir, capsys):
    overrides = '{"architectures": ["Qwen3ForSequenceClassification"], "num_labels": 2}'
    with pytest.raises(SystemExit):
        parse_args(["--model", qwen3_dir, "--shell", "--hf-overrides", overrides])
    assert "--shell chats with the model, but this checkpoint (Qwen3ForSequenceClassification) has no LM head" in (
        capsys.readouterr().err)


def test_lora_flags(qwen3_dir, monkeypatch):
    """--max-loras (vLLM's) sets the adapter slots; --allow-runtime-lora-updating, or vLLM's
    VLLM_ALLOW_RUNTIME_LORA_UPDATING=true, serves /v1/load_lora_adapter and gives the layers slots."""
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    plain = parse_args(["--model", qwen3_dir])
    assert not plain.allow_runtime_lora_updating and plain.engine.lora_slots == 0
    flagged = parse_args(["--model", qwen3_dir, "--allow-runtime-lora-updating", "--max-loras", "3"])
    assert flagged.allow_runtime_lora_updating and flagged.engine.enable_lora and flagged.engine.lora_slots == 3
    assert parse_args(["--model", qwen3_dir, "--enable-lora"]).engine.lora_slots == 1
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    assert parse_args(["--model", qwen3_dir]).allow_runtime_lora_updating
    help_text = " ".join(build_parser().format_help().split())
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in help_text and "/v1/load_lora_adapter" in help_text
