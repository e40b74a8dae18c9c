"""The README's examples run as users would paste them: the offline one as a script, at TP 2."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def python_block_after(heading: str) -> str:
    text = README.read_text()
    section = text[text.index(heading):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_offline_example_runs_as_a_script_at_tp2(qwen3_dir, tmp_path):
    code = python_block_after("## Offline generation")
    assert "tp_size=2" in code and '__name__ == "__main__"' in code
    script = tmp_path / "example.py"
    script.write_text(code.replace('"Qwen/Qwen3-0.6B"', repr(qwen3_dir)))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # the CPU path, as in CI
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith("length")  # 32 greedy tokens of a random model, cut at max_tokens
