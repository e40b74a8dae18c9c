"""Tiny random models in Hugging Face format, made offline, for tests and demos.

``python -m tpserve.tiny OUT_DIR --arch qwen3`` writes config.json, generation_config.json,
safetensors weights (optionally sharded, with an index) and a byte-level BPE tokenizer trained
on a small built-in corpus, with a Qwen-style ChatML chat template.

The weights are random but deliberately large (see ``_init_tensor``): Hugging Face's default
init (std 0.02) gives nearly flat logits, so greedy decoding would repeat one token and a test
comparing against transformers could not tell a broken engine from a working one.
"""

from tpserve.tiny.cli import build_parser, main
from tpserve.tiny.maker import (
    DEMO_MODEL_PARAMS,
    FORMAT_VERSION,
    cache_root,
    default_tiny_model_dir,
    make_tiny_model,
)
from tpserve.tiny.spec import ARCHITECTURES, TinySpec, resolve_spec
from tpserve.tiny.tokenizer import build_tokenizer

__all__ = [
    "ARCHITECTURES", "DEMO_MODEL_PARAMS", "FORMAT_VERSION", "TinySpec", "build_parser", "build_tokenizer",
    "cache_root", "default_tiny_model_dir", "main", "make_tiny_model", "resolve_spec",
]
