"""The model's config: a Hugging Face ``config.json`` read through transformers, checked for what tpserve
implements, and its split over TP ranks (``check_tp_size``). The serving settings are ``tpserve.engine_config``."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from tpserve.classifier import ClassifierConfig, classifier_config
from tpserve.models.checkpoint import read_json_object, tensor_names
from tpserve.models.names import converted
from tpserve.quant.config import QuantConfig, parse_quantization_config


SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",
    "OlmoeForCausalLM": "olmoe",
    "GraniteForCausalLM": "granite",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",  # Gemma 3's text-only models (1B, 270M); the 4B+ are multimodal
    # the bare decoders (transformers' base models, as sentence-transformers saves embedding models such as
    # Qwen3-Embedding's): no LM head, so they serve embeddings only
    "Qwen3Model": "qwen3",
    "Qwen3MoeModel": "qwen3_moe",
    "Qwen2Model": "qwen2",
    "Qwen2MoeModel": "qwen2_moe",
    "LlamaModel": "llama",
    "MistralModel": "mistral",
    "MixtralModel": "mixtral",
    "OlmoeModel": "olmoe",
    # sequence classifiers (rerankers, reward and sentiment models): a linear score head over the last token's final
    # hidden state in place of the LM head, so they serve /classify, /v1/score and /v1/rerank only
    "Qwen3ForSequenceClassification": "qwen3",
    "Qwen3MoeForSequenceClassification": "qwen3_moe",
    "Qwen2ForSequenceClassification": "qwen2",
    "Qwen2MoeForSequenceClassification": "qwen2_moe",
    "LlamaForSequenceClassification": "llama",
    "MistralForSequenceClassification": "mistral",
    "MixtralForSequenceClassification": "mixtral",
}
MOE_KINDS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
# Rotary types with frequencies fixed at load time (dynamic and longrope are not implemented).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Keys of other architectures' configs that change the math; tpserve implements them only where SERVED_IF_SET says.
UNSUPPORTED_IF_SET = ("attn_logit_softcapping", "final_logit_softcapping", "logit_scale", "attention_multiplier")
# Gemma's logit soft-caps (cap * tanh(x / cap)): of the attention scores before the mask and softmax, of the LM head's
# logits
SOFTCAPS = ("attn_logit_softcapping", "final_logit_softcapping")
# Granite's scalars (transformers' GraniteConfig): the embedding times embedding_multiplier, each sublayer's output
# times residual_multiplier before it joins the residual stream, attention_multiplier as the softmax scale, logits
# divided by logits_scaling
GRANITE_SCALARS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
GEMMA_KINDS = ("gemma2", "gemma3_text")
# The UNSUPPORTED_IF_SET keys a kind serves, as transformers applies them: Granite's attention_multiplier, Gemma 2's
# soft-caps, Gemma 3's final one (transformers' Gemma 3 reads attn_logit_softcapping but never applies it: refused)
SERVED_IF_SET = {"granite": GRANITE_SCALARS, "gemma2": SOFTCAPS, "gemma3_text": ("final_logit_softcapping",)}
# the activations of the gated MLP: transformers' names (its swish is SiLU) -> tpserve's (layers/activation.py)
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# Gemma's attention kinds (its layer_types): a local layer attends within sliding_window (Gemma 3's with its own rotary)
GEMMA_LAYER_TYPES = ("sliding_attention", "full_attention")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The spellings vLLM and SGLang users type (--dtype half, LLM(dtype="bf16")), mapped to tpserve's.
DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
FLASHINFER_DTYPES = (torch.bfloat16, torch.float16)


def _hf_config(cfg: dict[str, Any], model_type: str) -> Any:
    """transformers' config class for this model type, which fills the defaults and normalises the
    legacy ``rope_theta`` + ``rope_scaling`` keys into ``rope_parameters`` as the reference reads them."""
    from transformers import CONFIG_MAPPING

    from huggingface_hub.errors import StrictDataclassError  # a value of the wrong type (transformers 5)

    try:
        return CONFIG_MAPPING[model_type].from_dict(dict(cfg, model_type=model_type))
    except (TypeError, ValueError, KeyError, AttributeError, StrictDataclassError) as e:
        reason = " ".join(str(e).split())  # one line (transformers' validation errors have several)
        raise ValueError(f"config.json cannot be read as a {model_type} config: {reason}") from e


def _check_rope(cfg: dict[str, Any], rope: dict[str, Any], rope_key: str) -> dict[str, Any]:
    """One set of rotary parameters (``rope_key``: where config.json spells them, for errors)."""
    rope = dict(rope or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{rope_key}.rope_type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type in ("llama3", "yarn") and cfg.get("original_max_position_embeddings") is not None:
        # a top-level pretraining length (Phi-3 style) wins over the rotary dict's, as transformers' rotary
        # embedding reads it (standardize_rope_params); the parsed config's dict does not show it
        rope["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    return rope


def _check_supported(cfg: dict[str, Any], hf: Any, kind: str) -> dict[str, Any]:
    """Reject every setting that changes the math and is not implemented; the rotary parameters (Gemma 3's: its
    global layers')."""
    rope = dict(hf.rope_parameters or {})
    rope_key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    if kind == "gemma3_text":  # transformers keeps a set per layer type: the global layers' (rope_theta, rope_scaling)
        rope_key = f"{rope_key}.full_attention" if rope_key == "rope_parameters" else rope_key
        rope = dict(rope.get("full_attention") or {})
    elif rope and all(isinstance(v, dict) for v in rope.values()):
        raise ValueError(f"{rope_key}: per-layer-type rotary parameters are not supported")
    rope = _check_rope(cfg, rope, rope_key)
    partial = rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor {partial} is not supported (rotary over the whole head only)")
    act_key, act = _activation(hf, kind)
    if act not in ACTIVATIONS:
        raise ValueError(f"{act_key} {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    if kind in MOE_KINDS and ACTIVATIONS[act] != "silu":  # the expert kernels compute SiLU only
        raise ValueError(f"{act_key} {act!r} is not supported in a mixture-of-experts model (only silu)")
    if getattr(hf, "mlp_bias", False):
        raise ValueError("mlp_bias true is not supported")
    if kind not in ("qwen2", "qwen2_moe") and getattr(hf, "attention_bias", False):
        raise ValueError("attention_bias true (biases on q/k/v/o projections) is not supported")
    for key in UNSUPPORTED_IF_SET:
        if cfg.get(key) is not None and key not in SERVED_IF_SET.get(kind, ()):
            why = " (transformers' Gemma 3 does not apply it)" if kind == "gemma3_text" and key in SOFTCAPS else ""
            raise ValueError(f"{key} is not supported{why}")
    clip = getattr(hf, "clip_qkv", None)  # OLMoE's optional clamp of q, k and v (a float: transformers checks the type)
    if clip is not None and (kind != "olmoe" or clip <= 0):
        raise ValueError(f"clip_qkv {clip!r} is not supported (OLMoE's: a positive number or null)")
    heads_width = getattr(hf, "head_dim", None) and hf.head_dim * hf.num_attention_heads
    if kind == "olmoe" and heads_width and heads_width != hf.hidden_size:  # transformers' q_norm is hidden_size wide
        raise ValueError(f"olmoe: head_dim {hf.head_dim} x num_attention_heads {hf.num_attention_heads} must equal "
                         f"hidden_size {hf.hidden_size} (its q_norm spans hidden_size)")
    return rope


def _activation(hf: Any, kind: str) -> tuple[str, str]:
    """(config.json's key, its value) of the gated MLP's activation: Gemma's hidden_activation, the others'
    hidden_act."""
    if kind in GEMMA_KINDS:
        return "hidden_activation", hf.hidden_activation
    return "hidden_act", getattr(hf, "hidden_act", "silu")


def _gemma(cfg: dict[str, Any], hf: Any, kind: str) -> dict[str, Any]:
    """Gemma 2's and 3's ModelConfig fields: RMSNorms times (1 + weight), four norms a layer, the embedding times
    sqrt(hidden_size) rounded to the compute dtype, the softmax scale query_pre_attn_scalar ** -0.5, the logit
    soft-caps (Gemma 2's both; Gemma 3's final one, null in its published configs), and Gemma 3's local
    (sliding_attention) layers' own rotary parameters (rope_local_base_freq, unscaled)."""
    if getattr(hf, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention true is not supported (tpserve's attention is causal)")
    layer_types = tuple(hf.layer_types)
    bad = sorted({t for t in layer_types if t not in GEMMA_LAYER_TYPES})
    if bad or len(layer_types) != hf.num_hidden_layers:
        raise ValueError(f"config.json: layer_types must list {hf.num_hidden_layers} of {', '.join(GEMMA_LAYER_TYPES)}"
                         f", got {list(layer_types)!r}")
    scalar = hf.query_pre_attn_scalar
    if not _positive_number(scalar):
        raise ValueError(f"config.json: query_pre_attn_scalar must be a positive number, got {scalar!r}")
    fields = dict(
        norm_weight_offset=1.0,
        sandwich_norms=True,
        embedding_multiplier=float(hf.hidden_size**0.5),
        embedding_multiplier_in_dtype=True,
        attention_multiplier=float(scalar**-0.5),
        **_softcaps(hf, kind),
    )
    if kind == "gemma3_text":
        fields.update(_gemma3_local_rotary(cfg, hf, layer_types))
    return fields


def _positive_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _softcaps(hf: Any, kind: str) -> dict[str, float | None]:
    """The SOFTCAPS this Gemma serves, each a positive number or null (none; transformers would divide by a 0)."""
    caps = {}
    for key in (k for k in SOFTCAPS if k in SERVED_IF_SET[kind]):
        value = getattr(hf, key, None)
        if value is not None and not _positive_number(value):
            raise ValueError(f"config.json: {key} must be a positive number or null, got {value!r}")
        caps[key] = None if value is None else float(value)
    return caps


def _gemma3_local_rotary(cfg: dict[str, Any], hf: Any, layer_types: tuple[str, ...]) -> dict[str, Any]:
    """Gemma 3's local (sliding_attention) layers and their own rotary parameters."""
    local_key = "rope_parameters.sliding_attention" if cfg.get("rope_parameters") else "rope_local_base_freq"
    local = _check_rope(cfg, dict(hf.rope_parameters.get("sliding_attention") or {}), local_key)
    if local.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor {local['partial_rotary_factor']} is not supported (rotary over the "
                         "whole head only)")
    local.setdefault("rope_type", "default")
    local.pop("type", None)
    return dict(
        local_rope_parameters=local,
        local_layers=tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention"),
    )


# Sizes that must be positive where config.json sets them (0 or less would crash a rank).
POSITIVE_SIZES = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "moe_intermediate_size", "num_local_experts",
)


def _check_sizes(cfg: dict[str, Any]) -> None:
    """Before transformers reads them (its validators divide by some); a value of the wrong type is its error."""
    for key in POSITIVE_SIZES:
        value = cfg.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 1:
            raise ValueError(f"config.json: {key} must be a positive integer, got {value!r}")


def _sliding_window(hf: Any, kind: str) -> tuple[int | None, tuple[int, ...]]:
    """(the attention window, the layers that attend within it) as transformers reads them; (None, ()) where every
    layer attends to the whole context. A layer attends to its own token and the window - 1 before it."""
    window = getattr(hf, "sliding_window", None)
    # transformers' Qwen3-MoE (whose config keeps the window only with use_sliding_window), Mistral, Mixtral and Phi-3
    # apply it to every layer and ignore any layer_types a config.json carries
    if kind in ("qwen3_moe", "mistral", "mixtral", "phi3"):
        layers = tuple(range(hf.num_hidden_layers)) if window is not None else ()
    else:  # the others by layer_types (where no layer has a window, Qwen2-MoE's config says sliding_window 0)
        layers = tuple(i for i, t in enumerate(getattr(hf, "layer_types", None) or ()) if t == "sliding_attention")
    if not layers:
        return None, ()
    if window is None:  # (only a layer_types model gets here: transformers' sliding mask would fail on it)
        raise ValueError(f"config.json: sliding_window is null, yet layer_types makes layers {list(layers)} "
                         "sliding_attention: it must be a positive integer")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"config.json: sliding_window must be a positive integer or null, got {window!r}")
    return window, layers


@dataclass(frozen=True)
class MoEConfig:
    """The sparse layers of a mixture-of-experts model (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE)."""

    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # of each expert (moe_intermediate_size; Mixtral's and OLMoE's intermediate_size)
    norm_topk_prob: bool  # renormalise the top-k router probabilities to sum to 1
    layers: tuple[int, ...]  # the decoder layers whose MLP is sparse; the others are dense
    # Qwen2-MoE: a dense MLP of this size beside the routed experts, its output scaled by sigmoid(shared_expert_gate . x);
    # 0: none
    shared_intermediate_size: int = 0
    size_key: str = "moe_intermediate_size"  # config.json's name of the experts' size (Mixtral's: intermediate_size)


def _moe_config(hf: Any, kind: str, num_layers: int) -> MoEConfig | None:
    """transformers' rule for which layers are sparse: not in ``mlp_only_layers`` and every
    ``decoder_sparse_step``-th layer (1-based); Mixtral's and OLMoE's are all sparse, Mixtral's top k always
    renormalised."""
    if kind not in MOE_KINDS:
        return None
    if kind == "mixtral":
        num_experts, expert_size, norm_topk, layers = hf.num_local_experts, hf.intermediate_size, True, range(num_layers)
    elif kind == "olmoe":
        num_experts, expert_size, norm_topk = hf.num_experts, hf.intermediate_size, bool(hf.norm_topk_prob)
        layers = range(num_layers)
    else:
        if not hf.num_experts:
            return None
        step = hf.decoder_sparse_step
        if step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {step}")
        dense = set(hf.mlp_only_layers or ())
        layers = [i for i in range(num_layers) if i not in dense and (i + 1) % step == 0]
        num_experts, expert_size, norm_topk = hf.num_experts, hf.moe_intermediate_size, bool(hf.norm_topk_prob)
    if not 1 <= hf.num_experts_per_tok <= num_experts:
        raise ValueError(f"num_experts_per_tok {hf.num_experts_per_tok} must be in [1, num_experts {num_experts}]")
    shared = getattr(hf, "shared_expert_intermediate_size", 0) if kind == "qwen2_moe" else 0
    if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
        raise ValueError(f"config.json: shared_expert_intermediate_size must be an integer >= 0, got {shared!r}")
    if not layers:  # every layer dense (transformers builds no expert either)
        return None
    size_key = "intermediate_size" if kind in ("mixtral", "olmoe") else "moe_intermediate_size"
    return MoEConfig(num_experts, hf.num_experts_per_tok, expert_size, norm_topk, tuple(layers), shared, size_key)


def _context_length(rope: dict[str, Any], max_positions: int, kind: str = "") -> int:
    """The longest sequence served: YaRN and linear scaling extend the trained context as vLLM reads
    them (original context, resp. max_position_embeddings, x factor). Gemma 3's max_position_embeddings is the scaled
    context already (the 4B+'s 131,072 with linear factor 8): not multiplied again, as vLLM skips it."""
    length = max_positions
    factor = rope.get("factor") if kind != "gemma3_text" else None
    if rope.get("rope_type") == "yarn" and factor:
        length = max(length, int(rope.get("original_max_position_embeddings", max_positions) * factor))
    elif rope.get("rope_type") == "linear" and factor:
        length = int(max_positions * factor)
    return length


def _granite_scalars(hf: Any) -> dict[str, float]:
    """Granite's GRANITE_SCALARS, each a finite number other than 0."""
    values = {}
    for key in GRANITE_SCALARS:
        value = getattr(hf, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value == 0:
            raise ValueError(f"config.json: {key} must be a finite number other than 0, got {value!r}")
        values[key] = float(value)
    return values


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    # transformers' normalised rotary settings: rope_type, rope_theta and the type's own keys
    rope_parameters: dict[str, Any]
    max_position_embeddings: int
    context_length: int  # longest sequence served (see _context_length)
    tie_word_embeddings: bool
    qk_norm: bool  # Qwen3, Gemma 3 (not Gemma 2): RMSNorm on each q/k head before rotary
    qkv_bias: bool  # Qwen2/2.5: bias on q/k/v projections
    torch_dtype: str  # the checkpoint's dtype
    eos_token_ids: tuple[int, ...]
    moe: MoEConfig | None = None  # None: every layer's MLP is dense
    quantization: QuantConfig | None = None  # the checkpoint's quantization_config (FP8 weights)
    lm_head: bool = True  # False: a bare decoder (``*Model``) or a classifier, which generate nothing
    classifier: ClassifierConfig | None = None  # a sequence classifier's classes and rules; None: not one
    projection_qk_norm: bool = False  # OLMoE: RMSNorm over the whole q and k projections (every head) before rotary
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to [-clip_qkv, clip_qkv] after those norms
    # Granite's scalars (GRANITE_SCALARS); the others' are these defaults
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None  # the softmax scale; None: head_dim ** -0.5
    logits_scaling: float = 1.0
    fused_projections: bool = False  # Phi-3: the checkpoint holds q/k/v as one qkv_proj, gate/up as one gate_up_proj
    hidden_act: str = "silu"  # the gated MLP's activation (ACTIVATIONS' values): silu, or Gemma's gelu_tanh
    # Gemma: every RMSNorm multiplies by (1 + weight), the checkpoint's weight plus this (folded in at load)
    norm_weight_offset: float = 0.0
    # Gemma: the attention output normed (post_attention_layernorm) before it joins the residual stream, the MLP's
    # input and output normed by pre_feedforward_layernorm and post_feedforward_layernorm
    sandwich_norms: bool = False
    embedding_multiplier_in_dtype: bool = False  # Gemma: the multiplier rounded to the compute dtype first
    # Gemma 3: the layers (local_layers) that attend within the sliding window rotate with these parameters
    local_rope_parameters: dict[str, Any] | None = None
    local_layers: tuple[int, ...] = ()
    # sliding-window attention: these layers attend to their token and the sliding_window - 1 before it (Gemma 3's
    # local layers; every layer of Mistral, Mixtral and Phi-3 with a window; Qwen2's from max_window_layers on)
    sliding_window: int | None = None
    window_layers: tuple[int, ...] = ()
    # Gemma's logit soft-caps (cap * tanh(x / cap); None: none): Gemma 2's attention scores (after the softmax scale,
    # before the mask and softmax: every attention backend's softcap) and Gemma 2's and 3's LM head logits (after its
    # all-gather, before sampling)
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's attention window in tokens; 0 for the whole context."""
        return tuple(self.sliding_window if i in self.window_layers else 0 for i in range(self.num_hidden_layers))

    def windows_within(self, max_len: int) -> tuple[int, ...]:
        """``layer_windows`` where a window cuts a sequence of up to ``max_len`` tokens, 0 where it never does (so such
        a layer keeps XQA and plans no window of its own)."""
        return tuple(w if w < max_len else 0 for w in self.layer_windows)

    @property
    def attention_scale(self) -> float:
        return self.head_dim**-0.5 if self.attention_multiplier is None else self.attention_multiplier

    @property
    def labels(self) -> tuple[str, ...]:
        """A classifier's classes in id order (its score head's rows); () for any other model."""
        return () if self.classifier is None else self.classifier.labels

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.moe is not None and layer_id in self.moe.layers

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if not self.is_moe_layer(i))

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters["rope_theta"])

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], eos_token_ids: tuple[int, ...] = ()) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise ValueError(f"config.json: architectures must be a list of class names, got {archs!r}")
        raw_quant = cfg.get("quantization_config")
        if raw_quant is not None and not isinstance(raw_quant, dict):  # transformers would fail on it (AttributeError)
            raise ValueError(f"config.json: quantization_config must be an object, got {raw_quant!r}")
        for key in ("id2label", "label2id"):  # transformers fails on another type with an AttributeError
            if key in cfg and not isinstance(cfg[key], dict):
                raise ValueError(f"config.json: {key} must be an object (class id -> name), got {cfg[key]!r}")
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"unsupported architecture {archs}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        kind = SUPPORTED_ARCHITECTURES[arch]
        bare = arch.endswith("Model")
        classifier = arch.endswith("ForSequenceClassification")
        if not classifier and ("classifier_from_token" in cfg or cfg.get("is_original_qwen3_reranker")):
            raise ValueError(f"config.json: classifier_from_token makes a classifier from an LM head: architectures "
                             f"must be a *ForSequenceClassification (e.g. Qwen3ForSequenceClassification), got {archs}")
        _check_sizes(cfg)
        hf = _hf_config(cfg, kind)
        rope = _check_supported(cfg, hf, kind)
        rope.setdefault("rope_type", "default")
        rope.pop("type", None)  # the legacy spelling of rope_type, which transformers keeps beside it
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        kv_heads = hf.num_key_value_heads or hf.num_attention_heads
        if hf.num_attention_heads % kv_heads:
            raise ValueError(
                f"config.json: num_attention_heads {hf.num_attention_heads} is not a multiple of num_key_value_heads {kv_heads}"
            )
        eos = set(eos_token_ids)
        cfg_eos = hf.eos_token_id
        if cfg_eos is not None:
            eos.update(cfg_eos if isinstance(cfg_eos, list) else [cfg_eos])
        dtype = getattr(hf, "dtype", None) or cfg.get("torch_dtype") or "bfloat16"
        moe = _moe_config(hf, kind, hf.num_hidden_layers)
        quantization = None if raw_quant is None else parse_quantization_config(raw_quant)
        return cls(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_hidden_layers=hf.num_hidden_layers,
            num_attention_heads=hf.num_attention_heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            rope_parameters=rope,
            max_position_embeddings=hf.max_position_embeddings,
            context_length=_context_length(rope, hf.max_position_embeddings, kind),
            **dict(zip(("sliding_window", "window_layers"), _sliding_window(hf, kind))),
            # a bare decoder's or a classifier's LM head is its embedding (no memory of its own): its logits only
            # feed the one sample a pooled request discards
            tie_word_embeddings=bool(hf.tie_word_embeddings) or bare or classifier,
            qk_norm=kind in ("qwen3", "qwen3_moe", "gemma3_text"),
            qkv_bias=kind == "qwen2" or kind == "qwen2_moe" and bool(hf.qkv_bias),
            torch_dtype=str(dtype).removeprefix("torch."),
            eos_token_ids=tuple(sorted(eos)),
            moe=moe,
            quantization=quantization,
            lm_head=not (bare or classifier),
            classifier=classifier_config(cfg, hf) if classifier else None,
            projection_qk_norm=kind == "olmoe",
            clip_qkv=None if getattr(hf, "clip_qkv", None) is None else float(hf.clip_qkv),
            **(_granite_scalars(hf) if kind == "granite" else {}),
            fused_projections=kind == "phi3",
            hidden_act=ACTIVATIONS[_activation(hf, kind)[1]],
            **(_gemma(cfg, hf, kind) if kind in GEMMA_KINDS else {}),
        )

    def check_tp_size(self, tp_size: int, name: str = "tp_size", expert_parallel: bool = False) -> None:
        """Raise a clear error when the model cannot be split over ``tp_size`` ranks (``expert_parallel``: a MoE
        layer's experts whole on each rank rather than cut)."""
        if tp_size < 1:
            raise ValueError(f"{name} must be >= 1, got {tp_size}")
        if self.num_attention_heads % tp_size:
            raise ValueError(f"{name} {tp_size} does not divide num_attention_heads {self.num_attention_heads}")
        kv = self.num_key_value_heads
        if kv % tp_size and tp_size % kv:
            raise ValueError(f"num_key_value_heads {kv} neither divides nor is divided by {name} {tp_size}")
        if self.dense_layers and self.intermediate_size % tp_size:
            raise ValueError(f"{name} {tp_size} does not divide intermediate_size {self.intermediate_size}")
        if self.moe is not None and expert_parallel and self.moe.num_experts % tp_size:
            raise ValueError(
                f"{name} {tp_size} does not divide num_experts {self.moe.num_experts} "
                "(expert parallelism puts the same number of whole experts on each rank)"
            )
        if self.moe is not None and not expert_parallel and self.moe.intermediate_size % tp_size:
            raise ValueError(
                f"{name} {tp_size} does not divide {self.moe.size_key} {self.moe.intermediate_size} "
                f"(each rank holds a slice of every expert's intermediate dimension; {_ep_hint(name)})"
            )
        shared = 0 if self.moe is None else self.moe.shared_intermediate_size
        if shared % tp_size:
            raise ValueError(f"{name} {tp_size} does not divide shared_expert_intermediate_size {shared} (the shared "
                             "expert is split like a dense MLP)")
        self._check_fp8_blocks(tp_size, name, expert_parallel)

    def kv_heads_per_rank(self, tp_size: int) -> int:
        """Each rank keeps kv / tp heads, or one replicated head when TP exceeds them."""
        return max(1, self.num_key_value_heads // tp_size)

    def _check_fp8_blocks(self, tp_size: int, name: str, expert_parallel: bool) -> None:
        """FP8 block scales are split (tensor parallelism) and merged (q/k/v, gate/up) with their
        weights, so every rank's part of a quantized projection must be whole blocks."""
        quant = self.quantization
        if quant is None or not quant.prequantized or quant.row_scales:  # quantized at load time, or a scale a row:
            return  # per rank, any shape
        bn, bk = quant.block_size
        q_width = self.num_attention_heads // tp_size * self.head_dim
        kv_width = self.kv_heads_per_rank(tp_size) * self.head_dim
        inter_width = self.intermediate_size // tp_size
        every, dense = range(self.num_hidden_layers), self.dense_layers
        # (layers, checkpoint modules, what, width, block): outputs merged or split by rank, inputs split
        checks = [
            (every, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "query output features", q_width, bn),
            (every, ("self_attn.k_proj", "self_attn.v_proj"), "key/value output features", kv_width, bn),
            (dense, ("mlp.gate_proj", "mlp.up_proj"), "gate/up output features (intermediate_size)", inter_width, bn),
        ]
        sparse = self.moe.layers if self.moe is not None else ()
        shared_width = self.moe.shared_intermediate_size // tp_size if self.moe is not None else 0
        if shared_width:
            checks.append((sparse, ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
                           "shared expert gate/up output features (shared_expert_intermediate_size)", shared_width, bn))
        if tp_size > 1:
            checks += [
                (every, ("self_attn.o_proj",), "o_proj input features", q_width, bk),
                (dense, ("mlp.down_proj",), "down_proj input features", inter_width, bk),
            ]
            if shared_width:
                checks.append((sparse, ("mlp.shared_expert.down_proj",),
                               "shared expert down_proj input features (shared_expert_intermediate_size)", shared_width, bk))
            if self.moe is not None and not expert_parallel:  # each rank cuts every expert's intermediate dim
                expert_width = self.moe.intermediate_size // tp_size
                key = self.moe.size_key
                checks += [
                    (sparse, ("mlp.experts",), f"expert gate/up output features ({key})", expert_width, bn),
                    (sparse, ("mlp.experts",), f"expert down_proj input features ({key})", expert_width, bk),
                ]
        for layers, modules, what, width, block in checks:
            quantized = any(converted(quant, self.architecture, f"model.layers.{i}.{m}") for i in layers for m in modules)
            if quantized and width % block:
                raise ValueError(
                    f"{name} {tp_size}: each rank's share of the {what} is {width}, not a multiple of the FP8 "
                    f"weight block {block} (quantization_config.{quant.block_key} {[bn, bk]}); the block scales "
                    "can only be split across ranks and merged (q/k/v, gate/up) at block boundaries"
                    + (f"; {_ep_hint(name)}" if what.startswith("expert ") else "")
                )

    @classmethod
    def from_pretrained(cls, model_dir: str, overrides: dict[str, Any] | None = None) -> "ModelConfig":
        """The model's config.json, its top-level keys replaced by ``overrides`` (vLLM's --hf-overrides)."""
        cfg = read_json_object(os.path.join(model_dir, "config.json")) | (overrides or {})
        eos: list[int] = []
        gen_path = os.path.join(model_dir, "generation_config.json")
        if os.path.exists(gen_path):
            gen_eos = read_json_object(gen_path).get("eos_token_id")
            if gen_eos is not None:
                eos = gen_eos if isinstance(gen_eos, list) else [gen_eos]
        config = cls.from_dict(cfg, tuple(eos))
        if config.lm_head and not config.tie_word_embeddings and _lacks_lm_head(model_dir):
            # an embedding model's *ForCausalLM config over the bare decoder's weights (as sentence-transformers
            # saves them): no head to generate with; its place is the embedding's, as for a *Model architecture
            config = dataclasses.replace(config, tie_word_embeddings=True, lm_head=False)
        if config.classifier is not None and config.classifier.from_tokens:
            ids = _token_ids(model_dir, config.classifier.from_tokens)
            config = dataclasses.replace(config, classifier=dataclasses.replace(config.classifier, token_ids=ids))
        return config


def _token_ids(model_dir: str, tokens: tuple[str, ...]) -> tuple[int, ...]:
    """classifier_from_token's ids, each one token of the model's tokenizer."""
    from tpserve.tokenizer.loader import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    ids = []
    for token in tokens:
        vocab_id = tokenizer.convert_tokens_to_ids(token)
        if vocab_id is None or vocab_id == tokenizer.unk_token_id and token != tokenizer.unk_token:
            raise ValueError(f"config.json: classifier_from_token {token!r} is not a token of the model's tokenizer")
        ids.append(int(vocab_id))
    return tuple(ids)


def _lacks_lm_head(model_dir: str) -> bool:
    names = tensor_names(model_dir)
    return bool(names) and not any(name.removeprefix("language_model.") == "lm_head.weight" for name in names)


def resolve_dtype(dtype: str | torch.dtype | None, model_config: ModelConfig, device: torch.device) -> torch.dtype:
    """``auto`` (or None) is the checkpoint's dtype on GPU and float32 on the CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        dtype = model_config.torch_dtype if model_config.torch_dtype in DTYPES else "bfloat16"
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _ep_hint(tp_name: str) -> str:
    """How to keep the experts whole, as the user sets it: the CLI flag, or the keyword."""
    flag = "--expert-parallel" if tp_name.startswith("--") else "expert_parallel=True"
    return f"expert parallelism ({flag}) keeps experts whole"
