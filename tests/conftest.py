"""Shared fixtures: tiny random models written once per test session (no downloads)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """make(arch="qwen3", **kwargs) -> model dir, cached by arguments for the whole session."""
    from tpserve.tiny import make_tiny_model

    made: dict[tuple, str] = {}

    def make(arch: str = "qwen3", **kwargs) -> str:
        key = (arch, tuple(sorted(kwargs.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            made[key] = make_tiny_model(str(out), arch, **kwargs)
        return made[key]

    return make


@pytest.fixture(scope="session")
def qwen3_dir(tiny_model_factory) -> str:
    # vocab 250 does not divide by 3 or 4: exercises the padded vocabulary split.
    return tiny_model_factory("qwen3")
