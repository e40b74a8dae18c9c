"""A saved model directory's config.json, read or changed in a copy (the tests of each model's settings)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path


def config_of(model_dir: str) -> dict:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def with_config(model_dir: str, out: Path, **changes) -> str:
    """A copy of ``model_dir`` at ``out`` whose config.json has ``changes``."""
    shutil.copytree(model_dir, out, dirs_exist_ok=True)
    (out / "config.json").write_text(json.dumps({**config_of(model_dir), **changes}))
    return str(out)
