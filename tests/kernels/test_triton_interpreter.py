"""The Triton kernels' logic on the CPU (Triton's interpreter), then every launch it made compiled
for Hopper (the compiler's rules, which the interpreter does not apply); skipped where triton is
missing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

HERE = os.path.dirname(__file__)


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> str:
    """Runs the interpreter checks once; the file of the kernel launches they made."""
    path = str(tmp_path_factory.mktemp("triton") / "launches.jsonl")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    script = os.path.join(HERE, "interpreter_checks.py")
    result = subprocess.run([sys.executable, script, path], check=False, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("ok")
    return path


def test_triton_kernels_in_interpreter(launches):
    with open(launches) as f:
        kernels = {line.split('"kernel": ')[1].split('"')[1] for line in f}
    assert {"_norm_rope_store_kernel", "_grouped_gemm_kernel", "_store_kv_kernel", "_add_rmsnorm_kernel",
            "_install_kernel", "_greedy_kernel"} <= kernels


def test_triton_kernels_compile_for_hopper(launches):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, os.path.join(HERE, "hopper_compile.py"), launches], check=False,
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("ok"), result.stdout
