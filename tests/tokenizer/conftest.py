"""Tokenizers for the frontend unit tests: the tiny model's and the real Qwen3 one.

tests/data/qwen3-tokenizer.tar.xz holds the official Qwen3 vocab.json, merges.txt and
tokenizer_config.json (byte-identical to ../shared/models/qwen3-tokenizer, 1.3 MB compressed),
so CI tests real multi-byte merges without a download.
"""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

QWEN3_TOKENIZER_ARCHIVE = Path(__file__).resolve().parents[1] / "data" / "qwen3-tokenizer.tar.xz"


@pytest.fixture(scope="session")
def tiny_tokenizer(qwen3_dir):
    from tpserve.tokenizer.loader import load_tokenizer

    return load_tokenizer(qwen3_dir)


@pytest.fixture(scope="session")
def qwen3_tokenizer(tmp_path_factory):
    from tpserve.tokenizer.loader import load_tokenizer

    path = tmp_path_factory.mktemp("qwen3-tokenizer")
    with tarfile.open(QWEN3_TOKENIZER_ARCHIVE) as archive:
        archive.extractall(path, filter="data")
    return load_tokenizer(str(path))
