"""FP8 GEMMs through torch's scaled matmul (cuBLAS / CUTLASS on Hopper), with the scale layouts
it checks.

Block scaling (DeepSeek's 1x128 activation groups, 128x128 weight blocks; sm90, cuBLASLt 12.9+)::

    mat_a   x quantized, [M, K] row-major
    mat_b   weight.t(): [K, N] column-major (the [N, K] weight as stored)
    scale_a [M, ceil(K / 128)], strides (1, M): "outer-dim-major" (``quantize_activations(..,
            token_major=False)`` writes it so)
    scale_b [L4, ceil(N / 128)], strides (1, L4), L4 = ceil(K / 128) rounded up to 4: the weight's
            [ceil(N / 128), L4] block scales, transposed (``pad_block_scales`` pads the columns)

Row scaling (one scale per token and one per output feature, the weight quantized with blocks
(1, K)): scale_a [M, 1], scale_b [1, N], both contiguous.

``blockwise_reference`` and ``rowwise_reference`` read the operands with those meanings in
torch, so the CPU tests check the layouts built here against the block GEMM's reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tpserve.quant.fp8 import num_blocks

SCALED_MM_BLOCK = (128, 128)


def pad_block_scales(scale_inv: torch.Tensor, multiple: int = 4) -> torch.Tensor:
    """[Nb, Kb] block scales as [Nb, round_up(Kb, multiple)] contiguous (padding 1.0, never read):
    the row stride cuBLAS wants, and one every kernel here accepts."""
    rows, cols = scale_inv.shape
    padded = torch.ones((rows, num_blocks(cols, multiple) * multiple), dtype=torch.float32, device=scale_inv.device)
    padded[:, :cols] = scale_inv
    return padded


def blockwise_operands(
    xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, padded_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mat_a, mat_b, scale_a, scale_b) for the 1x128 x 128x128 scaled matmul."""
    m, k = xq.shape
    groups = num_blocks(k, SCALED_MM_BLOCK[1])
    if x_scale.shape != (m, groups) or (m > 1 and groups > 1 and x_scale.stride() != (1, m)):
        raise ValueError(f"activation scales must be [{m}, {groups}] with strides (1, {m}), got "
                         f"{tuple(x_scale.shape)} strides {x_scale.stride()}")
    if padded_scale.shape[1] % 4 or not padded_scale.is_contiguous():
        raise ValueError(f"weight scales must be contiguous with columns padded to 4, got {tuple(padded_scale.shape)}")
    return xq, weight.t(), x_scale, padded_scale.t()


def blockwise_reference(
    mat_a: torch.Tensor, mat_b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The block-scaled product in float32 torch: a[m, k] * scale_a[m, k // 128] times
    b[k, n] * scale_b[k // 128, n // 128]."""
    k, n = mat_b.shape
    bk, bn = SCALED_MM_BLOCK[1], SCALED_MM_BLOCK[0]
    a = mat_a.float() * scale_a.repeat_interleave(bk, dim=1)[:, :k]
    sb = scale_b[: num_blocks(k, bk)].repeat_interleave(bk, dim=0)[:k].repeat_interleave(bn, dim=1)[:, :n]
    return (a @ (mat_b.float() * sb)).to(dtype)


def rowwise_reference(
    mat_a: torch.Tensor, mat_b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    return ((mat_a.float() @ mat_b.float()) * scale_a * scale_b).to(dtype)


def scaled_mm_blockwise(x: torch.Tensor, weight: torch.Tensor, padded_scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight.T with 128x128 weight blocks (scales from ``pad_block_scales``), the
    activations quantized per token and 128 features by tpserve's kernel; out in x's dtype."""
    from tpserve.kernels.fp8_gemm import quantize_activations

    xq, xs = quantize_activations(x, SCALED_MM_BLOCK[1], token_major=False)
    a, b, sa, sb = blockwise_operands(xq, xs, weight, padded_scale)
    if hasattr(F, "scaled_mm"):
        kinds = F.ScalingType
        return F.scaled_mm(a, b, sa, kinds.BlockWise1x128, sb, kinds.BlockWise128x128, output_dtype=x.dtype)
    return torch._scaled_mm(a, b, sa, sb[: num_blocks(x.shape[1], SCALED_MM_BLOCK[1])], out_dtype=x.dtype)


def scaled_mm_rowwise(x: torch.Tensor, weight: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight.T with one scale per output feature (``row_scale`` [N, 1]), the
    activations quantized per token; out in x's dtype."""
    from tpserve.kernels.fp8_gemm import quantize_activations

    xq, xs = quantize_activations(x, x.shape[1])
    return torch._scaled_mm(xq, weight.t(), xs, row_scale.t(), out_dtype=x.dtype)
