"""Model config (a Hugging Face ``config.json``, read through transformers) and engine config."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from tpserve.quant.config import QuantConfig, parse_quantization_config, resolve_quantization

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
}
# Rotary types whose frequencies are fixed at load time (dynamic and longrope depend on the
# sequence length at run time and are not implemented).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Keys of other architectures' configs that change the math; tpserve implements none of them.
UNSUPPORTED_IF_SET = ("attn_logit_softcapping", "final_logit_softcapping", "logit_scale", "attention_multiplier")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _hf_config(cfg: dict[str, Any], model_type: str) -> Any:
    """transformers' own config class for this model type: it fills the defaults and normalises
    the legacy ``rope_theta`` + ``rope_scaling`` keys into ``rope_parameters`` exactly as the
    reference implementation reads them, so tpserve never re-derives those rules."""
    from transformers import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[model_type].from_dict(dict(cfg, model_type=model_type))
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"config.json cannot be read as a {model_type} config: {e}") from e


def _check_supported(cfg: dict[str, Any], hf: Any, kind: str) -> dict[str, Any]:
    """Reject every setting that changes the math and that tpserve does not implement; return
    the normalised rotary parameters."""
    rope = dict(hf.rope_parameters or {})
    rope_key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    if rope and all(isinstance(v, dict) for v in rope.values()):
        raise ValueError(f"{rope_key}: per-layer-type rotary parameters are not supported")
    rope_type = rope.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{rope_key}.rope_type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    partial = rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor {partial} is not supported (rotary over the whole head only)")
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf.hidden_act!r} is not supported (only silu)")
    if getattr(hf, "mlp_bias", False):
        raise ValueError("mlp_bias true is not supported")
    if kind != "qwen2" and getattr(hf, "attention_bias", False):
        raise ValueError("attention_bias true (biases on q/k/v/o projections) is not supported")
    for key in UNSUPPORTED_IF_SET:
        if cfg.get(key) is not None:
            raise ValueError(f"{key} is not supported")
    return rope


def _sliding_window(hf: Any, kind: str) -> int | None:
    """The attention window of any layer that has one (None: every layer attends to the whole context)."""
    window = getattr(hf, "sliding_window", None)
    layer_types = getattr(hf, "layer_types", None)
    if layer_types is not None:
        return window if any(t != "full_attention" for t in layer_types) else None
    return window if kind == "mistral" else None  # transformers' Mistral applies it to every layer


def _context_length(rope: dict[str, Any], max_positions: int, window: int | None) -> int:
    """The longest sequence served. YaRN and linear scaling extend the trained context as vLLM
    reads them (YaRN: original context x factor; linear: max_position_embeddings x factor); tpserve has no sliding-window attention, so a windowed model is served
    up to its window, where full attention computes exactly the same thing."""
    length = max_positions
    factor = rope.get("factor")
    if rope.get("rope_type") == "yarn" and factor:
        length = max(length, int(rope.get("original_max_position_embeddings", max_positions) * factor))
    elif rope.get("rope_type") == "linear" and factor:
        length = int(max_positions * factor)
    if window is not None and window < length:
        logger.warning("the model uses sliding-window attention (window %d): serving contexts up to %d tokens", window, window)
        length = window
    return length


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
    qk_norm: bool  # Qwen3: RMSNorm on each q/k head before rotary
    qkv_bias: bool  # Qwen2/2.5: bias on q/k/v projections
    torch_dtype: str  # the checkpoint's dtype
    eos_token_ids: tuple[int, ...]
    quantization: QuantConfig | None = None  # the checkpoint's quantization_config (FP8 weights)

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters["rope_theta"])

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], eos_token_ids: tuple[int, ...] = ()) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        kind = SUPPORTED_ARCHITECTURES[arch]
        hf = _hf_config(cfg, kind)
        rope = _check_supported(cfg, hf, kind)
        rope.setdefault("rope_type", "default")
        rope.pop("type", None)  # the legacy spelling of rope_type, which transformers keeps beside it
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        eos = set(eos_token_ids)
        cfg_eos = hf.eos_token_id
        if cfg_eos is not None:
            eos.update(cfg_eos if isinstance(cfg_eos, list) else [cfg_eos])
        dtype = getattr(hf, "dtype", None) or cfg.get("torch_dtype") or "bfloat16"
        quant = cfg.get("quantization_config")
        return cls(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_hidden_layers=hf.num_hidden_layers,
            num_attention_heads=hf.num_attention_heads,
            num_key_value_heads=hf.num_key_value_heads or hf.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            rope_parameters=rope,
            max_position_embeddings=hf.max_position_embeddings,
            context_length=_context_length(rope, hf.max_position_embeddings, _sliding_window(hf, kind)),
            tie_word_embeddings=bool(hf.tie_word_embeddings),
            qk_norm=kind == "qwen3",
            qkv_bias=kind == "qwen2",
            torch_dtype=str(dtype).removeprefix("torch."),
            eos_token_ids=tuple(sorted(eos)),
            quantization=None if quant is None else parse_quantization_config(quant),
        )

    def check_tp_size(self, tp_size: int, name: str = "tp_size") -> None:
        """Raise a clear error when the model cannot be split over ``tp_size`` ranks."""
        if tp_size < 1:
            raise ValueError(f"{name} must be >= 1, got {tp_size}")
        if self.num_attention_heads % tp_size:
            raise ValueError(f"{name} {tp_size} does not divide num_attention_heads {self.num_attention_heads}")
        kv = self.num_key_value_heads
        if kv % tp_size and tp_size % kv:
            raise ValueError(f"num_key_value_heads {kv} neither divides nor is divided by {name} {tp_size}")
        if self.intermediate_size % tp_size:
            raise ValueError(f"{name} {tp_size} does not divide intermediate_size {self.intermediate_size}")
        self._check_fp8_blocks(tp_size, name)

    def _check_fp8_blocks(self, tp_size: int, name: str) -> None:
        """FP8 block scales are split (tensor parallelism) and merged (q/k/v, gate/up) with their
        weights, so every rank's part of a quantized projection must be whole blocks."""
        quant = self.quantization
        if quant is None or not quant.prequantized:  # quantized at load time: per rank, any shape
            return
        bn, bk = quant.block_size
        kv_heads = self.num_key_value_heads // tp_size if self.num_key_value_heads >= tp_size else 1
        q_width, kv_width = self.num_attention_heads // tp_size * self.head_dim, kv_heads * self.head_dim
        inter_width = self.intermediate_size // tp_size
        # (checkpoint modules, what, width, block): outputs merged or split by rank, inputs split
        checks = [
            (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "query output features", q_width, bn),
            (("self_attn.k_proj", "self_attn.v_proj"), "key/value output features", kv_width, bn),
            (("mlp.gate_proj", "mlp.up_proj"), "gate/up output features (intermediate_size)", inter_width, bn),
        ]
        if tp_size > 1:
            checks += [
                (("self_attn.o_proj",), "o_proj input features", q_width, bk),
                (("mlp.down_proj",), "down_proj input features", inter_width, bk),
            ]
        for modules, what, width, block in checks:
            converted = any(
                quant.converts(f"model.layers.{i}.{m}") for i in range(self.num_hidden_layers) for m in modules
            )
            if converted and width % block:
                raise ValueError(
                    f"{name} {tp_size}: each rank's share of the {what} is {width}, not a multiple of the FP8 "
                    f"weight block {block} (quantization_config.weight_block_size {[bn, bk]}); the block scales "
                    "can only be split across ranks and merged (q/k/v, gate/up) at block boundaries"
                )

    @classmethod
    def from_pretrained(cls, model_dir: str) -> "ModelConfig":
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
        eos: list[int] = []
        gen_path = os.path.join(model_dir, "generation_config.json")
        if os.path.exists(gen_path):
            with open(gen_path) as f:
                gen_eos = json.load(f).get("eos_token_id")
            if gen_eos is not None:
                eos = gen_eos if isinstance(gen_eos, list) else [gen_eos]
        return cls.from_dict(cfg, tuple(eos))


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


