"""``python -m tpserve.tiny OUT_DIR [...]``."""

from __future__ import annotations

import argparse

from tpserve.tiny.maker import make_tiny_model
from tpserve.tiny.spec import ARCHITECTURES, ROPE_TYPES, VOCAB_MULTIPLE


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tpserve.tiny",
        description="Write a tiny random Hugging Face-format model (config, safetensors weights, "
        "byte-level BPE tokenizer with a ChatML chat template) to OUT_DIR, offline.",
    )
    add = parser.add_argument
    add("out_dir", metavar="OUT_DIR", help="directory to write (created if missing)")
    add("--arch", choices=list(ARCHITECTURES), default="qwen3",
        help="architecture: qwen3 (q/k RMSNorm), qwen3_moe (Qwen3 with mixture-of-experts MLPs), "
        "qwen2 (q/k/v bias), llama (llama3 rope scaling), mistral (default: %(default)s)")
    add("--layers", type=int, default=2, help="number of decoder layers (default: %(default)s)")
    add("--hidden", type=int, default=64, help="hidden size (default: %(default)s)")
    add("--heads", type=int, default=4,
        help="number of attention (query) heads (default: %(default)s)")
    add("--kv-heads", type=int, default=2,
        help="number of key/value heads; must divide --heads (default: %(default)s)")
    add("--head-dim", type=int, default=None,
        help="per-head dimension, even (default: hidden / heads, the only value qwen2 allows)")
    add("--intermediate", type=int, default=None,
        help="MLP intermediate size (default: 2 * hidden)")
    add("--vocab", type=int, default=None,
        help="model vocab size, >= the tokenizer's size (default: the tokenizer's size rounded "
        f"up to a multiple of {VOCAB_MULTIPLE})")
    add("--experts", type=int, default=8, help="qwen3_moe: experts per sparse layer (default: %(default)s)")
    add("--top-k", type=int, default=2, help="qwen3_moe: experts per token (default: %(default)s)")
    add("--moe-intermediate", type=int, default=None,
        help="qwen3_moe: each expert's intermediate size (default: hidden / 2)")
    add("--mlp-only-layers", type=int, nargs="*", default=[0],
        help="qwen3_moe: layers with a dense MLP instead of experts (default: %(default)s)")
    add("--tie", action="store_true",
        help="tie the LM head to the token embedding (then no lm_head.weight is saved)")
    add("--shards", type=int, default=1,
        help="number of safetensors files; more than 1 also writes "
        "model.safetensors.index.json (default: %(default)s)")
    add("--seed", type=int, default=0, help="random seed for the weights (default: %(default)s)")
    add("--max-position-embeddings", type=int, default=4096,
        help="context length written to config.json (default: %(default)s)")
    add("--rope-type", choices=ROPE_TYPES, default=None,
        help="rotary scaling: default, llama3, yarn or linear (default: llama3 for llama, else default)")
    add("--legacy-config", action="store_true",
        help="write rope_theta + rope_scaling at the top of config.json as transformers 4 did, "
        "instead of transformers 5's rope_parameters")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        out = make_tiny_model(
            args.out_dir,
            args.arch,
            num_layers=args.layers,
            hidden_size=args.hidden,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            intermediate_size=args.intermediate,
            vocab_size=args.vocab,
            tie_word_embeddings=args.tie,
            num_shards=args.shards,
            seed=args.seed,
            max_position_embeddings=args.max_position_embeddings,
            rope_type=args.rope_type,
            legacy_config=args.legacy_config,
            num_experts=args.experts,
            num_experts_per_tok=args.top_k,
            moe_intermediate_size=args.moe_intermediate,
            mlp_only_layers=tuple(args.mlp_only_layers),
        )
    except ValueError as e:
        parser.error(str(e))
    print(out)
    return 0
