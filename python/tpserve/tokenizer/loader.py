"""Loading a Hugging Face tokenizer from a local model directory."""

from __future__ import annotations

import os

from tpserve.models.checkpoint import read_json_object

# The files a tokenizer is made from (fast, sentencepiece, BPE, WordPiece). Without any of them
# transformers 5 builds an empty tokenizer from config.json's model type (every text encodes to
# no tokens), so their absence is checked here.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json")


def has_tokenizer_files(model_dir: str) -> bool:
    return any(os.path.isfile(os.path.join(model_dir, name)) for name in TOKENIZER_FILES)


def missing_tokenizer_message(model_dir: str) -> str:
    return f"no tokenizer in {model_dir} (none of {', '.join(TOKENIZER_FILES)})"


def load_tokenizer(model_dir: str, chat_template: str | None = None):
    """The model's fast tokenizer (offline: the directory must hold the tokenizer files);
    ``chat_template`` replaces the model's (--chat-template). Damaged files are a ValueError naming them."""
    if not has_tokenizer_files(model_dir):
        raise FileNotFoundError(missing_tokenizer_message(model_dir))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoTokenizer  # slow import: only in the processes that need it

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:  # transformers and tokenizers raise anything on a damaged file
        raise ValueError(f"cannot load the tokenizer in {model_dir}: {_damage(model_dir, e)}") from e
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def check_chat_template(text: str, where: str) -> None:
    """A ValueError, starting with ``where`` (the flag or argument that gave it), if ``text`` does not
    compile as transformers compiles a chat template for each chat request."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # pragma: no cover - another transformers layout: checked at the first request
        return
    from jinja2 import TemplateError

    try:
        _compile_jinja_template(text)
    except TemplateError as e:
        line = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        raise ValueError(f"{where} is not a valid chat template: {e.message}{line}") from None


def _damage(model_dir: str, error: Exception) -> str:
    """The first tokenizer file that is not a JSON object, else the loader's own error."""
    for name in TOKENIZER_JSON_FILES:
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            try:
                read_json_object(path)
            except (OSError, ValueError) as e:
                return str(e)
    return f"{type(error).__name__}: {' '.join(str(error).split())}"  # one line
