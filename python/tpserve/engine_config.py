"""The engine's settings (``EngineConfig``: one rank's, as the CLI and ``LLM`` set them) and the checks that need the
model and the machine, made before any process starts (``check_can_start``)."""

from __future__ import annotations

import importlib.util
import json
import math
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from tpserve.config import DTYPE_ALIASES, DTYPES, FLASHINFER_DTYPES, ModelConfig, resolve_dtype
from tpserve.models.adapters import read_adapter_config
from tpserve.models.checkpoint import check_safetensors
from tpserve.quant.config import check_quantization_name, resolve_quantization
from tpserve.scheduler.ngram import NgramConfig
from tpserve.sampling_params import SEED_LIMIT  # torch.Generator.manual_seed takes a signed 64-bit seed

DEFAULT_CPU_KV_TOKENS = 32768  # the KV cache on the CPU without max_total_tokens
MAX_DIST_TIMEOUT_S = 2_000_000  # torch's TCPStore takes its timeout in milliseconds as a C int (2**31 ms: 24.8 days)
# EngineConfig's string settings (the CLI offers the same choices).
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}  # vLLM's name for e4m3 on CUDA
CHOICES = {
    "device": ("cpu", "cuda"),
    "dtype": tuple(DTYPES),
    "load_format": ("auto", "safetensors", "dummy"),
    "cache": ("radix", "naive"),
    "schedule_policy": ("fcfs", "lpm", "priority"),
    "attention_backend": ("auto", "flashinfer", "torch"),
    "decode_attention": ("auto", "flashinfer", "xqa", "triton"),
    "all_reduce": ("auto", "nccl", "one_shot", "two_shot", "fused"),
    "kv_cache_dtype": ("auto", "fp8_e4m3"),  # and vLLM's "fp8" (KV_CACHE_DTYPE_ALIASES), taken as its e4m3
}


