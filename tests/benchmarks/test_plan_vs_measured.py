"""benchmarks/plan_vs_measured.py end to end on the CPU: two Gloo ranks of a tiny model, the
planner's prediction beside the measured step (the figures mean nothing on a shared CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks")


def test_plan_vs_measured_on_two_cpu_ranks(tiny_model_factory, tmp_path):
    model = tiny_model_factory("qwen3", vocab_size=1024)  # decode_latency's random token ids reach 1,000
    out = str(tmp_path / "plan.json")
    result = subprocess.run(
        [sys.executable, os.path.join(BENCHMARKS, "plan_vs_measured.py"), "--case", f"{model}:2",
         "--batch-sizes", "1,2", "--context", "16", "--modes", "pipelined,graph", "--warmup", "1", "--iters", "2",
         "--device", "cpu", "--gpu", "cpu", "--out", out],
        check=False, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "predicted (table (cpu)) vs measured (pipelined compared)" in result.stdout
    with open(out) as f:
        rows = json.load(f)["rows"]
    assert [(r["tp"], r["batch"]) for r in rows] == [(2, 1), (2, 2)]
    for row in rows:
        assert row["predicted_ms"] > row["predicted_allreduce_ms"] > 0 and row["graph_ms"] > 0 and row["pipelined_ms"] > 0
        assert row["measured/predicted"] > 0
