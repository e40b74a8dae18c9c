"""Which GEMM an FP8 linear layer runs on the GPU, picked by ``TPSERVE_FP8_GEMM`` (read at load).

- ``triton``: the Triton W8A8 GEMM (``fp8_gemm``; a scale a row: ``fp8_gemm_rowwise``) at every batch; any block size.
- ``flashinfer``: FlashInfer's ``fp8_blockscale_gemm_sm90`` at every batch (sm90; bf16 activations
  quantized inside per token and 128 features; 128x128 blocks, K % 128 == 0; swap-AB below 32 tokens).
- ``cuda`` / ``cuda_triton``: the CUDA GEMV (``kernels.gemv``; bf16 activations, unquantized; 128x128
  blocks, ``cuda_triton`` also a scale a row, K % 16 == 0) up to ``CUDA_GEMV_TOKENS`` tokens, FlashInfer's / the
  Triton GEMM above.
- ``auto`` (default): per layer, probed at load before CUDA graph capture, the first that runs of
  ``cuda``, ``flashinfer``, ``cuda_triton``, ``triton`` (a scale a row: ``cuda_triton``, ``triton``); ``triton`` on
  the CPU (the interpreter).

Measured slower and removed (docs/benchmarks.md, FP8; benchmarks/experiments/fp8_gemm.py): torch's
block-scaled matmul and, for 128x128 blocks, its row-scaled one (every Qwen3-8B shape; weights scaled per row
take it above 64 tokens: ``fp8_gemm.fp8_gemm_rowwise``); a Triton weight-only GEMV (vs the CUDA GEMV at one token,
every Qwen3 shape).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from tpserve.kernels import gemv

logger = logging.getLogger(__name__)

FP8_GEMM_ENV = "TPSERVE_FP8_GEMM"
BACKENDS = ("auto", "triton", "flashinfer", "cuda", "cuda_triton")
# The GEMM each resolved backend runs above CUDA_GEMV_TOKENS (at every batch for those without the GEMV).
_LARGE_KERNEL = {"triton": "w8a8", "flashinfer": "flashinfer", "cuda": "flashinfer", "cuda_triton": "w8a8"}
GEMV_BACKENDS = ("cuda", "cuda_triton")
# Measured on an H200 (fp8_gemm.py, docs/benchmarks.md, FP8): a decoder layer's four GEMMs
# against bf16 cuBLAS, Qwen3-8B / Qwen3-32B: CUDA GEMV 0.56x / 0.53x at 1 token, 0.71x / 0.61x at
# 2; FlashInfer's GEMM 0.67x / 0.56x at 1, 0.71x / 0.58x at 2 (0.70x at 4, the GEMV 0.85x).
CUDA_GEMV_TOKENS = 1
FLASHINFER_BLOCK = (128, 128)  # also the CUDA GEMV's scale blocks
GEMV_K_MULTIPLE = 16  # the CUDA GEMV reads FP8 rows in 16-byte loads
_K_MULTIPLE = {"flashinfer": FLASHINFER_BLOCK[1], "cuda": FLASHINFER_BLOCK[1], "cuda_triton": GEMV_K_MULTIPLE}


def backend_from_env() -> str:
    backend = os.environ.get(FP8_GEMM_ENV, "auto")
    if backend not in BACKENDS:
        raise ValueError(f"{FP8_GEMM_ENV}={backend!r}: must be one of {', '.join(BACKENDS)}")
    return backend


@functools.cache
def flashinfer_runs(device_index: int) -> bool:
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
    except Exception as exc:  # noqa: BLE001 -- missing, not built for this GPU: the CUDA GEMV and Triton's GEMM
        logger.warning("FlashInfer's FP8 GEMM unavailable (%s: %s); FP8 layers use the CUDA GEMV or Triton's GEMM",
                       type(exc).__name__, exc)
        return False


def resolve_backend(
    backend: str, device: torch.device, dtype: torch.dtype, block: tuple[int, int], in_features: int,
    row_scales: bool = False,
) -> str:
    """``auto`` made concrete for a layer; ``cuda`` and ``cuda_triton`` checked (the GEMV built and
    run once here, before any CUDA graph capture). ``row_scales``: the weight has one scale a row (held as [N, 1]),
    which the GEMV reads at one token and Triton's GEMM above (``cuda_triton``)."""
    if device.type != "cuda":  # Triton's CPU interpreter (the tests)
        return "triton" if backend == "auto" else backend
    index = device.index or 0
    if backend in GEMV_BACKENDS:
        failure = gemv.probe(index) if dtype == torch.bfloat16 else f"activations are {dtype}, not bf16"
        if failure is None and backend == "cuda" and not flashinfer_runs(index):
            failure = "FlashInfer's GEMM, which takes the larger batches, does not run"
        if failure is not None:
            raise RuntimeError(f"{FP8_GEMM_ENV}={backend} does not run here ({failure})")
    if backend == "flashinfer":  # its sm90 block-scale GEMM takes bf16 activations and 128 x 128 blocks only
        failure = (f"activations are {dtype}, not bf16" if dtype != torch.bfloat16
                   else f"weight blocks are {block}, not {FLASHINFER_BLOCK}" if block != FLASHINFER_BLOCK
                   else None if flashinfer_runs(index) else "FlashInfer's FP8 GEMM does not run on this GPU")
        if failure is not None:
            raise RuntimeError(f"{FP8_GEMM_ENV}=flashinfer does not run here ({failure})")
    if backend != "auto":
        return backend
    if row_scales and dtype == torch.bfloat16 and in_features % GEMV_K_MULTIPLE == 0 and gemv.probe_rows(index) is None:
        return "cuda_triton"
    if dtype != torch.bfloat16 or block != FLASHINFER_BLOCK:
        return "triton"
    flashinfer = in_features % FLASHINFER_BLOCK[1] == 0 and flashinfer_runs(index)
    cuda_gemv = in_features % GEMV_K_MULTIPLE == 0 and gemv.probe(index) is None
    if flashinfer:
        return "cuda" if cuda_gemv else "flashinfer"
    return "cuda_triton" if cuda_gemv else "triton"


