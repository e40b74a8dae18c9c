"""Loading a Hugging Face tokenizer from a local model directory."""

from __future__ import annotations

import os


def load_tokenizer(model_dir: str, chat_template: str | None = None):
    """The model's fast tokenizer (offline: the directory must hold the tokenizer files);
    ``chat_template`` replaces the model's (--chat-template)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoTokenizer  # slow import: only in the processes that need it

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer
