"""Which GEMM an FP8 linear layer runs on the GPU, and the weight layout it needs.

``TPSERVE_FP8_GEMM`` (read when a model finishes loading) picks one of:

- ``auto`` (default): ``fp8_gemv`` (FP8 weights, activations unquantized) for up to
  ``fp8_gemv.MAX_TOKENS`` tokens, the decode steps bound by weight bytes; the Triton W8A8 block
  GEMM (``fp8_gemm``) for more.
- ``triton``: the Triton W8A8 block GEMM for every batch.
- ``scaled_mm``: torch's block-scaled FP8 matmul (cuBLAS, sm90, 128x128 blocks only).
- ``scaled_mm_rowwise``: torch's row-scaled FP8 matmul; the weights are re-quantized at load to
  one scale per output feature (blocks (1, K)), which loses some of the block format's accuracy.
- ``flashinfer``: FlashInfer's ``fp8_blockscale_gemm_sm90`` (bf16 activations quantized inside,
  128x128 blocks, K a multiple of 128; a swap-AB kernel below 32 tokens; JIT-compiled on first use).

``benchmarks/experiments/fp8_gemm.py`` times them against bf16 at decode shapes.
"""

from __future__ import annotations

import os

import torch

from tpserve.quant.fp8 import dequantize_blocks, quantize_blocks

FP8_GEMM_ENV = "TPSERVE_FP8_GEMM"
BACKENDS = ("auto", "triton", "scaled_mm", "scaled_mm_rowwise", "flashinfer")


def backend_from_env() -> str:
    backend = os.environ.get(FP8_GEMM_ENV, "auto")
    if backend not in BACKENDS:
        raise ValueError(f"{FP8_GEMM_ENV}={backend!r}: must be one of {', '.join(BACKENDS)}")
    return backend


def weight_block(backend: str, block: tuple[int, int], in_features: int) -> tuple[int, int]:
    """The blocks the GPU holds the weight in: the checkpoint's, or one row for row scaling."""
    return (1, in_features) if backend == "scaled_mm_rowwise" else block


def prepare_weight(
    backend: str, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    """(weight, scales, block) as ``backend`` reads them: the scales' columns padded to 4 for
    cuBLAS's block scaling, the weight re-quantized per output row for row scaling."""
    from tpserve.kernels.fp8_scaled_mm import SCALED_MM_BLOCK, pad_block_scales

    if backend in ("scaled_mm", "flashinfer") and block != SCALED_MM_BLOCK:
        raise ValueError(f"{FP8_GEMM_ENV}={backend} takes 128x128 weight blocks, this model has {list(block)}")
    if backend == "flashinfer" and weight.shape[1] % SCALED_MM_BLOCK[1]:
        raise ValueError(f"{FP8_GEMM_ENV}=flashinfer takes input features in multiples of 128, got {weight.shape[1]}")
    if backend == "scaled_mm":
        return weight, pad_block_scales(scale_inv), block
    if backend == "scaled_mm_rowwise":
        rows = (1, weight.shape[1])
        if block == rows:
            return weight, scale_inv, block
        w, s = quantize_blocks(dequantize_blocks(weight, scale_inv, block, torch.float32), rows)
        return w, s, rows
    return weight, scale_inv, block


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], backend: str = "auto"
) -> torch.Tensor:
    """x [..., K] @ (FP8 weight [N, K] with block scales).T in x's dtype, by ``backend`` (the
    weight as ``prepare_weight`` left it)."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = _matmul(x2, weight, scale_inv, block, backend)
    return y.view(*x.shape[:-1], n)


def _matmul(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], backend: str) -> torch.Tensor:
    if backend == "scaled_mm":
        from tpserve.kernels.fp8_scaled_mm import scaled_mm_blockwise

        return scaled_mm_blockwise(x, weight, scale_inv)
    if backend == "scaled_mm_rowwise":
        from tpserve.kernels.fp8_scaled_mm import scaled_mm_rowwise

        return scaled_mm_rowwise(x, weight, scale_inv)
    if backend == "flashinfer":
        from flashinfer.gemm import fp8_blockscale_gemm_sm90

        return fp8_blockscale_gemm_sm90(x.contiguous(), weight, None, scale_inv, out_dtype=x.dtype)
    if backend == "auto":
        from tpserve.kernels.fp8_gemv import MAX_TOKENS, fp8_gemv

        if x.shape[0] <= MAX_TOKENS:
            return fp8_gemv(x, weight, scale_inv, block)
    from tpserve.kernels.fp8_gemm import fp8_gemm

    return fp8_gemm(x, weight, scale_inv, block)