def kernel_for(backend: str, m: int) -> str:
    """The kernel a resolved ``backend`` runs for ``m`` tokens: cuda (GEMV), w8a8 or flashinfer."""
    if backend in GEMV_BACKENDS and m <= CUDA_GEMV_TOKENS:
        return "cuda"
    return _LARGE_KERNEL[backend]


def check_weight_block(backend: str, block: tuple[int, int], in_features: int, row_scales: bool = False) -> None:
    """Raise unless ``backend`` reads this layout: 128x128 blocks (``cuda_triton``: or a scale a row), K per
    ``_K_MULTIPLE`` (Triton: any)."""
    multiple = _K_MULTIPLE.get(backend)
    if multiple is None:
        return
    if block != FLASHINFER_BLOCK and not (row_scales and backend == "cuda_triton"):
        raise ValueError(f"{FP8_GEMM_ENV}={backend} takes 128x128 weight blocks, this model has {list(block)}")
    if in_features % multiple:
        raise ValueError(f"{FP8_GEMM_ENV}={backend} takes input features in multiples of {multiple}, got {in_features}")


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], backend: str = "auto",
    row_scales: bool = False,
) -> torch.Tensor:
    """x [..., K] @ (FP8 weight [N, K] with block scales).T in x's dtype, by ``backend`` (``row_scales``: as
    ``resolve_backend``'s)."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    backend = resolve_backend(backend, x.device, x.dtype, block, k, row_scales)
    kernel = kernel_for(backend, x2.shape[0])
    if kernel == "cuda":
        y = gemv.gemv(x2, weight, scale_inv, row_scales=row_scales)
    elif kernel == "flashinfer":
        from flashinfer.gemm import fp8_blockscale_gemm_sm90

        y = fp8_blockscale_gemm_sm90(x2.contiguous(), weight, None, scale_inv, out_dtype=x.dtype)
    elif row_scales:
        from tpserve.kernels.fp8_gemm import fp8_gemm_rowwise

        y = fp8_gemm_rowwise(x2, weight, scale_inv)
    else:
        from tpserve.kernels.fp8_gemm import fp8_gemm

        y = fp8_gemm(x2, weight, scale_inv, block)
    return y.view(*x.shape[:-1], n)


def warm_up_sizes(max_tokens: int) -> list[int]:
    """Row counts reaching every tile FlashInfer's FP8 GEMM picks up to ``max_tokens``: DeepGEMM compiles
    per (N, K, tile), set by rows only via the swap-AB cut (32), the 64-row tile and 128-row tile count."""
    return sorted({2, 32, 64, *range(128, max(max_tokens, 0) + 128, 128)})


def compiles_at_run_time(layer: torch.nn.Module) -> bool:
    """Whether a ParallelLinear runs FlashInfer's FP8 GEMM (compiled on first use) at some batch."""
    return getattr(layer, "weight_scale_inv", None) is not None and _LARGE_KERNEL.get(layer.fp8_backend) == "flashinfer"


def warm_up(layers: list[torch.nn.Module], max_tokens: int, show_progress: bool = False) -> int:
    """Run FlashInfer's FP8 GEMM of each weight shape at ``warm_up_sizes`` rows so DeepGEMM's JIT
    (disk-cached) compiles at startup, not under load; returns the number of GEMMs run."""
    from tqdm import tqdm

    shapes = {}
    for layer in layers:
        if compiles_at_run_time(layer):
            shapes.setdefault(tuple(layer.weight.shape), layer)
    sizes = [m for m in warm_up_sizes(max_tokens) if m > CUDA_GEMV_TOKENS]
    # The bar also tells the user why startup pauses: a machine's first launch compiles for minutes.
    with tqdm(total=len(shapes) * len(sizes), desc="FP8 GEMM warm-up", unit="GEMM",
              disable=not (show_progress and shapes)) as bar:
        for layer in shapes.values():
            x = torch.zeros(max(sizes, default=1), layer.weight.shape[1], dtype=torch.bfloat16, device=layer.weight.device)
            for m in sizes:
                fp8_linear(x[:m], layer.weight, layer.weight_scale_inv, layer.block_size, layer.fp8_backend)
                bar.update()
    return len(shapes) * len(sizes)