@dataclass(frozen=True)
class EngineConfig:
    """Everything one rank's engine needs. Frozen: make a new one with dataclasses.replace."""

    model: str
    tp_size: int = 1
    device: str | None = None  # None: cuda when available
    dtype: str | None = None  # None or auto: the checkpoint's on GPU, float32 on the CPU
    load_format: str = "auto"  # dummy: random weights
    page_size: int = 16
    max_total_tokens: int | None = None  # KV cache size in tokens (default on CPU: DEFAULT_CPU_KV_TOKENS)
    mem_fraction: float = 0.85  # fraction of free GPU memory for weights' leftovers + KV cache
    max_running_requests: int = 256
    chunked_prefill_size: int = 8192  # prefill tokens per step; longer prompts are chunked (<= 0: off)
    cache: str = "radix"  # prefix cache (naive: none)
    schedule_policy: str = "fcfs"  # lpm: longest cached prefix first; priority: requests' priority, then arrival
    max_model_len: int | None = None  # context limit; default: the model's max_position_embeddings
    seed: int = 0
    dist_init_addr: str | None = None  # tcp://HOST:PORT: chosen by the parent on one node, given across nodes
    attention_backend: str = "auto"  # auto: flashinfer on CUDA when installed
    # The flashinfer backend's decode kernel: auto (on Hopper, XQA for FP8 KV caches, attention/xqa.py; the
    # Triton kernel up to 32 sequences for bf16/fp16 ones), flashinfer (its decode wrapper), xqa (always;
    # Hopper only), triton (always; attention/triton_decode.py)
    decode_attention: str = "auto"
    disable_overlap: bool = False  # overlap scheduling: plan step i+1 while step i runs
    cuda_graph_max_bs: int = 256  # largest decode batch captured in a CUDA graph; 0 disables graphs
    grammar_threads: int = 0  # most xgrammar threads filling one step's grammar masks (0: auto, from the CPUs)
    grammar_compile_timeout: float = 60.0  # seconds a request waits for its grammar to compile before it fails
    # auto (peer-memory one-shot/two-shot for small messages, NCCL for large) | nccl | one_shot |
    # two_shot (peer memory when it fits) | fused (auto, plus all-reduce + residual + RMSNorm in one kernel)
    all_reduce: str = "auto"
    # prefill tokens a step that also decodes may carry; with more, the decodes wait one step
    mixed_prefill_tokens: int = 0
    debug_check_invariants: bool = False  # check every step that ranks agree and KV pages add up
    quantization: str | None = None  # fp8: quantize an unquantized checkpoint's weights at load time
    nnodes: int = 1  # tp_size // nnodes ranks on each node (node 0 holds rank 0)
    node_rank: int = 0
    dist_timeout: float = 15.0  # seconds a node may be silent (joining, heartbeats, collectives); nnodes > 1
    # LoRA adapters served beside the base model: (name, PEFT directory) each (models/adapters.py)
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_lora_rank: int = 16  # the largest adapter rank (each adapted layer holds max_lora_rank rows an adapter)
    # adapter slots each adaptable layer holds (vLLM's max_loras: the adapters one batch may use; any number are
    # loaded, in host memory); they exist where enable_lora is set or lora_modules given
    max_loras: int = 1
    enable_lora: bool = False
    kv_cache_dtype: str = "auto"  # fp8_e4m3: the KV cache in float8 e4m3 (scale 1), read back in the compute dtype
    dp_size: int = 1  # independent replicas of tp_size ranks (one node), on GPUs from dp_rank * tp_size
    dp_rank: int = 0
    # a MoE model's experts split whole over the tp_size ranks (num_experts / tp_size each) instead of every
    # expert's intermediate dim; attention and dense layers stay tensor-parallel
    expert_parallel: bool = False
    # vLLM's --hf-overrides: config.json keys replaced (top-level), as JSON object text (the config holds scalars only,
    # type-checked field by field; hf_overrides_dict reads it); e.g. a Qwen3-Reranker served as
    # the cross-encoder it is ({"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no",
    # "yes"]})
    hf_overrides: str | None = None
    # vLLM's --speculative-config, as JSON object text: n-gram drafts (scheduler/ngram.py)
    speculative_config: str | None = None

    @property
    def lora_slots(self) -> int:
        """Adapter slots in each adaptable layer (slot 0, the base model's, aside): none without LoRA."""
        if not self.enable_lora and not self.lora_modules:
            return 0
        return self.max_loras

    @property
    def speculative_tokens(self) -> int:
        """The most drafts a sequence verifies in one step (``num_speculative_tokens``); 0 without speculation."""
        spec = NgramConfig.from_json(self.speculative_config)
        return 0 if spec is None else spec.num_speculative_tokens

    def load_model_config(self) -> ModelConfig:
        """The model's config.json, with ``hf_overrides``."""
        return ModelConfig.from_pretrained(self.model, hf_overrides_dict(self.hf_overrides))

    def __post_init__(self) -> None:
        _check_types(self)
        object.__setattr__(self, "dtype", DTYPE_ALIASES.get(self.dtype, self.dtype))
        _check_min("tp_size", self.tp_size, 1)
        check_nodes(self.tp_size, self.nnodes, self.node_rank, self.dist_init_addr, dp_size=self.dp_size,
                    all_reduce=self.all_reduce)
        if not 0 < self.dist_timeout <= MAX_DIST_TIMEOUT_S:
            raise ValueError(f"dist_timeout must be a positive number of seconds, at most {MAX_DIST_TIMEOUT_S:,}, "
                             f"got {self.dist_timeout}")
        _check_min("dp_size", self.dp_size, 1)
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"dp_rank must be in [0, dp_size {self.dp_size}), got {self.dp_rank}")
        for name, choices in CHOICES.items():
            value = getattr(self, name)
            if value not in choices + {"device": (None,), "dtype": (None, "auto")}.get(name, ()):
                raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
        _check_min("page_size", self.page_size, 1)
        _check_min("max_running_requests", self.max_running_requests, 1)
        for name in ("mixed_prefill_tokens", "grammar_threads", "cuda_graph_max_bs"):
            _check_min(name, getattr(self, name), 0)
        if self.max_model_len is not None:
            _check_min("max_model_len", self.max_model_len, 2)  # a prompt token and a generated one
        if self.max_total_tokens is not None:
            _check_min("max_total_tokens", self.max_total_tokens, 2)  # a prompt token and a generated one
        if not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if not 0.0 < self.grammar_compile_timeout < math.inf:
            raise ValueError(f"grammar_compile_timeout must be a positive number of seconds, got {self.grammar_compile_timeout}")
        if not 0.0 < self.mem_fraction <= 1.0:
            raise ValueError(f"mem_fraction must be in (0, 1], got {self.mem_fraction}")
        check_quantization_name(self.quantization)  # a clear error for an unknown method
        _check_min("max_lora_rank", self.max_lora_rank, 1)
        _check_min("max_loras", self.max_loras, 1)
        hf_overrides_dict(self.hf_overrides)
        NgramConfig.from_json(self.speculative_config)


