"""Making a tiny model directory, and the cached built-in demo model."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Any

from tpserve.tiny.spec import generation_config, legacy_layout, model_config, resolve_spec
from tpserve.tiny.tokenizer import (
    CHAT_TEMPLATE,
    CORPUS,
    ENDOFTEXT,
    IM_END,
    build_tokenizer,
    tokenizer_config,
)
from tpserve.tiny.weights import random_weights, write_weights

# Bump whenever the files written for the same parameters change (corpus, init, config keys):
# it is part of the cache key of ``default_tiny_model_dir``.
FORMAT_VERSION = 2


def make_tiny_model(out_dir: str, arch: str = "qwen3", **shape: Any) -> str:
    """Write a random Hugging Face-format model with a tokenizer to ``out_dir``; return it.
    ``shape``: ``resolve_spec``'s keyword arguments. config.json is written by transformers' own
    config class, as users' checkpoints are saved."""
    tok = build_tokenizer()
    spec = resolve_spec(arch, tokenizer_size=tok.get_vocab_size(with_added_tokens=True), **shape)
    weights = random_weights(spec)
    if spec.num_shards > len(weights):
        raise ValueError(f"num_shards ({spec.num_shards}) exceeds the number of tensors ({len(weights)})")
    endoftext, im_end = tok.token_to_id(ENDOFTEXT), tok.token_to_id(IM_END)
    os.makedirs(out_dir, exist_ok=True)
    _write_model_config(out_dir, spec, endoftext, im_end)
    _write_json(os.path.join(out_dir, "generation_config.json"), generation_config(endoftext, im_end))
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), tokenizer_config(spec.max_position_embeddings))
    write_weights(weights, out_dir, spec.num_shards)
    return out_dir


DEMO_MODEL_PARAMS: dict = {
    "arch": "qwen3",
    "num_layers": 4,
    "hidden_size": 128,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "seed": 0,
}


def cache_root() -> str:
    return os.environ.get("TPSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tpserve")


def default_tiny_model_dir() -> str:
    """The built-in demo model's directory in the cache, made on first use.

    The directory name hashes the parameters, the format version and the corpus, so any change
    gives a new directory. It is built in a temporary sibling and renamed into place; if another
    process wins the race, its (identical) copy is used.
    """
    key = json.dumps(
        {"params": DEMO_MODEL_PARAMS, "format": FORMAT_VERSION, "corpus": CORPUS, "template": CHAT_TEMPLATE}, sort_keys=True
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    root = cache_root()
    final = os.path.join(root, f"tiny-{DEMO_MODEL_PARAMS['arch']}-{digest}")
    if os.path.isdir(final):
        return final
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-tiny-", dir=root)
    try:
        params = dict(DEMO_MODEL_PARAMS)
        make_tiny_model(tmp, params.pop("arch"), **params)
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isdir(final):  # a real failure, not a lost race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _write_model_config(out_dir: str, spec, bos_id: int, eos_id: int) -> None:
    from transformers import CONFIG_MAPPING

    CONFIG_MAPPING[spec.arch](**model_config(spec, bos_id, eos_id)).save_pretrained(out_dir)
    if spec.legacy_config:
        path = os.path.join(out_dir, "config.json")
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
        _write_json(path, legacy_layout(cfg))


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
