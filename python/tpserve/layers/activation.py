"""The gated MLP's activation on a merged [gate | up] tensor: SwiGLU (FlashInfer's fused kernel on CUDA), or Gemma's
GELU (tanh approximation) in plain torch on every device: tpserve's fused GPU kernels (the CUDA GEMV's epilogue, the
MoE kernels) compute SiLU only, so a GELU model never reaches them (``layers/mlp.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tpserve.kernels import use_flashinfer


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_flashinfer(x.device, x.dtype):
        from tpserve.kernels import flashinfer_ops

        if flashinfer_ops.silu_and_mul_supported(x):
            return flashinfer_ops.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up: transformers' gelu_pytorch_tanh."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def act_and_mul(x: torch.Tensor, activation: str) -> torch.Tensor:
    """``activation`` (config.ACTIVATIONS' values: silu, gelu_tanh) of the gate times up."""
    if activation == "silu":
        return silu_and_mul(x)
    if activation == "gelu_tanh":
        return gelu_tanh_and_mul(x)
    raise ValueError(f"unknown activation {activation!r} (silu, gelu_tanh)")