@dataclass(frozen=True)
class EngineConfig:
    """Everything one rank's engine needs. Frozen: make a new one with dataclasses.replace."""

    model: str
    tp_size: int = 1
    device: str | None = None  # "cuda", "cpu" or None (cuda when available)
    dtype: str | None = None  # auto | float32 | bfloat16 | float16
    load_format: str = "auto"  # auto | safetensors | dummy
    page_size: int = 16
    max_total_tokens: int | None = None  # KV cache size in tokens (default on CPU: 32768)
    mem_fraction: float = 0.85  # fraction of free GPU memory for weights' leftovers + KV cache
    max_running_requests: int = 256
    chunked_prefill_size: int = 8192  # prefill tokens per step; longer prompts are chunked (<= 0: off)
    cache: str = "radix"  # prefix cache: radix | naive
    schedule_policy: str = "fcfs"  # fcfs | lpm (longest cached prefix first)
    max_model_len: int | None = None  # context limit; default: the model's max_position_embeddings
    seed: int = 0
    dist_init_addr: str | None = None  # tcp://127.0.0.1:PORT chosen by the parent; None for tp 1
    attention_backend: str = "auto"  # auto (flashinfer on CUDA when installed) | flashinfer | torch
    disable_overlap: bool = False  # overlap scheduling: plan step i+1 while step i runs
    cuda_graph_max_bs: int = 256  # largest decode batch captured in a CUDA graph; 0 disables graphs
    debug_check_ranks: bool = False
    quantization: str | None = None  # fp8: quantize an unquantized checkpoint's weights at load time
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format must be auto, safetensors or dummy, got {self.load_format!r}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.cache not in ("radix", "naive"):
            raise ValueError(f"cache must be radix or naive, got {self.cache!r}")
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise ValueError(f"schedule_policy must be fcfs or lpm, got {self.schedule_policy!r}")
        if self.device not in (None, "cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.cuda_graph_max_bs < 0:
            raise ValueError(f"cuda_graph_max_bs must be >= 0, got {self.cuda_graph_max_bs}")
        if not 0.0 < self.mem_fraction <= 1.0:
            raise ValueError(f"mem_fraction must be in (0, 1], got {self.mem_fraction}")
        resolve_quantization(self.quantization, None)  # a clear error for an unknown method


# FlashInfer's attention kernels take half precision only.
FLASHINFER_ATTENTION_DTYPES = (torch.bfloat16, torch.float16)


def _option(name: str, value: Any, cli: bool) -> str:
    """A setting as the user wrote it: ``--load-format dummy`` on the command line, else ``load_format='dummy'``."""
    return f"--{name.replace('_', '-')} {value}" if cli else f"{name}={value!r}"


def _has_safetensors(model_dir: str) -> bool:
    return os.path.isdir(model_dir) and any(name.endswith(".safetensors") for name in os.listdir(model_dir))


def check_can_start(engine: EngineConfig, model: ModelConfig, cli: bool = False) -> None:
    """The checks that need the model and the machine, made before any process starts, so that a
    bad setting is one clear error (naming the CLI flag when ``cli``) rather than a traceback from
    every rank."""
    resolve_quantization(engine.quantization, model.quantization)
    model.check_tp_size(engine.tp_size, name="--tp-size" if cli else "tp_size")
    if engine.max_model_len is not None and engine.max_model_len > model.context_length:
        raise ValueError(
            f"{_option('max_model_len', engine.max_model_len, cli)} exceeds the model's context length "
            f"({model.context_length})"
        )
    device = engine.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{_option('device', 'cuda', cli)}: CUDA is not available on this machine")
        if torch.cuda.device_count() < engine.tp_size:
            raise ValueError(
                f"{_option('tp_size', engine.tp_size, cli)} needs {engine.tp_size} GPUs; "
                f"{torch.cuda.device_count()} visible"
            )
    if engine.attention_backend == "flashinfer":
        dtype = resolve_dtype(engine.dtype, model, torch.device(device))
        if device != "cuda" or dtype not in FLASHINFER_ATTENTION_DTYPES:
            raise ValueError(
                f"{_option('attention_backend', 'flashinfer', cli)} runs on CUDA in bfloat16 or float16, "
                f"not on {device} in {str(dtype).removeprefix('torch.')}; use "
                f"{_option('attention_backend', 'auto', cli)} (torch attention where FlashInfer cannot run)"
            )
    if engine.load_format != "dummy" and not _has_safetensors(engine.model):
        raise ValueError(
            f"no .safetensors weights in {engine.model}; pass {_option('load_format', 'dummy', cli)} "
            "for random weights"
        )
