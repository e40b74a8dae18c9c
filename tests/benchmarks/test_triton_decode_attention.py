"""benchmarks/experiments/triton_decode_attention.py: its split-KV decode attention kernels against
float64 attention in Triton's CPU interpreter (both merges, empty splits, GQA 1 to 8), and every
launch that made compiled for Hopper (sm_90) on the CPU, so the GPU run that times them against
FlashInfer's decode wrapper starts from kernels that compile. Skipped where triton is missing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATHS = [os.path.join(ROOT, "tests", "kernels"), os.path.join(ROOT, "benchmarks", "experiments")]


def test_kernels_match_float64_and_compile_for_hopper(tmp_path):
    launches = str(tmp_path / "launches.jsonl")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(PATHS + [os.environ.get("PYTHONPATH", "")])}
    script = f"from hopper_compile import record_launches; record_launches({launches!r}); " \
             "import triton_decode_attention; triton_decode_attention.check()"
    run = subprocess.run([sys.executable, "-c", script], env={**env, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr
    with open(launches) as f:
        kernels = {line.split('"kernel": ')[1].split('"')[1] for line in f}
    assert kernels == {"_split_kernel", "_merge_kernel"}
    env.pop("TRITON_INTERPRET", None)
    compiled = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "kernels", "hopper_compile.py"), launches],
                              env=env, capture_output=True, text=True, timeout=600, check=False)
    assert compiled.returncode == 0 and compiled.stdout.strip().endswith("ok"), compiled.stdout + compiled.stderr


def test_spans_between_flushes():
    sys.path.insert(0, PATHS[1])
    from triton_decode_attention import spans_between_flushes

    fill = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>"
    events = [{"name": fill, "ts": 0, "dur": 5}, {"name": "_split_kernel", "ts": 6, "dur": 4},
              {"name": "_merge_kernel", "ts": 11, "dur": 2}, {"name": fill, "ts": 14, "dur": 5},
              {"name": "BatchPrefillWithPagedKVCacheKernel", "ts": 20, "dur": 9}]
    assert spans_between_flushes(events) == [7, 9]
