"""Tokenizers for the frontend unit tests: the tiny model's and (when shared/ has it) Qwen3's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

QWEN3_TOKENIZER = Path(__file__).resolve().parents[3] / "shared" / "models" / "qwen3-tokenizer"


@pytest.fixture(scope="session")
def tiny_tokenizer(qwen3_dir):
    from tpserve.tokenizer.loader import load_tokenizer

    return load_tokenizer(qwen3_dir)


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    path = Path(os.environ.get("TPSERVE_QWEN3_TOKENIZER", QWEN3_TOKENIZER))
    if not (path / "vocab.json").exists():
        pytest.skip(f"no Qwen3 tokenizer files at {path}")
    from tpserve.tokenizer.loader import load_tokenizer

    return load_tokenizer(str(path))
