"""Loading a Hugging Face tokenizer from a local model directory."""

from __future__ import annotations

import os


def load_tokenizer(model_dir: str):
    """The model's fast tokenizer (offline: the directory must hold the tokenizer files)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import (
        AutoTokenizer,  # slow import: only in the processes that need it
    )

    return AutoTokenizer.from_pretrained(model_dir)
