"""SwiGLU on a merged [gate | up] tensor (FlashInfer's fused kernel on CUDA)."""

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
