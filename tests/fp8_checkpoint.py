"""Test helper: a model directory rewritten as FP8 checkpoints are published (Qwen3-*-FP8, DeepSeek-V3):
config.json with ``quantization_config``, each quantized linear weight in float8_e4m3fn with a
float32 ``weight_scale_inv`` per block; and the same weights dequantized, for a reference."""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from tpserve.quant.config import QuantConfig
from tpserve.quant.fp8 import FP8_DTYPE, FP8_MAX, dequantize_blocks, dequantize_experts, quantize_blocks, quantize_experts

# The projections transformers' FP8 integration replaces (every nn.Linear but the LM head, the MoE routers and
# Qwen2-MoE's shared expert gate); w1/w3/w2: Mixtral's experts.
_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def _weights(model_dir: str) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(model_dir, name)))
    return tensors


def _write(src: str, dst: str, tensors: dict[str, torch.Tensor], quantization_config: dict | None) -> str:
    """``src``'s files but the weights, then ``tensors`` as one safetensors file and config.json
    with ``quantization_config`` (or none)."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if not name.startswith("model") and os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    path = os.path.join(dst, "config.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg.pop("quantization_config", None)
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    return dst


def write_fp8_checkpoint(
    src: str, dst: str, block_size: tuple[int, int] = (128, 128), modules_to_not_convert: tuple[str, ...] = ("lm_head",)
) -> str:
    """``src`` (an unquantized safetensors model) quantized into ``dst`` in the published format."""
    quant = QuantConfig("fp8", block_size, prequantized=True, not_converted=modules_to_not_convert)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in _weights(src).items():
        module, _, param = name.rpartition(".")
        if param == "weight" and module.rpartition(".")[2] in _LINEAR and quant.converts(module):
            out[name], out[f"{module}.weight_scale_inv"] = quantize_blocks(tensor, block_size)
        else:
            out[name] = tensor.to(torch.bfloat16)
    return _write(src, dst, out, {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(block_size),
        "modules_to_not_convert": list(modules_to_not_convert),
    })


def write_compressed_tensors_checkpoint(src: str, dst: str, strategy: str, static_activations: bool = False) -> str:
    """``src`` quantized as llm-compressor saves FP8 models (compressed-tensors, ``float-quantized``): each Linear's
    weight in float8_e4m3fn with a bf16 ``weight_scale`` per output channel ([rows, 1]) or per tensor ([1]), the LM
    head ignored; ``static_activations`` adds a per-tensor ``input_scale`` (the FP8 scheme), else activations are
    dynamic per token (FP8_DYNAMIC)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in _weights(src).items():
        module, _, param = name.rpartition(".")
        if param == "weight" and module.rpartition(".")[2] in _LINEAR:
            amax = tensor.abs().amax(dim=1, keepdim=True) if strategy == "channel" else tensor.abs().amax().reshape(1)
            scale = (amax.clamp(min=1e-12) / FP8_MAX).to(torch.bfloat16)
            out[name] = (tensor / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            out[f"{module}.weight_scale"] = scale
            if static_activations:
                out[f"{module}.input_scale"] = torch.tensor([0.05], dtype=torch.bfloat16)
        else:
            out[name] = tensor.to(torch.bfloat16)
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False,
               "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax", "observer_kwargs": {}}
    activations = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": not static_activations,
                   "strategy": "tensor" if static_activations else "token", "group_size": None, "observer": None}
    return _write(src, dst, out, {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations,
                                      "output_activations": None}},
        "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}, "global_compression_ratio": None,
    })


def write_dequantized(fp8_dir: str, dst: str) -> str:
    """An FP8 checkpoint's weights dequantized to float32, with no quantization_config: what the
    FP8 model computes (up to activation quantization), loadable by transformers on the CPU. Block scales
    (``weight_scale_inv``), or compressed-tensors' per-channel or per-tensor ``weight_scale``."""
    with open(os.path.join(fp8_dir, "config.json"), encoding="utf-8") as f:
        quant = json.load(f)["quantization_config"]
    tensors = _weights(fp8_dir)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith((".weight_scale_inv", ".weight_scale", ".input_scale")):
            continue
        prefix = name.removesuffix("weight")
        if prefix + "weight_scale_inv" in tensors:
            block = tuple(quant["weight_block_size"])
            out[name] = dequantize_blocks(tensor, tensors[prefix + "weight_scale_inv"], block, torch.float32)  # type: ignore[arg-type]
        elif prefix + "weight_scale" in tensors:
            out[name] = tensor.float() * tensors[prefix + "weight_scale"].float()  # [rows, 1] or [1] broadcast
        else:
            out[name] = tensor.float()
    return _write(fp8_dir, dst, out, None)


def fp8_experts(gate_up: torch.Tensor, down: torch.Tensor, block: tuple[int, int]):
    """Experts quantized per expert and projection as an FP8 checkpoint holds them: (gate_up fp8, down fp8,
    ExpertScales, gate_up and down dequantized to float32)."""
    gate_up_q, down_q, scales = quantize_experts(gate_up, down, block)
    return (gate_up_q, down_q, scales, *dequantize_experts(gate_up_q, down_q, scales, torch.float32))