def hf_overrides_dict(text: str | None) -> dict[str, Any]:
    """``EngineConfig.hf_overrides`` as the dict it must be (a ValueError naming it otherwise)."""
    if text is None:
        return {}
    try:
        overrides = json.loads(text)
    except ValueError as e:
        raise ValueError(f"hf_overrides must be a JSON object of config.json keys, got {text!r} ({e})") from None
    if not isinstance(overrides, dict):
        raise ValueError(f"hf_overrides must be a JSON object of config.json keys, got {text!r}")
    return overrides


_TYPE_NAMES = {"int": "an integer", "float": "a number", "bool": "True or False", "str": "a string"}


def _check_types(config: EngineConfig) -> None:
    """A setting of the wrong type is a TypeError naming it (not one from a comparison, or from torch
    in a rank process); numpy numbers become plain ints and floats, ints are taken for floats."""
    for f in fields(config):
        value, kind = getattr(config, f.name), f.type.removesuffix(" | None")
        optional = kind != f.type
        if value is None and optional:
            continue
        if f.name == "lora_modules":
            value = _lora_modules(value)
        elif kind == "int" and isinstance(value, numbers.Integral) and not isinstance(value, bool):
            value = int(value)
        elif kind == "float" and isinstance(value, numbers.Real) and not isinstance(value, bool):
            value = float(value)
        elif not (kind == "bool" and isinstance(value, bool) or kind == "str" and isinstance(value, str)):
            raise TypeError(f"{f.name} must be {_TYPE_NAMES[kind]}{' or None' if optional else ''}, got {value!r}")
        object.__setattr__(config, f.name, value)


def _lora_modules(value: Any) -> tuple[tuple[str, str], ...]:
    """``lora_modules`` as (name, directory) pairs, from a mapping or pairs; distinct non-empty names."""
    pairs = tuple(value.items()) if isinstance(value, Mapping) else tuple(tuple(p) for p in value)
    if not all(len(p) == 2 and all(isinstance(x, str) and x for x in p) for p in pairs):
        raise TypeError(f"lora_modules must be {{name: directory}} or (name, directory) pairs, got {value!r}")
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"lora_modules names a LoRA adapter twice: {names}")
    return pairs


