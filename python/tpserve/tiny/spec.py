"""A tiny model's shape: its parameters checked and completed, and its config files."""

from __future__ import annotations

from dataclasses import dataclass

ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
}

VOCAB_MULTIPLE = 64
ROPE_TYPES = ("default", "llama3", "yarn", "linear")


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
    rope_type: str  # default | llama3 | yarn | linear
    legacy_config: bool  # rope_theta + rope_scaling at the top level, as transformers 4 saved them
    # qwen3_moe only (0 experts elsewhere): the sparse layers are all but mlp_only_layers
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    mlp_only_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = True


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
    rope_type: str | None = None,
    legacy_config: bool = False,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int | None = None,
    mlp_only_layers: tuple[int, ...] | list[int] = (0,),
    norm_topk_prob: bool = True,
) -> TinySpec:
    """Fill in defaults and reject shapes the target architecture cannot express."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    if rope_type is None:
        rope_type = "llama3" if arch == "llama" else "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unknown rope_type {rope_type!r}; choose one of {', '.join(ROPE_TYPES)}")
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
    moe: dict = {}
    if arch == "qwen3_moe":
        if moe_intermediate_size is None:
            moe_intermediate_size = hidden_size // 2
        if not 1 <= num_experts_per_tok <= num_experts:
            raise ValueError(f"num_experts_per_tok ({num_experts_per_tok}) must be in [1, num_experts ({num_experts})]")
        if moe_intermediate_size < 1:
            raise ValueError(f"moe_intermediate_size must be >= 1, got {moe_intermediate_size}")
        bad = [i for i in mlp_only_layers if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"mlp_only_layers {bad} are not layers of a {num_layers}-layer model")
        moe = {
            "num_experts": num_experts, "num_experts_per_tok": num_experts_per_tok,
            "moe_intermediate_size": moe_intermediate_size, "mlp_only_layers": tuple(sorted(set(mlp_only_layers))),
            "norm_topk_prob": norm_topk_prob,
        }
    return TinySpec(
        **moe,
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
        rope_type=rope_type,
        legacy_config=legacy_config,
    )


def rope_parameters(spec: TinySpec) -> dict:
    """Rotary settings in transformers' ``rope_parameters`` form. The scaled types use a small
    original context so that, at tiny head dims, they change some frequencies (and YaRN scales
    attention): a model that ignored them would give other tokens."""
    theta = 500000.0 if spec.arch == "llama" else 10000.0
    original = max(16, spec.max_position_embeddings // 8)
    if spec.rope_type == "llama3":
        return {
            "rope_type": "llama3", "rope_theta": theta, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": original,
        }
    if spec.rope_type == "yarn":
        return {"rope_type": "yarn", "rope_theta": theta, "factor": 8.0, "original_max_position_embeddings": original}
    if spec.rope_type == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": 2.0}
    return {"rope_type": "default", "rope_theta": theta}


def legacy_layout(cfg: dict) -> dict:
    """The same config as transformers 4 wrote it: ``rope_theta`` and ``rope_scaling`` (with the
    older ``type`` key for YaRN and linear, as Qwen's model cards show) instead of ``rope_parameters``."""
    cfg = dict(cfg)
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    cfg["rope_scaling"] = None if kind == "default" else {("rope_type" if kind == "llama3" else "type"): kind, **rope}
    return cfg


def model_config(spec: TinySpec, bos_id: int, eos_id: int) -> dict:
    """The keyword arguments of the architecture's transformers config class."""
    cfg: dict = {
        "architectures": [ARCHITECTURES[spec.arch]],
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_parameters": rope_parameters(spec),
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "initializer_range": 0.02,
        "dtype": "float32",
    }
    if spec.arch != "qwen2":
        cfg["head_dim"] = spec.head_dim
    if spec.arch in ("qwen2", "qwen3", "qwen3_moe"):
        cfg["max_window_layers"] = spec.num_layers
    if spec.arch == "qwen3_moe":
        cfg.update(
            num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
            moe_intermediate_size=spec.moe_intermediate_size, mlp_only_layers=list(spec.mlp_only_layers),
            norm_topk_prob=spec.norm_topk_prob, decoder_sparse_step=1,
        )
    return cfg


def generation_config(endoftext_id: int, im_end_id: int) -> dict:
    return {
        "bos_token_id": endoftext_id,
        "eos_token_id": [im_end_id, endoftext_id],
        "pad_token_id": endoftext_id,
    }
