"""FlashInfer's fused RMSNorm, add + RMSNorm, SiLU-and-mul and rotary kernels (callers check
``use_flashinfer`` first). They differ from the torch reference only by rounding: rows in float32
rounded once at the end (torch rounds before the weight multiply); a float32 cos/sin table.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from tpserve.kernels import optional_import


@functools.cache
def _ops() -> SimpleNamespace:
    if optional_import("flashinfer") is None:
        raise RuntimeError("flashinfer is not importable; check tpserve.kernels.use_flashinfer first")
    from flashinfer.activation import silu_and_mul
    from flashinfer.norm import fused_add_rmsnorm, rmsnorm
    from flashinfer.rope import apply_rope_with_cos_sin_cache_inplace

    return SimpleNamespace(
        rmsnorm=rmsnorm,
        fused_add_rmsnorm=fused_add_rmsnorm,
        silu_and_mul=silu_and_mul,
        rope=apply_rope_with_cos_sin_cache_inplace,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A new ``x / rms(x) * weight`` over the last dim of [T, N] or [T, H, D]; a 3-D x (q/k norm)
    may be a strided view of the qkv output, read through its strides without a copy."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _ops().rmsnorm(x, weight, eps, out=out)
    return out


def fused_add_rms_norm_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: ``residual += x``, then ``x = rms_norm(residual)``; returns (x, residual)."""
    if x.dim() != 2 or x.stride(-1) != 1 or residual.stride(-1) != 1:
        raise ValueError(f"fused add + RMSNorm needs 2-D row-major tensors, got {tuple(x.shape)}")
    _ops().fused_add_rmsnorm(x, residual, weight, eps)
    return x, residual


def silu_and_mul_supported(x: torch.Tensor) -> bool:
    # The kernel moves 16-byte vectors, so each half-row must be a whole number of them.
    return x.stride(-1) == 1 and x.shape[-1] * x.element_size() % 32 == 0


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a merged [..., 2 * I] tensor, as a new [..., I] tensor."""
    return _ops().silu_and_mul(x)


def rotary_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cache: torch.Tensor) -> None:
    """In place, neox style: rotate q [T, Hq, D] and k [T, Hk, D] (strided views allowed, last
    dim contiguous) by the angles of ``positions`` [T] (int32 or int64)."""
    head_dim = q.shape[-1]
    _ops().rope(positions, q, k, head_dim, cache, is_neox=True)
