"""A tiny model's config: its shape checked and completed, as its architecture's transformers
config class (which writes config.json as users' checkpoints are saved)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "granite": "GraniteForCausalLM",
    "phi3": "Phi3ForCausalLM",  # q/k/v and gate/up fused in the checkpoint
    "gemma2": "Gemma2ForCausalLM",  # Gemma 3's layer without q/k norms or a local rotary; logit soft-caps
    "gemma3_text": "Gemma3ForCausalLM",  # sandwich norms, (1 + weight) norms, GELU, local and global layers
}
# Gemma 3's tiny model: its layers alternate sliding_attention (local rotary, theta 10,000) and full_attention (global
# rotary, theta 1,000,000 and the rope_type asked: linear by default, as the 4B+'s); the window shorter than the
# tests' longer sequences, so their local layers attend within it; the softmax scale query_pre_attn_scalar ** -0.5
# other than head_dim ** -0.5 (as Gemma 3 27B's)
GEMMA3_WINDOW = 16
# Gemma 2's tiny model: its layers alternate sliding_attention and full_attention (one rotary, theta 10,000), the
# window shorter than the tests' longer sequences, the softmax scale query_pre_attn_scalar ** -0.5 other than
# head_dim ** -0.5. Its soft-caps are about the spread of what they cap (its scaled attention scores: std ~10, at most
# ~40; its logits within +-9), so that tanh bends most values without flattening them: the published 50 and 30 would
# barely touch them, caps of a few units would saturate most
GEMMA2_WINDOW = 8
GEMMA2_SOFTCAPS = {"attn_logit_softcapping": 10.0, "final_logit_softcapping": 5.0}
# The architectures whose transformers config takes a sliding window (model_config's sliding_window): Mistral, Mixtral,
# Phi-3 and Qwen3-MoE window every layer, Qwen2 and Qwen3 the layers from max_window_layers (1 here) on
WINDOWED = ("mistral", "mixtral", "phi3", "qwen3_moe", "qwen2", "qwen3", "gemma2", "gemma3_text")
GEMMA_QUERY_PRE_ATTN_SCALAR = 24
GEMMA_KINDS = ("gemma2", "gemma3_text")
# Granite 3's scalars (granite-3.3-8b-instruct's config.json), which each change the tokens
GRANITE_SCALARS = {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.0078125,
                   "logits_scaling": 16.0}
MOE_ARCHITECTURES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
ALL_SPARSE = ("mixtral", "olmoe")  # every layer sparse, the experts intermediate_size wide

VOCAB_MULTIPLE = 64
ROPE_TYPES = ("default", "llama3", "yarn", "linear")


def model_config(
    arch: str,
    *,
    tokenizer_size: int,
    bos_token_id: int,
    eos_token_id: int,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    vocab_size: int | None = None,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 4096,
    rope_type: str | None = None,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int | None = None,
    mlp_only_layers: tuple[int, ...] | list[int] | None = None,
    norm_topk_prob: bool | None = None,
    shared_expert_intermediate_size: int | None = None,
    sliding_window: int | None = None,
) -> PreTrainedConfig:
    """The architecture's transformers config, with defaults filled in; shapes it cannot express
    are rejected. The MoE settings apply to the MoE architectures: qwen3_moe and qwen2_moe, whose sparse layers are
    all but ``mlp_only_layers`` (default: layer 0), and mixtral and olmoe, whose layers are all sparse (their experts'
    size is ``moe_intermediate_size`` or else ``intermediate_size``; mixtral's top k always renormalised). qwen2_moe's
    shared expert is ``shared_expert_intermediate_size`` wide (default: hidden). ``norm_topk_prob`` defaults to the
    published models' (olmoe: False, the others: True). ``sliding_window``: the attention window of the WINDOWED
    architectures (gemma3_text's and gemma2's local layers: GEMMA3_WINDOW, GEMMA2_WINDOW by default; the others:
    none)."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    if rope_type is None:
        rope_type = {"llama": "llama3", "gemma3_text": "linear"}.get(arch, "default")
    if norm_topk_prob is None:
        norm_topk_prob = arch != "olmoe"
    if sliding_window is not None and (arch not in WINDOWED or sliding_window < 1):
        raise ValueError(f"sliding_window must be >= 1 and the architecture one of {', '.join(WINDOWED)}, got "
                         f"{sliding_window} for {arch}")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unknown rope_type {rope_type!r}; choose one of {', '.join(ROPE_TYPES)}")
    positive = {"num_layers": num_layers, "hidden_size": hidden_size, "num_heads": num_heads,
                "num_kv_heads": num_kv_heads, "max_position_embeddings": max_position_embeddings}
    for name, value in positive.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    divisible = hidden_size % num_heads == 0
    if head_dim is None:
        if not divisible:
            raise ValueError(
                f"hidden_size ({hidden_size}) is not divisible by num_heads ({num_heads}); pass head_dim explicitly"
            )
        head_dim = hidden_size // num_heads
    elif arch in ("qwen2", "olmoe") and (not divisible or head_dim != hidden_size // num_heads):
        # (OLMoE's q/k norms are hidden_size wide in transformers: its heads must fill the hidden size)
        raise ValueError(
            f"{arch} has no head_dim setting: head_dim ({head_dim}) must equal "
            f"hidden_size ({hidden_size}) / num_heads ({num_heads})"
        )
    elif arch == "llama" and not divisible:
        # transformers' LlamaConfig rejects this even when head_dim is given.
        raise ValueError(f"llama requires hidden_size ({hidden_size}) divisible by num_heads ({num_heads})")
    if head_dim < 2 or head_dim % 2 != 0:
        raise ValueError(f"head_dim must be even and >= 2 (rotary embedding), got {head_dim}")
    if arch in ALL_SPARSE and moe_intermediate_size is None:  # their experts are intermediate_size wide
        moe_intermediate_size = intermediate_size
    if intermediate_size is None:
        intermediate_size = 2 * hidden_size
    if intermediate_size < 1:
        raise ValueError(f"intermediate_size must be >= 1, got {intermediate_size}")
    if vocab_size is None:
        vocab_size = -(-tokenizer_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    if vocab_size < tokenizer_size:
        raise ValueError(f"vocab_size ({vocab_size}) must be >= the tokenizer's size ({tokenizer_size})")
    cfg: dict = {
        "architectures": [ARCHITECTURES[arch]],
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": max_position_embeddings,
        "rope_parameters": rope_parameters(arch, rope_type, max_position_embeddings),
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "dtype": "float32",
    }
    if arch != "qwen2":
        cfg["head_dim"] = head_dim
    if arch == "granite":
        cfg.update(GRANITE_SCALARS)
    if arch == "phi3":  # (its config's defaults are Phi-3-mini's: a pretraining length and a padding id past the vocab)
        cfg.update(original_max_position_embeddings=max_position_embeddings, pad_token_id=eos_token_id)
    if arch in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe"):
        cfg["max_window_layers"] = num_layers if sliding_window is None else 1
    if sliding_window is not None and arch not in GEMMA_KINDS:
        cfg.update(sliding_window=sliding_window, use_sliding_window=True)
    if arch in GEMMA_KINDS:  # local layers first, as the published models' (gemma-2-2b-it: 26 layers, 13 of each)
        cfg.update(layer_types=["full_attention" if i % 2 else "sliding_attention" for i in range(num_layers)],
                   query_pre_attn_scalar=GEMMA_QUERY_PRE_ATTN_SCALAR, pad_token_id=eos_token_id)
    if arch == "gemma2":
        cfg.update(sliding_window=sliding_window or GEMMA2_WINDOW, **GEMMA2_SOFTCAPS)
    if arch == "gemma3_text":
        cfg.update(
            sliding_window=sliding_window or GEMMA3_WINDOW,
            rope_parameters={"full_attention": rope_parameters(arch, rope_type, max_position_embeddings),
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        )
    if arch in MOE_ARCHITECTURES:
        if moe_intermediate_size is None:
            moe_intermediate_size = hidden_size // 2
        if not 1 <= num_experts_per_tok <= num_experts:
            raise ValueError(f"num_experts_per_tok ({num_experts_per_tok}) must be in [1, num_experts ({num_experts})]")
        if moe_intermediate_size < 1:
            raise ValueError(f"moe_intermediate_size must be >= 1, got {moe_intermediate_size}")
        if arch in ALL_SPARSE:
            if mlp_only_layers:
                raise ValueError(f"{arch} has no dense layers: mlp_only_layers must be empty")
            experts_key = "num_local_experts" if arch == "mixtral" else "num_experts"
            cfg.update({experts_key: num_experts, "num_experts_per_tok": num_experts_per_tok,
                        "intermediate_size": moe_intermediate_size})
            if arch == "olmoe":
                cfg["norm_topk_prob"] = norm_topk_prob
        else:
            dense = (0,) if mlp_only_layers is None else mlp_only_layers
            bad = [i for i in dense if not 0 <= i < num_layers]
            if bad:
                raise ValueError(f"mlp_only_layers {bad} are not layers of a {num_layers}-layer model")
            cfg.update(
                num_experts=num_experts, num_experts_per_tok=num_experts_per_tok, norm_topk_prob=norm_topk_prob,
                moe_intermediate_size=moe_intermediate_size, mlp_only_layers=sorted(set(dense)),
            )
        if arch == "qwen2_moe":
            shared = hidden_size if shared_expert_intermediate_size is None else shared_expert_intermediate_size
            if shared < 0:
                raise ValueError(f"shared_expert_intermediate_size must be >= 0, got {shared}")
            cfg["shared_expert_intermediate_size"] = shared
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[arch](**cfg)


def rope_parameters(arch: str, rope_type: str, max_position_embeddings: int) -> dict:
    """Rotary settings in transformers' ``rope_parameters`` form. The scaled types use a small
    original context so that, at tiny head dims, they change some frequencies (and YaRN scales
    attention): a model that ignored them would give other tokens."""
    theta = {"llama": 500000.0, "gemma3_text": 1000000.0}.get(arch, 10000.0)
    original = max(16, max_position_embeddings // 8)
    if rope_type == "llama3":
        return {
            "rope_type": "llama3", "rope_theta": theta, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": original,
        }
    if rope_type == "yarn":
        return {"rope_type": "yarn", "rope_theta": theta, "factor": 8.0, "original_max_position_embeddings": original}
    if rope_type == "linear":
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
