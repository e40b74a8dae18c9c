"""``python -m tpserve.tiny OUT_DIR [...]``."""

from __future__ import annotations

import argparse

from tpserve.launch.argtypes import HelpFormatter
from tpserve.tiny.maker import make_tiny_model
from tpserve.tiny.spec import ARCHITECTURES, ROPE_TYPES, VOCAB_MULTIPLE


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
        "qwen2 (q/k/v bias), llama (llama3 rope scaling), mistral")
    add("--layers", dest="num_layers", metavar="LAYERS", type=int, default=2, help="number of decoder layers")
    add("--hidden", dest="hidden_size", metavar="HIDDEN", type=int, default=64, help="hidden size")
    add("--heads", dest="num_heads", metavar="HEADS", type=int, default=4,
        help="number of attention (query) heads")
    add("--kv-heads", dest="num_kv_heads", metavar="KV_HEADS", type=int, default=2,
        help="number of key/value heads; must divide --heads")
    add("--head-dim", type=int, default=None,
        help="per-head dimension, even (default: hidden / heads, the only value qwen2 allows)")
    add("--intermediate", dest="intermediate_size", metavar="INTERMEDIATE", type=int, default=None,
        help="MLP intermediate size (default: 2 * hidden)")
    add("--vocab", dest="vocab_size", metavar="VOCAB", type=int, default=None,
        help="model vocab size, >= the tokenizer's size (default: the tokenizer's size rounded "
        f"up to a multiple of {VOCAB_MULTIPLE})")
    add("--experts", dest="num_experts", metavar="EXPERTS", type=int, default=8,
        help="qwen3_moe: experts per sparse layer")
    add("--top-k", dest="num_experts_per_tok", metavar="TOP_K", type=int, default=2,
        help="qwen3_moe: experts per token")
    add("--moe-intermediate", dest="moe_intermediate_size", metavar="MOE_INTERMEDIATE", type=int, default=None,
        help="qwen3_moe: each expert's intermediate size (default: hidden / 2)")
    add("--mlp-only-layers", type=int, nargs="*", default=[0],
        help="qwen3_moe: layers with a dense MLP instead of experts")
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
