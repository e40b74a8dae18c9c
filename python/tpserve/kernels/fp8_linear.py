"""Which GEMM an FP8 linear layer runs on the GPU, and the weight layout it needs.

``TPSERVE_FP8_GEMM`` (read when a model finishes loading) picks one of:

- ``auto`` (default): where FlashInfer's ``fp8_blockscale_gemm_sm90`` runs (sm90, bf16
  activations, 128x128 blocks, K a multiple of 128; probed once at load, which also JIT-builds
  it before any CUDA graph capture) it takes every batch but one token with K <= 8192, which
  ``fp8_gemv`` takes; elsewhere ``gemv``. Measured on an H200 at Qwen3-8B's shapes
  (docs/benchmarks.md): one decoder layer's four GEMMs 0.62x of bf16 cuBLAS at one token,
  0.70x at 16 and 64.
- ``gemv``: ``fp8_gemv`` (FP8 weights, activations unquantized) up to ``fp8_gemv.MAX_TOKENS``
  tokens, the Triton W8A8 block GEMM (``fp8_gemm``) above.
- ``triton``: the Triton W8A8 block GEMM for every batch.
- ``scaled_mm``: torch's block-scaled FP8 matmul (cuBLAS, sm90, 128x128 blocks only; cuBLAS
  has no kernel for one token, CUBLAS_STATUS_NOT_SUPPORTED, so that takes ``fp8_gemv``).
- ``scaled_mm_rowwise``: torch's row-scaled FP8 matmul; the weights are re-quantized at load to
  one scale per output feature (blocks (1, K)), which loses some of the block format's accuracy.
- ``flashinfer``: FlashInfer's ``fp8_blockscale_gemm_sm90`` for every batch (bf16 activations
  quantized inside, per token and 128 features; a swap-AB kernel below 32 tokens).

``benchmarks/experiments/fp8_gemm.py`` times them against bf16 at decode shapes.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from tpserve.quant.fp8 import dequantize_blocks, quantize_blocks

logger = logging.getLogger(__name__)

FP8_GEMM_ENV = "TPSERVE_FP8_GEMM"
BACKENDS = ("auto", "gemv", "triton", "scaled_mm", "scaled_mm_rowwise", "flashinfer")
# ``auto`` resolved where FlashInfer's GEMM runs: it, but fp8_gemv for one token up to this K
GEMV_FLASHINFER = "gemv+flashinfer"
GEMV_MAX_K = 8192


def backend_from_env() -> str:
    backend = os.environ.get(FP8_GEMM_ENV, "auto")
    if backend not in BACKENDS:
        raise ValueError(f"{FP8_GEMM_ENV}={backend!r}: must be one of {', '.join(BACKENDS)}")
    return backend


@functools.cache
def _flashinfer_runs(device_index: int) -> bool:
    """FlashInfer's sm90 block-scaled GEMM loads (JIT-built on first use) and runs on this GPU."""
    device = torch.device("cuda", device_index)
    if torch.cuda.get_device_capability(device) != (9, 0):
        return False
    try:
        from flashinfer.gemm import fp8_blockscale_gemm_sm90

        w = torch.zeros(128, 128, dtype=torch.float8_e4m3fn, device=device)
        x = torch.zeros(16, 128, dtype=torch.bfloat16, device=device)
        fp8_blockscale_gemm_sm90(x, w, None, torch.ones(1, 1, device=device), out_dtype=torch.bfloat16)
        torch.cuda.synchronize(device)
        return True
    except Exception as exc:  # noqa: BLE001 -- missing, not built for this GPU: the Triton GEMMs
        logger.warning("FlashInfer's FP8 GEMM unavailable (%s: %s); FP8 layers use fp8_gemv", type(exc).__name__, exc)
        return False


def resolve_backend(
    backend: str, device: torch.device, dtype: torch.dtype, block: tuple[int, int], in_features: int
) -> str:
    """``auto`` made concrete for a layer on ``device`` computing in ``dtype``; others as given."""
    if backend != "auto":
        return backend
    if device.type != "cuda":  # Triton's CPU interpreter (the tests)
        return "gemv"
    fits = dtype == torch.bfloat16 and block == (128, 128) and in_features % 128 == 0
    return GEMV_FLASHINFER if fits and _flashinfer_runs(device.index or 0) else "gemv"


def kernel_for(backend: str, m: int, k: int) -> str:
    """The kernel a resolved ``backend`` runs for ``m`` tokens of ``k`` input features: gemv,
    w8a8, scaled_mm, rowwise or flashinfer."""
    from tpserve.kernels.fp8_gemv import MAX_TOKENS

    if backend == GEMV_FLASHINFER:
        return "gemv" if m == 1 and k <= GEMV_MAX_K else "flashinfer"
    if backend == "gemv":
        return "gemv" if m <= MAX_TOKENS else "w8a8"
    if backend == "scaled_mm" and m == 1:  # cuBLAS's block scaling has no single-token kernel
        return "gemv"
    return {"triton": "w8a8", "scaled_mm": "scaled_mm", "scaled_mm_rowwise": "rowwise", "flashinfer": "flashinfer"}[backend]


def weight_block(backend: str, block: tuple[int, int], in_features: int) -> tuple[int, int]:
    """The blocks the GPU holds the weight in: the checkpoint's, or one row for row scaling."""
    return (1, in_features) if backend == "scaled_mm_rowwise" else block


def prepare_weight(
    backend: str, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    """(weight, scales, block) as ``backend`` reads them: the scales' columns padded to 4 for
    cuBLAS's block scaling, the weight re-quantized per output row for row scaling."""
    from tpserve.kernels.fp8_scaled_mm import SCALED_MM_BLOCK, pad_block_scales

    if backend in ("scaled_mm", "flashinfer", GEMV_FLASHINFER) and block != SCALED_MM_BLOCK:
        raise ValueError(f"{FP8_GEMM_ENV}={backend} takes 128x128 weight blocks, this model has {list(block)}")
    if backend in ("flashinfer", GEMV_FLASHINFER) and weight.shape[1] % SCALED_MM_BLOCK[1]:
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
    backend = resolve_backend(backend, x.device, x.dtype, block, k)
    y = _matmul(x2, weight, scale_inv, block, backend)
    return y.view(*x.shape[:-1], n)


def _matmul(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], backend: str) -> torch.Tensor:
    kernel = kernel_for(backend, x.shape[0], x.shape[1])
    if kernel == "gemv":
        from tpserve.kernels.fp8_gemv import fp8_gemv

        return fp8_gemv(x, weight, scale_inv, block)
    if kernel == "flashinfer":
        from flashinfer.gemm import fp8_blockscale_gemm_sm90

        return fp8_blockscale_gemm_sm90(x.contiguous(), weight, None, scale_inv, out_dtype=x.dtype)
    if kernel == "scaled_mm":
        from tpserve.kernels.fp8_scaled_mm import scaled_mm_blockwise

        return scaled_mm_blockwise(x, weight, scale_inv)
    if kernel == "rowwise":
        from tpserve.kernels.fp8_scaled_mm import scaled_mm_rowwise

        return scaled_mm_rowwise(x, weight, scale_inv)
    from tpserve.kernels.fp8_gemm import fp8_gemm

    return fp8_gemm(x, weight, scale_inv, block)
