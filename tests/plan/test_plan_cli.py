"""``python -m tpserve plan``: the report, the commands it recommends, one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from plan_configs import LLAMA_3_70B, QWEN3_0_6B, QWEN3_235B_A22B, data_config, write_config

from tpserve.plan.cli import main

QWEN3_8B = data_config("Qwen3-8B")


def plan(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_report_has_every_split_and_both_recommendations(capsys):
    code, out, _ = plan(capsys, "--model", QWEN3_8B, "--gpus", "8", "--gpu", "h100", "--context", "8192")
    assert code == 0
    for split in ("TP1 x DP8", "TP2 x DP4", "TP4 x DP2", "TP8 x DP1"):
        assert split in out
    for column in ("fits", "KV tokens/replica", "b1 step ms", "b64 tok/s", "max-batch tok/s", "prefill ms", "all-reduce"):
        assert column in out
    assert "\nlatency: TP" in out and "\nthroughput: TP" in out
    assert f"python -m tpserve --model {QWEN3_8B} --tp-size" in out and "--max-model-len 8192" in out


def test_small_model_recommends_dp_replicas_with_their_commands(tmp_path, capsys):
    model = write_config(str(tmp_path / "Qwen3-0.6B"), QWEN3_0_6B)
    code, out, _ = plan(capsys, "--model", model, "--gpus", "8", "--context", "4096", "--workload", "batch")
    assert code == 0
    throughput = out[out.index("throughput:"):]
    assert throughput.startswith("throughput: TP1 x DP8")  # batch: throughput first
    assert "--tp-size 1 --max-model-len 4096 --dp-size 8" in throughput  # eight replicas behind one server


def test_multi_node_commands_are_per_node(capsys):
    code, out, _ = plan(capsys, "--model", QWEN3_8B, "--gpus", "2", "--nodes", "2", "--context", "4096")
    assert code == 0 and "machine: 2 x h200 x 2 nodes" in out
    assert "TP1 x DP4" in out and "TP2 x DP2" in out and "TP4 x DP1" in out
    assert "(on each of the 2 nodes: " in out and "load balancer in front of the nodes" in out
    assert "--tp-size 1 --max-model-len 4096 --dp-size 2" in out or "--tp-size 2 --max-model-len 4096\n" in out


def test_tp_across_nodes_gets_one_command_per_node():
    from tpserve.plan.cost import GPUS, ModelShape
    from tpserve.plan.splits import Machine, Settings, evaluate, launch_commands
    from tpserve.config import ModelConfig

    machine = Machine(GPUS["h200"], 2, 2)
    shape = ModelShape(ModelConfig.from_pretrained(QWEN3_8B), 2)
    commands = launch_commands(evaluate(shape, machine, 4, Settings(4096)), "M", machine, Settings(4096))
    assert len(commands) == 2
    for rank, command in enumerate(commands):
        assert "--tp-size 4 " in command and "--nnodes 2 --dist-init-addr NODE0_IP:29500" in command
        assert f"--node-rank {rank}" in command and command.startswith("TPSERVE_DIST_TOKEN=")


def test_model_that_fits_nowhere_says_so(tmp_path, capsys):
    model = write_config(str(tmp_path / "big"), QWEN3_235B_A22B)
    code, out, _ = plan(capsys, "--model", model, "--gpus", "1", "--gpu", "h200")
    assert code == 0
    assert "TP1 x DP1" in out and " no " in out
    assert "latency: none" in out and "throughput: none" in out and "the weights fit no split" in out


def test_seed_example_machine_custom_gpu(tmp_path, capsys):
    model = write_config(str(tmp_path / "llama70b"), LLAMA_3_70B)
    code, out, _ = plan(
        capsys, "--model", model, "--gpus", "8", "--gpu", "custom", "--memory-gib", "80", "--bandwidth-tbps", "3.35",
        "--tflops", "989", "--allreduce-us", "10", "--busbw-gbps", "360", "--context", "4096",
    )
    assert code == 0 and "8 x custom (custom): 80 GiB, copy 3.35 TB/s, matmul 989 TFLOP/s, all-reduce 10 us + 360 GB/s bus" in out
    assert "TP8 x DP1" in out


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--gpus", "0"], "--gpus: must be in [1, 1024], got '0'"),
        # a NaN traceback, a loop over 10**9 TP sizes, a plan at 0 tok/s
        (["--memory-gib", "1e308"], "--memory-gib: must be in [0.001, 1e+06], got '1e308'"),
        (["--gpus", "1000000000"], "--gpus: must be in [1, 1024], got '1000000000'"),
        (["--nodes", "100000000"], "--nodes: must be in [1, 1024], got '100000000'"),
        (["--bandwidth-tbps", "1e-320"], "--bandwidth-tbps: must be in [0.001, 10000], got '1e-320'"),
        (["--context", "abc"], "--context: must be an integer, got 'abc'"),
        (["--context", "100000"], "--context 100000 exceeds the model's context length 40960"),
        (["--gpu", "b200"], "argument --gpu: invalid choice: 'b200'"),
        (["--gpu", "custom", "--tflops", "100"], "--gpu custom needs --memory-gib, --bandwidth-tbps"),
        (["--mem-fraction", "1.5"], "--mem-fraction-static: must be in (0, 1], got '1.5'"),
        (["--busbw-gbps", "-3"], "--busbw-gbps: must be in [0.001, 1e+07], got '-3'"),
        # it recommended `--max-model-len 1`, which the server refuses (a prompt token and a generated one)
        (["--context", "1"], "--context: must be >= 2, got '1'"),
    ],
)
def test_bad_values_are_one_line_errors(capsys, argv, fragment):
    assert main(["--model", QWEN3_8B, *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tpserve plan: error: ") and fragment in err


def test_default_context_is_capped_at_the_models(tmp_path, capsys):
    """Llama 3 70B serves 8,192 tokens: the plan without --context is for 8,192, not an error
    about the default 32,768."""
    model = write_config(str(tmp_path / "Llama-3-70B"), LLAMA_3_70B)
    code, out, err = plan(capsys, "--model", model, "--gpus", "8")
    assert code == 0, err
    assert "context 8,192 tokens" in out and "--max-model-len 8192" in out
    code, out, _ = plan(capsys, "--model", QWEN3_8B, "--gpus", "8")
    assert code == 0 and "context 32,768 tokens" in out


def test_bad_model_is_one_line_error(tmp_path, capsys):
    assert main(["--model", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nowhere" in err
    other = write_config(str(tmp_path / "gpt2"), {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    assert main(["--model", other]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "GPT2LMHeadModel" in err


def test_python_dash_m_tpserve_plan_dispatches():
    result = subprocess.run(
        [sys.executable, "-m", "tpserve", "plan", "--model", QWEN3_8B, "--gpus", "2", "--context", "2048"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert "TP2 x DP1" in result.stdout and "latency:" in result.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "tpserve", "plan", "--model", QWEN3_8B, "--nodes", "x"],
        capture_output=True, text=True, timeout=120,
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "'x'" in bad.stderr


def test_dtype_takes_the_servers_spellings_and_every_flag_is_explained(capsys):
    code, out, err = plan(capsys, "--model", QWEN3_8B, "--dtype", "half", "--context", "2048")
    assert code == 0, err  # was "invalid choice: 'half'", which the server's --dtype takes
    assert out == plan(capsys, "--model", QWEN3_8B, "--dtype", "float16", "--context", "2048")[1]
    from tpserve.plan.cli import build_parser

    unexplained = [a.option_strings for a in build_parser()._actions if not a.help]
    assert unexplained == []  # --memory-gib had no help


def test_the_servers_memory_fraction_spellings(capsys):
    """``--gpu-memory-utilization`` (vLLM) and ``--mem-fraction-static`` (SGLang) were "unrecognized arguments"."""
    args = ("--model", QWEN3_8B, "--context", "2048")
    expected = plan(capsys, *args, "--mem-fraction", "0.6")[1]
    for flag in ("--gpu-memory-utilization", "--mem-fraction-static"):
        assert plan(capsys, *args, flag, "0.6")[1] == expected
    assert expected != plan(capsys, *args)[1]


def test_the_launch_commands_carry_every_engine_flag_the_plan_used(capsys):
    """The printed commands serve what was planned: a --dtype and --max-running-requests given to the plan were left
    out (the server then took the checkpoint's dtype and 256 requests)."""
    args = ("--model", QWEN3_8B, "--context", "2048", "--gpus", "2")
    _, out, _ = plan(capsys, *args, "--dtype", "float32", "--max-running-requests", "8")
    commands = [line for line in out.splitlines() if "python -m tpserve" in line]
    assert commands and all("--dtype float32" in c and "--max-running-requests 8" in c for c in commands)
    _, out, _ = plan(capsys, *args)
    commands = [line for line in out.splitlines() if "python -m tpserve" in line]
    assert commands and not any("--dtype" in c or "--max-running-requests" in c for c in commands)
