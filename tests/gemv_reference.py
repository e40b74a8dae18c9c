"""What ``tpserve.kernels.gemv.gemv`` computes, in float32 torch: the GPU tests' oracle, and the CPU
tests' stand-in for the CUDA kernel when they run the decoder's fused norm/add path."""

from __future__ import annotations

import torch

from tpserve.quant.fp8 import dequantize_blocks


def gemv_reference(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor | None = None, module=None, pdl=None,
    silu_mul: bool = False, norm: tuple[torch.Tensor, float] | None = None, add_to: torch.Tensor | None = None,
) -> torch.Tensor:
    """``gemv``'s signature and results (``module`` and ``pdl`` ignored); sums in float32."""
    k = weight.shape[1]
    x2 = x.reshape(-1, k).float()
    if norm is not None:
        norm_weight, eps = norm
        x2 = x2 * torch.rsqrt(x2.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    w = weight.float() if scale_inv is None else dequantize_blocks(weight, scale_inv, (128, 128), torch.float32)
    y = x2 @ w.T
    if silu_mul:
        gate, up = y.to(x.dtype).float().chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate) * up
    y = y.to(x.dtype)
    if add_to is not None:
        add_to.copy_((add_to.float() + y.float()).to(add_to.dtype))
        return add_to
    return y.view(*x.shape[:-1], y.shape[-1])
