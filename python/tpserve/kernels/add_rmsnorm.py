"""The decoder's residual add + RMSNorm in one Triton kernel that lets the next kernel launch at its
start (programmatic dependent launch, ``kernels/pdl.py``).

Why not FlashInfer's fused_add_rmsnorm: it lets the next kernel launch only at its end, so the
GEMV after it (``csrc/gemv.cu``, which issues its first weight loads before it waits for its input)
starts streaming weights once the norm is done. Here the GEMV's blocks launch and load weights
while the norm runs. Without PDL (CPU interpreter, pre-Hopper) it is a plain add + RMSNorm.

The arithmetic is FlashInfer's: x + residual in float32, the new residual rounded to the model
dtype, the sum of squares over the unrounded sum, ``sum * rsqrt(mean + eps) * weight`` rounded once.
In place: ``residual`` becomes the sum and ``x`` the normed output.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tpserve.kernels.pdl import triton_pdl

# ``0``: FlashInfer's fused_add_rmsnorm instead (read at each call; experiments compare the two).
ENV = "TPSERVE_TRITON_ADD_RMSNORM"
MAX_HIDDEN = 16384  # one program holds a row


@triton.jit
def _add_rmsnorm_kernel(x_ptr, residual_ptr, weight_ptr, n, stride_x, stride_r, eps,
                        BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # the next kernel (a GEMV) may launch and load its weights meanwhile
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # no kernel writes the weights
    if PDL:  # x: the previous kernel's output
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    total = x + tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(residual_ptr + row * stride_r + cols, total.to(residual_ptr.dtype.element_ty), mask=mask)
    rms = tl.rsqrt(tl.sum(total * total, axis=0) / n + eps)
    tl.store(x_ptr + row * stride_x + cols, (total * rms * w).to(x_ptr.dtype.element_ty), mask=mask)


def enabled(x: torch.Tensor) -> bool:
    """Whether ``x`` [T, N] takes this kernel (else FlashInfer's or torch's add + RMSNorm)."""
    return x.shape[-1] <= MAX_HIDDEN and os.environ.get(ENV, "1") != "0"


def add_rms_norm_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: ``residual += x``, then ``x = rms_norm(residual) * weight``; returns (x, residual)."""
    if x.dim() != 2 or x.stride(-1) != 1 or residual.stride(-1) != 1 or x.shape != residual.shape:
        raise ValueError(f"add + RMSNorm needs 2-D row-major x and residual of one shape, got {tuple(x.shape)}")
    rows, hidden = x.shape
    if rows:
        block = triton.next_power_of_2(hidden)
        pdl = triton_pdl(x.device, rows)
        _add_rmsnorm_kernel[(rows,)](
            x, residual, weight, hidden, x.stride(0), residual.stride(0), eps,
            BLOCK=block, PDL=pdl, num_warps=min(16, max(4, block // 512)), launch_pdl=pdl,
        )
    return x, residual
