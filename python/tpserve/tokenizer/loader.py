"""Loading a Hugging Face tokenizer from a local model directory."""

from __future__ import annotations

import os

# The files a tokenizer is made from (fast, sentencepiece, BPE, WordPiece). Without any of them
# transformers 5 builds an empty tokenizer from config.json's model type (every text encodes to
# no tokens), so their absence is checked here.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def has_tokenizer_files(model_dir: str) -> bool:
    return any(os.path.isfile(os.path.join(model_dir, name)) for name in TOKENIZER_FILES)


def missing_tokenizer_message(model_dir: str) -> str:
    return f"no tokenizer in {model_dir} (none of {', '.join(TOKENIZER_FILES)})"


def load_tokenizer(model_dir: str, chat_template: str | None = None):
    """The model's fast tokenizer (offline: the directory must hold the tokenizer files);
    ``chat_template`` replaces the model's (--chat-template)."""
    if not has_tokenizer_files(model_dir):
        raise FileNotFoundError(missing_tokenizer_message(model_dir))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoTokenizer  # slow import: only in the processes that need it

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer
