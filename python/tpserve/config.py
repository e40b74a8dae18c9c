"""Model config (read from a Hugging Face ``config.json``) and engine config."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool  # Qwen3: RMSNorm on each q/k head before rotary
    qkv_bias: bool  # Qwen2/2.5: bias on q/k/v projections
    torch_dtype: str  # the checkpoint's dtype
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], eos_token_ids: tuple[int, ...] = ()) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        kind = SUPPORTED_ARCHITECTURES[arch]
        n_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling is not None:
            rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if rope_type not in ("llama3", "default"):
                raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: llama3)")
            if rope_type == "default":
                rope_scaling = None
        if cfg.get("sliding_window") and cfg.get("use_sliding_window", kind == "mistral"):
            if cfg["sliding_window"] < cfg.get("max_position_embeddings", 0):
                raise ValueError("sliding-window attention is not supported")
        eos = set(eos_token_ids)
        cfg_eos = cfg.get("eos_token_id")
        if cfg_eos is not None:
            eos.update(cfg_eos if isinstance(cfg_eos, list) else [cfg_eos])
        return cls(
            architecture=arch,
            model_type=kind,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=kind == "qwen3",
            qkv_bias=kind == "qwen2" or bool(cfg.get("attention_bias", False)),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
            eos_token_ids=tuple(sorted(eos)),
        )

    def check_tp_size(self, tp_size: int) -> None:
        """Raise a clear error when the model cannot be split over ``tp_size`` ranks."""
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        if self.num_attention_heads % tp_size:
            raise ValueError(f"tp_size {tp_size} does not divide num_attention_heads {self.num_attention_heads}")
        kv = self.num_key_value_heads
        if kv % tp_size and tp_size % kv:
            raise ValueError(f"num_key_value_heads {kv} neither divides nor is divided by tp_size {tp_size}")
        if self.intermediate_size % tp_size:
            raise ValueError(f"tp_size {tp_size} does not divide intermediate_size {self.intermediate_size}")

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
    # TP all-reduce on GPU: auto (peer-memory one-shot/two-shot for small messages, NCCL for large)
    # | nccl | one_shot | two_shot (peer memory for every message that fits its buffer)
    all_reduce: str = "auto"
    # Prefill tokens a step that also decodes may carry; a step with more prefill work runs it
    # without the decodes (they wait one step), so decodes never stall behind a long chunk.
    mixed_prefill_tokens: int = 0
    debug_check_ranks: bool = False
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
        if self.all_reduce not in ("auto", "nccl", "one_shot", "two_shot"):
            raise ValueError(f"all_reduce must be auto, nccl, one_shot or two_shot, got {self.all_reduce!r}")
        if self.mixed_prefill_tokens < 0:
            raise ValueError(f"mixed_prefill_tokens must be >= 0, got {self.mixed_prefill_tokens}")
        if self.cuda_graph_max_bs < 0:
            raise ValueError(f"cuda_graph_max_bs must be >= 0, got {self.cuda_graph_max_bs}")
        if not 0.0 < self.mem_fraction <= 1.0:
            raise ValueError(f"mem_fraction must be in (0, 1], got {self.mem_fraction}")
