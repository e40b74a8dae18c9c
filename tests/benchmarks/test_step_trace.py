"""The offline benchmark's step trace and the roofline read from it, on a tiny model on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks")


def run(script: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, os.path.join(BENCHMARKS, script), *args],
        check=False, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_traced_offline_run_and_its_roofline(tiny_model_factory, tmp_path):
    model = tiny_model_factory("qwen3", vocab_size=10_240)  # the workload's token ids reach 10,000
    out = str(tmp_path / "trace.json")
    printed = run(
        "offline_throughput.py", "--model", model, "--num-requests", "6", "--max-input-len", "40",
        "--max-output-len", "12", "--dtype", "float32", "--trace", "--out", out,
    )
    assert "Step trace" in printed and "Decode steps by batch size" in printed
    with open(out) as f:
        result = json.load(f)
    assert result["traced"] is True
    fields = result["trace"]["step_fields"]
    steps = [dict(zip(fields, values)) for values in result["trace"]["steps"]]
    launched = [s for s in steps if s["seqs"]]
    # Every generated token comes from a launched step's sample: decode rows plus finished prefills.
    assert sum(s["decode_seqs"] for s in launched) <= result["output_tokens"] <= sum(s["seqs"] for s in launched)
    # Every prompt token and every output token but each request's last is computed once.
    computed = sum(s["prefill_tokens"] + s["decode_seqs"] for s in launched)
    assert computed == result["input_tokens"] + result["output_tokens"] - result["requests"]

    printed = run("roofline.py", out, "--model", model, "--peak-tflops", "1", "--bandwidth-tbps", "0.001")
    assert "compute-aware" in printed and "ceilings of the workload" in printed


def test_moe_roofline_counts_touched_experts_and_active_flops():
    """Qwen3-30B-A3B: one decode token reads 8 experts a layer (~3 B weights, 6.1 GB), a large batch
    all 128 (the whole 30.5 B model, 61 GB); FLOPs count the 8 active experts per token only."""
    config = os.path.join(os.path.dirname(__file__), "..", "data", "configs", "Qwen3-30B-A3B")
    printed = run("roofline.py", "--model", config, "--decode-batch", "1", "4096", "--peak-tflops", "766",
                  "--bandwidth-tbps", "4")
    rows = {int(line.split()[0]): line.split() for line in printed.splitlines()[1:]}
    assert float(rows[1][1]) == 8.0 and float(rows[1][2]) == 6.08 and float(rows[1][3]) == 6.1
    assert float(rows[4096][1]) == 128.0 and 60 < float(rows[4096][2]) < 62
    assert abs(float(rows[4096][3]) / 4096 - 6.08) < 0.01  # 2 FLOPs per active weight per token


def test_environment_sets_variables_for_a_block_then_restores_them(monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)
    from common import environment

    monkeypatch.setenv("TPSERVE_TEST_KEPT", "1")
    monkeypatch.delenv("TPSERVE_TEST_NEW", raising=False)
    with environment({"TPSERVE_TEST_KEPT": "0", "TPSERVE_TEST_NEW": "2"}):
        assert os.environ["TPSERVE_TEST_KEPT"] == "0" and os.environ["TPSERVE_TEST_NEW"] == "2"
    assert os.environ["TPSERVE_TEST_KEPT"] == "1" and "TPSERVE_TEST_NEW" not in os.environ
