"""Tiny random models in Hugging Face format, made offline, for tests and demos.

``python -m tpserve.tiny OUT_DIR --arch qwen3`` writes config.json, generation_config.json,
safetensors weights (optionally sharded, with an index) and a byte-level BPE tokenizer trained
on a small built-in corpus, with a Qwen-style ChatML chat template.

The weights are random but deliberately large (see ``weights._init_tensor``): Hugging Face's default
init (std 0.02) gives nearly flat logits, so greedy decoding would repeat one token and a test
comparing against transformers could not tell a broken engine from a working one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from typing import Any

from tpserve.launch.argtypes import HelpFormatter
from tpserve.tiny.config import ARCHITECTURES, ROPE_TYPES, VOCAB_MULTIPLE, legacy_layout, model_config
from tpserve.tiny.tokenizer import CHAT_TEMPLATE, CORPUS, ENDOFTEXT, IM_END, build_tokenizer, tokenizer_config
from tpserve.tiny.weights import random_weights, write_weights

# Bump whenever the files written for the same parameters change (corpus, init, config keys):
# it is part of the cache key of ``default_tiny_model_dir``.
FORMAT_VERSION = 2

DEMO_MODEL_PARAMS: dict = {
    "arch": "qwen3", "num_layers": 4, "hidden_size": 128, "num_heads": 4, "num_kv_heads": 2, "head_dim": 32,
    "intermediate_size": 256, "seed": 0,
}


def make_tiny_model(
    out_dir: str, arch: str = "qwen3", *, num_shards: int = 1, seed: int = 0, legacy_config: bool = False, **shape: Any
) -> str:
    """Write a random Hugging Face-format model with a tokenizer to ``out_dir``; return it.
    ``shape``: ``model_config``'s keyword arguments. ``legacy_config`` writes rope_theta and
    rope_scaling at the top of config.json, as transformers 4 saved them."""
    tok = build_tokenizer()
    endoftext, im_end = tok.token_to_id(ENDOFTEXT), tok.token_to_id(IM_END)
    tokenizer_size = tok.get_vocab_size(with_added_tokens=True)
    config = model_config(arch, tokenizer_size=tokenizer_size, bos_token_id=endoftext, eos_token_id=im_end, **shape)
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    weights = random_weights(config, seed)
    if num_shards > len(weights):
        raise ValueError(f"num_shards ({num_shards}) exceeds the number of tensors ({len(weights)})")
    os.makedirs(out_dir, exist_ok=True)
    config.save_pretrained(out_dir)
    if legacy_config:
        config_path = os.path.join(out_dir, "config.json")
        with open(config_path, encoding="utf-8") as f:
            legacy = legacy_layout(json.load(f))
        _write_json(config_path, legacy)
    generation = {"bos_token_id": endoftext, "eos_token_id": [im_end, endoftext], "pad_token_id": endoftext}
    _write_json(os.path.join(out_dir, "generation_config.json"), generation)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), tokenizer_config(config.max_position_embeddings))
    write_weights(weights, out_dir, num_shards)
    return out_dir


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def cache_root() -> str:
    return os.environ.get("TPSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tpserve")


def default_tiny_model_dir() -> str:
    """The built-in demo model's directory in the cache, made on first use.

    The directory name hashes the parameters, the format version and the corpus, so any change
    gives a new directory. It is built in a temporary sibling and renamed into place; if another
    process wins the race, its (identical) copy is used.
    """
    key = {"params": DEMO_MODEL_PARAMS, "format": FORMAT_VERSION, "corpus": CORPUS, "template": CHAT_TEMPLATE}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
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


def build_parser() -> argparse.ArgumentParser:
    """Every option's dest is the ``make_tiny_model`` keyword it sets."""
    parser = argparse.ArgumentParser(
        prog="python -m tpserve.tiny",
        description="Write a tiny random Hugging Face-format model (config, safetensors weights, "
        "byte-level BPE tokenizer with a ChatML chat template) to OUT_DIR, offline.",
        formatter_class=HelpFormatter,
    )
    add = parser.add_argument
    add("out_dir", metavar="OUT_DIR", help="directory to write (created if missing)")
    add("--arch", choices=list(ARCHITECTURES), default="qwen3",
        help="architecture: qwen3 (q/k RMSNorm), qwen3_moe (Qwen3 with mixture-of-experts MLPs), "
        "qwen2 (q/k/v bias), qwen2_moe (Qwen2 with experts and a gated shared expert), llama (llama3 rope "
        "scaling), mistral, mixtral (Mistral with experts in every layer), olmoe (experts in every layer, q/k "
        "RMSNorms over the whole projections), granite (Granite's scalars), phi3 (fused q/k/v and gate/up), "
        "gemma2 (Gemma 2: sandwich norms, GELU, local and global layers, logit soft-caps), gemma3_text (Gemma 3: "
        "Gemma 2's layer with q/k norms and the local layers' own rotary)")
    add("--layers", dest="num_layers", metavar="LAYERS", type=int, default=2, help="number of decoder layers")
    add("--hidden", dest="hidden_size", metavar="HIDDEN", type=int, default=64, help="hidden size")
    add("--heads", dest="num_heads", metavar="HEADS", type=int, default=4, help="number of attention (query) heads")
    add("--kv-heads", dest="num_kv_heads", metavar="KV_HEADS", type=int, default=2,
        help="number of key/value heads; must divide --heads")
    add("--head-dim", type=int, default=None,
        help="per-head dimension, even (default: hidden / heads, the only value qwen2 and olmoe allow)")
    add("--intermediate", dest="intermediate_size", metavar="INTERMEDIATE", type=int, default=None,
        help="MLP intermediate size (default: 2 * hidden)")
    add("--vocab", dest="vocab_size", metavar="VOCAB", type=int, default=None,
        help=f"model vocab size, >= the tokenizer's size (default: the tokenizer's size rounded up to a multiple "
        f"of {VOCAB_MULTIPLE})")
    add("--experts", dest="num_experts", metavar="EXPERTS", type=int, default=8,
        help="MoE architectures: experts per sparse layer")
    add("--top-k", dest="num_experts_per_tok", metavar="TOP_K", type=int, default=2,
        help="MoE architectures: experts per token")
    add("--moe-intermediate", dest="moe_intermediate_size", metavar="MOE_INTERMEDIATE", type=int, default=None,
        help="MoE architectures: each expert's intermediate size (default: hidden / 2)")
    add("--mlp-only-layers", type=int, nargs="*", default=None,
        help="qwen3_moe, qwen2_moe: layers with a dense MLP instead of experts (default: 0; mixtral and olmoe have "
        "none)")
    add("--shared-expert-intermediate", dest="shared_expert_intermediate_size", metavar="SHARED", type=int,
        default=None, help="qwen2_moe: the shared expert's intermediate size, 0 for none (default: hidden)")
    add("--tie", dest="tie_word_embeddings", action="store_true",
        help="tie the LM head to the token embedding (then no lm_head.weight is saved)")
    add("--shards", dest="num_shards", metavar="SHARDS", type=int, default=1,
        help="number of safetensors files; more than 1 also writes model.safetensors.index.json")
    add("--seed", type=int, default=0, help="random seed for the weights")
    add("--max-position-embeddings", type=int, default=4096, help="context length written to config.json")
    add("--rope-type", choices=ROPE_TYPES, default=None,
        help="rotary scaling: default, llama3, yarn or linear (default: llama3 for llama, else default)")
    add("--legacy-config", action="store_true",
        help="write rope_theta + rope_scaling at the top of config.json as transformers 4 did, "
        "instead of transformers 5's rope_parameters")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    shape = vars(parser.parse_args(argv))
    try:
        out = make_tiny_model(shape.pop("out_dir"), **shape)
    except ValueError as e:
        parser.error(str(e))
    print(out)
    return 0
