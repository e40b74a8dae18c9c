"""RMSNorm in float32 as in transformers; on CUDA in half precision, FlashInfer's kernels and, for
the residual add + norm, tpserve's Triton kernel (``kernels/add_rmsnorm.py``: it lets the next GEMV
start loading weights while it runs)."""

from __future__ import annotations

import torch
from torch import nn

from tpserve.config import FLASHINFER_DTYPES
from tpserve.kernels import use_flashinfer, use_triton
from tpserve.layers.linear import ReplicatedWeights, Slice, copy_checked


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


class ProjectionNorm(nn.Module):
    """OLMoE's q_norm / k_norm: an RMSNorm over a whole projection (every head of the model), of which this rank
    holds ``part`` (its heads; the weight's matching slice). ``normalize`` takes the rank's part and the sum of
    squares over the whole projection, which the caller all-reduces (``sum_of_squares``, then ``copies``: the ranks
    holding each head, KV heads being replicated past their count)."""

    def __init__(self, part: Slice, eps: float, copies: int = 1) -> None:
        super().__init__()
        self.part, self.eps, self.copies = Slice(part.start, part.size, 0, part.full), eps, copies
        self.weight = nn.Parameter(torch.empty(part.size), requires_grad=False)

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        copy_checked(self.weight.data, self.part.cut(loaded, 0, 1, param_name), param_name)

    def sum_of_squares(self, x: torch.Tensor) -> torch.Tensor:
        """[T] float32: this rank's share of the projection's sum of squares (divided among the copies)."""
        return x.float().pow(2).sum(-1) / self.copies

    def normalize(self, x: torch.Tensor, sum_sq: torch.Tensor) -> torch.Tensor:
        """As transformers' RMSNorm: in float32, rounded to x's dtype, then times the weight."""
        normed = x.float() * torch.rsqrt(sum_sq[:, None] / self.part.full + self.eps)
        return self.weight * normed.to(x.dtype)