def _check_min(name: str, value: int, low: int) -> None:
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def check_nodes(tp_size: int, nnodes: int, node_rank: int, dist_init_addr: str | None, cli: bool = False,
                dp_size: int = 1, all_reduce: str = "auto") -> None:
    """The node layout's checks, naming the CLI flags when ``cli``."""
    def opt(name: str) -> str:
        return f"--{name.replace('_', '-')}" if cli else name

    if nnodes < 1:
        raise ValueError(f"{opt('nnodes')} must be >= 1, got {nnodes}")
    if tp_size % nnodes:
        raise ValueError(
            f"{opt('tp_size')} {tp_size} is not a multiple of {opt('nnodes')} {nnodes}: every node runs "
            f"{opt('tp_size')} / {opt('nnodes')} ranks"
        )
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"{opt('node_rank')} must be in [0, {nnodes}), got {node_rank}")
    if nnodes > 1 and not dist_init_addr:
        raise ValueError(f"{opt('nnodes')} {nnodes} needs {opt('dist_init_addr')} (node 0's HOST:PORT)")
    if nnodes > 1 and dp_size > 1:
        raise ValueError(f"data-parallel replicas run on one node: {opt('dp_size')} {dp_size} with {opt('nnodes')} "
                         f"{nnodes} is not supported")
    if nnodes > 1 and all_reduce in ("one_shot", "two_shot"):
        raise ValueError(f"{opt('all_reduce')} {all_reduce} goes through peer GPU memory, which does not span nodes: "
                         f"use auto or nccl with {opt('nnodes')} {nnodes}")


def _option(name: str, value: Any, cli: bool) -> str:
    """A setting as the user wrote it: ``--load-format dummy`` on the command line, else ``load_format='dummy'``."""
    return f"--{name.replace('_', '-')} {value}" if cli else f"{name}={value!r}"


def _decode_kernel_unsupported(engine: EngineConfig, model: ModelConfig, device: str) -> str | None:
    """Why the decode kernel asked for (xqa or triton) cannot serve this engine, or None (the
    backend checks again)."""
    name = "XQA" if engine.decode_attention == "xqa" else "the Triton decode kernel"
    if engine.attention_backend == "torch" or device != "cuda":
        return f"{name} is a kernel of the flashinfer attention backend, on CUDA"
    if resolve_dtype(engine.dtype, model, torch.device(device)) not in FLASHINFER_DTYPES:
        return f"{name} takes bfloat16 or float16 queries"
    if engine.decode_attention == "xqa" and torch.cuda.get_device_capability()[0] != 9:
        return "XQA decode runs here on Hopper (sm90) GPUs only"
    if engine.decode_attention == "xqa":  # the backend's refusal, here before any rank loads the weights
        from tpserve.attention.xqa import attention_unsupported_reason

        windowed = any(model.windows_within(engine.max_model_len or model.context_length))
        reason = attention_unsupported_reason(windowed, model.attn_logit_softcapping)
        if reason is not None:
            return reason
    for package in ("flashinfer",) if engine.decode_attention == "xqa" else ("flashinfer", "triton"):
        if importlib.util.find_spec(package) is None:
            return f"the {package} package is not installed"
    heads, kv_heads = model.num_attention_heads // engine.tp_size, max(1, model.num_key_value_heads // engine.tp_size)
    if engine.decode_attention == "xqa":
        from tpserve.attention.xqa import shape_unsupported_reason

        return shape_unsupported_reason(engine.page_size, model.head_dim, heads, kv_heads)
    from tpserve.attention.triton_decode import unsupported_reason

    return unsupported_reason(model.head_dim, heads, kv_heads, engine.kv_cache_dtype == "fp8_e4m3")


def _has_safetensors(model_dir: str) -> bool:
    return os.path.isdir(model_dir) and any(name.endswith(".safetensors") for name in os.listdir(model_dir))


def _check_cpu_fits(engine: EngineConfig, model: ModelConfig, cli: bool) -> None:
    """On the CPU the KV cache is exactly ``max_total_tokens`` (whole pages, and a scratch page): that and the weights
    larger than this machine's memory are a clear error here, not an allocator's failure inside every rank."""
    from tpserve.kvcache.pool import KVCachePool
    from tpserve.plan.cost import ModelShape
    from tpserve.quant.fp8 import FP8_DTYPE

    dtype = resolve_dtype(engine.dtype, model, torch.device("cpu"))
    kv_dtype = FP8_DTYPE if engine.kv_cache_dtype == "fp8_e4m3" else dtype
    tokens = engine.max_total_tokens or DEFAULT_CPU_KV_TOKENS
    pages = -(-tokens // engine.page_size) + 1
    kv = pages * KVCachePool.bytes_per_page(model.num_hidden_layers, engine.page_size,
                                            model.kv_heads_per_rank(engine.tp_size), model.head_dim, kv_dtype)
    shape = ModelShape(model, dtype.itemsize, expert_parallel=engine.expert_parallel)  # FP8 weights dequantized
    weights = shape.weight_bytes_per_rank(engine.tp_size)
    ranks_here = engine.tp_size // engine.nnodes * engine.dp_size
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if (kv + weights) * ranks_here > memory:
        size = _option("max_total_tokens", tokens, cli)
        if pages * engine.page_size > 2 * tokens:
            size += f" in pages of {_option('page_size', engine.page_size, cli)}"
        raise ValueError(
            f"this model's weights ({weights * ranks_here / 2**30:,.1f} GiB) and a KV cache of {size} "
            f"({kv * ranks_here / 2**30:,.1f} GiB) on this machine's {ranks_here} CPU rank(s) need more than its "
            f"{memory / 2**30:,.1f} GiB of memory"
        )


def check_can_start(engine: EngineConfig, model: ModelConfig, cli: bool = False) -> None:
    """The checks that need the model and the machine, made before any process starts, so that a
    bad setting is one clear error (naming the CLI flag when ``cli``) rather than a traceback from
    every rank."""
    resolve_quantization(engine.quantization, model.quantization)
    for name, path in engine.lora_modules:  # each adapter readable and of a rank the layers hold
        try:
            read_adapter_config(path, engine.max_lora_rank)
        except ValueError as e:
            raise ValueError(f"{'--lora-modules' if cli else 'lora_modules'} {name}={path}: {e}") from None
    model.check_tp_size(engine.tp_size, name="--tp-size" if cli else "tp_size", expert_parallel=engine.expert_parallel)
    if engine.max_model_len is not None and engine.max_model_len > model.context_length:
        raise ValueError(
            f"{_option('max_model_len', engine.max_model_len, cli)} exceeds the model's context length "
            f"({model.context_length})"
        )
    device = engine.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{_option('device', 'cuda', cli)}: CUDA is not available on this machine")
        per_node = engine.tp_size // engine.nnodes
        gpus = per_node * engine.dp_size
        if torch.cuda.device_count() < gpus:
            if engine.dp_size > 1:
                raise ValueError(
                    f"{_option('dp_size', engine.dp_size, cli)} x {_option('tp_size', engine.tp_size, cli)} "
                    f"needs {gpus} GPUs; {torch.cuda.device_count()} visible"
                )
            where = f" on each of {engine.nnodes} nodes" if engine.nnodes > 1 else ""
            raise ValueError(
                f"{_option('tp_size', engine.tp_size, cli)} needs {per_node} GPUs{where}; "
                f"{torch.cuda.device_count()} visible"
            )
    if device == "cpu":
        _check_cpu_fits(engine, model, cli)
    if engine.attention_backend == "flashinfer":
        dtype = resolve_dtype(engine.dtype, model, torch.device(device))
        if device != "cuda" or dtype not in FLASHINFER_DTYPES:
            raise ValueError(
                f"{_option('attention_backend', 'flashinfer', cli)} runs on CUDA in bfloat16 or float16, "
                f"not on {device} in {str(dtype).removeprefix('torch.')}; use "
                f"{_option('attention_backend', 'auto', cli)} (torch attention where FlashInfer cannot run)"
            )
    if engine.decode_attention in ("xqa", "triton"):
        reason = _decode_kernel_unsupported(engine, model, device)
        if reason is not None:
            raise ValueError(
                f"{_option('decode_attention', engine.decode_attention, cli)}: {reason}; "
                f"use {_option('decode_attention', 'auto', cli)}"
            )
    if engine.load_format != "dummy":
        if not _has_safetensors(engine.model):
            raise ValueError(
                f"no .safetensors weights in {engine.model}; pass {_option('load_format', 'dummy', cli)} "
                "for random weights"
            )
        check_safetensors(engine.model)  # a truncated or missing file: named here, not by every rank
