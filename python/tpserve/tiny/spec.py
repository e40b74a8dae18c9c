"""A tiny model's shape: its parameters checked and completed, and its config files."""

from __future__ import annotations

from dataclasses import dataclass

ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
}

# Bump whenever the files written for the same parameters change (corpus, init, config keys):
# it is part of the cache key of ``default_tiny_model_dir``.

VOCAB_MULTIPLE = 64


@dataclass(frozen=True)
class TinySpec:
    """The maker's parameters, resolved (no None left)."""

    arch: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    num_shards: int
    seed: int
    max_position_embeddings: int


def resolve_spec(
    arch: str,
    *,
    tokenizer_size: int,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    vocab_size: int | None = None,
    tie_word_embeddings: bool = False,
    num_shards: int = 1,
    seed: int = 0,
    max_position_embeddings: int = 4096,
) -> TinySpec:
    """Fill in defaults and reject shapes the target architecture cannot express."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    positive = {
        "num_layers": num_layers,
        "hidden_size": hidden_size,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "num_shards": num_shards,
        "max_position_embeddings": max_position_embeddings,
    }
    for name, value in positive.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    divisible = hidden_size % num_heads == 0
    if head_dim is None:
        if not divisible:
            raise ValueError(
                f"hidden_size ({hidden_size}) is not divisible by num_heads ({num_heads}); "
                "pass head_dim explicitly"
            )
        head_dim = hidden_size // num_heads
    elif arch == "qwen2" and (not divisible or head_dim != hidden_size // num_heads):
        raise ValueError(
            f"qwen2 has no head_dim setting: head_dim ({head_dim}) must equal "
            f"hidden_size ({hidden_size}) / num_heads ({num_heads})"
        )
    elif arch == "llama" and not divisible:
        # transformers' LlamaConfig rejects this even when head_dim is given.
        raise ValueError(
            f"llama requires hidden_size ({hidden_size}) divisible by num_heads ({num_heads})"
        )
    if head_dim < 2 or head_dim % 2 != 0:
        raise ValueError(f"head_dim must be even and >= 2 (rotary embedding), got {head_dim}")
    if intermediate_size is None:
        intermediate_size = 2 * hidden_size
    if intermediate_size < 1:
        raise ValueError(f"intermediate_size must be >= 1, got {intermediate_size}")
    if vocab_size is None:
        vocab_size = -(-tokenizer_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    if vocab_size < tokenizer_size:
        raise ValueError(
            f"vocab_size ({vocab_size}) must be >= the tokenizer's size ({tokenizer_size})"
        )
    return TinySpec(
        arch=arch,
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        tie_word_embeddings=tie_word_embeddings,
        num_shards=num_shards,
        seed=seed,
        max_position_embeddings=max_position_embeddings,
    )


def model_config(spec: TinySpec, bos_id: int, eos_id: int) -> dict:
    """config.json in the (pre-v5) layout that both old and new transformers read."""
    cfg: dict = {
        "architectures": [ARCHITECTURES[spec.arch]],
        "model_type": spec.arch,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    if spec.arch != "qwen2":
        cfg["head_dim"] = spec.head_dim
    if spec.arch in ("qwen3", "llama"):
        cfg["attention_bias"] = False
    if spec.arch in ("qwen2", "qwen3"):
        cfg["use_sliding_window"] = False
        cfg["sliding_window"] = None
        cfg["max_window_layers"] = spec.num_layers
    if spec.arch == "mistral":
        cfg["sliding_window"] = None
    if spec.arch == "llama":
        cfg["mlp_bias"] = False
        cfg["rope_theta"] = 500000.0
        # Small enough original context that, at tiny head dims, some rotary frequencies fall in
        # each llama3 band (kept, smoothed, divided by factor).
        cfg["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": max(16, spec.max_position_embeddings // 8),
        }
    return cfg


def generation_config(endoftext_id: int, im_end_id: int) -> dict:
    return {
        "bos_token_id": endoftext_id,
        "eos_token_id": [im_end_id, endoftext_id],
        "pad_token_id": endoftext_id,
    }
