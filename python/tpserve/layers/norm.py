"""RMSNorm in float32 as in transformers; on CUDA in half precision, FlashInfer's kernels and, for
the residual add + norm, tpserve's Triton kernel (``kernels/add_rmsnorm.py``: it lets the next GEMV
start loading weights while it runs)."""

from __future__ import annotations

import torch
from torch import nn

from tpserve.config import FLASHINFER_DTYPES
from tpserve.kernels import use_flashinfer, use_triton
from tpserve.layers.linear import ReplicatedWeights


class RMSNorm(ReplicatedWeights):
    """With ``residual``: adds it first, returns (normed, new residual). The fused add kernels work
    in place (``x`` becomes the output, ``residual`` the new residual): callers must own
    both. A [T, heads, head_dim] input (q/k norm) is normalised per head, maybe a strided view."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None and x.dtype in FLASHINFER_DTYPES and use_triton(x.device):
            from tpserve.kernels import add_rmsnorm

            if add_rmsnorm.enabled(x):
                return add_rmsnorm.add_rms_norm_(x, residual, self.weight, self.eps)
        if use_flashinfer(x.device, x.dtype):
            from tpserve.kernels import flashinfer_ops

            if residual is None:
                return flashinfer_ops.rms_norm(x, self.weight, self.eps)
            return flashinfer_ops.fused_add_rms_norm_(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual
