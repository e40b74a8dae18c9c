"""The Triton kernels' logic on the CPU (Triton's interpreter); skipped where triton is missing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_triton_kernels_in_interpreter():
    script = os.path.join(os.path.dirname(__file__), "interpreter_checks.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, script], check=False, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("ok")
