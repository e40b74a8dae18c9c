"""Which GEMM an FP8 linear layer runs on the GPU, and the weight layout it needs.

``TPSERVE_FP8_GEMM`` (read when a model finishes loading) picks one of:

- ``auto`` (default): ``cuda`` where it runs (FlashInfer's GEMM and the CUDA GEMV both build and
  run: probed once at load, before any CUDA graph capture), else ``flashinfer`` where that runs
  (sm90, bf16 activations, 128x128 blocks, K a multiple of 128), else ``gemv``.
- ``gemv``: ``fp8_gemv`` (FP8 weights, activations unquantized) up to ``fp8_gemv.MAX_TOKENS``
  tokens, the Triton W8A8 block GEMM (``fp8_gemm``) above.
- ``triton``: the Triton W8A8 block GEMM for every batch.
- ``flashinfer``: FlashInfer's ``fp8_blockscale_gemm_sm90`` for every batch (bf16 activations
  quantized inside, per token and 128 features; a swap-AB kernel below 32 tokens).
- ``cuda``: the CUDA GEMV (``kernels.gemv``, activations unquantized) up to ``CUDA_GEMV_TOKENS``
  tokens, FlashInfer's GEMM above (bf16 activations, 128x128 blocks, K a multiple of 128). It
  does not fuse SiLU-and-mul.

(torch's scaled matmuls, block- and row-scaled, were measured slower than these at every
Qwen3-8B shape and removed: docs/benchmarks.md, FP8.)

``benchmarks/experiments/fp8_gemm.py`` times them against bf16 at decode shapes.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

logger = logging.getLogger(__name__)

FP8_GEMM_ENV = "TPSERVE_FP8_GEMM"
BACKENDS = ("auto", "gemv", "triton", "flashinfer", "cuda")
# the FlashInfer GEMM (128x128 blocks, K in multiples of 128) at some batch sizes
FLASHINFER_BACKENDS = ("flashinfer", "cuda")
# Measured on an H200 (fp8_gemm.py, docs/benchmarks.md, FP8): a decoder layer's four GEMMs
# against bf16 cuBLAS, Qwen3-8B / Qwen3-32B: CUDA GEMV 0.56x / 0.53x at 1 token, 0.71x / 0.61x at
# 2; FlashInfer's GEMM 0.67x / 0.56x at 1, 0.71x / 0.58x at 2 (0.70x at 4, the GEMV 0.85x).
CUDA_GEMV_TOKENS = 1
FLASHINFER_BLOCK = (128, 128)


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
    """``auto`` made concrete for a layer on ``device`` computing in ``dtype``; others as given
    (``cuda`` checked: its GEMV built and run once here, before any CUDA graph capture)."""
    if backend == "cuda" and device.type == "cuda":
        from tpserve.kernels.gemv import probe

        failure = probe(device.index or 0) if dtype == torch.bfloat16 else f"activations are {dtype}, not bf16"
        if failure is None and not _flashinfer_runs(device.index or 0):
            failure = "FlashInfer's GEMM, which takes the larger batches, does not run"
        if failure is not None:
            raise RuntimeError(f"{FP8_GEMM_ENV}=cuda does not run here ({failure})")
    if backend != "auto":
        return backend
    if device.type != "cuda":  # Triton's CPU interpreter (the tests)
        return "gemv"
    fits = dtype == torch.bfloat16 and block == FLASHINFER_BLOCK and in_features % FLASHINFER_BLOCK[1] == 0
    if not (fits and _flashinfer_runs(device.index or 0)):
        return "gemv"
    from tpserve.kernels.gemv import probe

    return "cuda" if probe(device.index or 0) is None else "flashinfer"


def kernel_for(backend: str, m: int) -> str:
    """The kernel a resolved ``backend`` runs for ``m`` tokens: gemv, cuda (the CUDA GEMV), w8a8
    or flashinfer."""
    from tpserve.kernels.fp8_gemv import MAX_TOKENS

    if backend == "cuda":
        return "cuda" if m <= CUDA_GEMV_TOKENS else "flashinfer"
    if backend == "gemv":
        return "gemv" if m <= MAX_TOKENS else "w8a8"
    return {"triton": "w8a8", "flashinfer": "flashinfer"}[backend]


def fuses_gate(backend: str, m: int) -> bool:
    """Whether a resolved ``backend`` takes ``gated=True`` at ``m`` tokens: the GEMV computes
    SwiGLU's silu(gate) * up in its activation loads (one kernel less per MLP at decode)."""
    return kernel_for(backend, m) == "gemv"


def check_weight_block(backend: str, block: tuple[int, int], in_features: int) -> None:
    """FlashInfer's GEMM reads 128x128 blocks and K in multiples of 128; the Triton ones any."""
    if backend in FLASHINFER_BACKENDS and block != FLASHINFER_BLOCK:
        raise ValueError(f"{FP8_GEMM_ENV}={backend} takes 128x128 weight blocks, this model has {list(block)}")
    if backend in FLASHINFER_BACKENDS and in_features % FLASHINFER_BLOCK[1]:
        raise ValueError(f"{FP8_GEMM_ENV}={backend} takes input features in multiples of 128, got {in_features}")


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], backend: str = "auto",
    gated: bool = False,
) -> torch.Tensor:
    """x [..., K] @ (FP8 weight [N, K] with block scales).T in x's dtype, by ``backend``.
    ``gated`` (where ``fuses_gate``): x is [..., 2K], [gate | up], and the input silu(gate) * up."""
    n, k = weight.shape
    x2 = x.reshape(-1, 2 * k if gated else k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    backend = resolve_backend(backend, x.device, x.dtype, block, k)
    if gated and not fuses_gate(backend, x2.shape[0]):
        raise ValueError(f"FP8 GEMM {backend} does not fuse SiLU-and-mul at {x2.shape[0]} tokens")
    y = _matmul(x2, weight, scale_inv, block, backend, gated)
    return y.view(*x.shape[:-1], n)


def _matmul(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], backend: str, gated: bool
) -> torch.Tensor:
    kernel = kernel_for(backend, x.shape[0])
    if kernel == "cuda":
        from tpserve.kernels.gemv import gemv

        return gemv(x, weight, scale_inv)
    if kernel == "gemv":
        from tpserve.kernels.fp8_gemv import fp8_gemv

        return fp8_gemv(x, weight, scale_inv, block, gated=gated)
    if kernel == "flashinfer":
        from flashinfer.gemm import fp8_blockscale_gemm_sm90

        return fp8_blockscale_gemm_sm90(x.contiguous(), weight, None, scale_inv, out_dtype=x.dtype)
    from tpserve.kernels.fp8_gemm import fp8_gemm

    return fp8_gemm(x, weight, scale_inv, block)
