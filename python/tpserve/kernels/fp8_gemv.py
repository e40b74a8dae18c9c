"""FP8-weight GEMM for few tokens (decode): y = x @ (w * scale).T with x left in its dtype.

At decode a step's linears are bound by the bytes of their weights, so reading the FP8 weight
is what pays; quantizing the activations too (``fp8_gemm``) only adds a kernel and error. Each
program takes ``BLOCK_N`` output features over one K split; per K tile (inside one scale group)
it converts the FP8 tile to the activations' dtype (exact) and accumulates the tile's product
times its block scale in float32: a reduction over K on CUDA cores for one token
(``variant="fma"``), a tensor-core dot for more (swap-AB by default: the weight tile is the MMA's
wide side). ``SPLIT_K > 1`` writes float32 partial sums that
a second pass adds, for layers with too few output features to fill the GPU. The torch
reference is ``tpserve.quant.fp8.weight_only_reference``. No host synchronisation: CUDA graphs
can hold it.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# The GEMV is meant for decode batches; above this many tokens the W8A8 GEMM takes over.
MAX_TOKENS = 64


@dataclass(frozen=True)
class GemvConfig:
    block_m: int  # tokens per program (1 with "fma")
    block_n: int
    block_k: int  # "fma": any power of two (several scale groups per tile); dots: inside one group
    split_k: int
    num_warps: int
    num_stages: int
    # "fma": float32 products reduced on CUDA cores (one token); "dot": x [BM, BK] @ w^T;
    # "dot_t": swap-AB, w [BN, BK] @ x^T, so the weight tile is the MMA's wide side.
    variant: str = "fma"


_VARIANTS = {"fma": 0, "dot": 1, "dot_t": 2}


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_xm, stride_s, stride_split, tiles_per_split, k_groups,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, VARIANT: tl.constexpr, IEEE: tl.constexpr, INTERPRETED: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    col_ok, row_ok = cols < N, rows < M
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * K
    s_rows = s_ptr + (cols // GROUP_N) * stride_s
    k_begin = pid_k * tiles_per_split * BLOCK_K
    k_end = tl.minimum(K, k_begin + tiles_per_split * BLOCK_K)
    if VARIANT == 0:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    elif VARIANT == 1:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k_ok = (k0 + ks) < K
        w = tl.load(w_rows + (k0 + ks)[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if VARIANT == 0:
            x = tl.load(x_ptr + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
            prod = w.to(tl.float32) * x[None, :]
            if BLOCK_K <= GROUP_K:
                scale = tl.load(s_rows + k0 // GROUP_K, mask=col_ok, other=0.0)
                acc += tl.sum(prod, axis=1) * scale
            else:  # several scale groups in the tile
                groups = k0 // GROUP_K + tl.arange(0, BLOCK_K // GROUP_K)
                scale = tl.load(s_rows[:, None] + groups[None, :], mask=col_ok[:, None] & (groups < k_groups)[None, :], other=0.0)
                part = tl.sum(tl.reshape(prod, (BLOCK_N, BLOCK_K // GROUP_K, GROUP_K)), axis=2)
                acc += tl.sum(part * scale, axis=1)
        else:
            scale = tl.load(s_rows + k0 // GROUP_K, mask=col_ok, other=0.0)
            x = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            # through float32: exact, and Triton's CPU interpreter has no direct fp8 -> bf16
            w = w.to(tl.float32).to(x.dtype)
            if INTERPRETED:  # the interpreter's bf16 dot is wrong; float32 gives the same sums
                x, w = x.to(tl.float32), w.to(tl.float32)
            if VARIANT == 1:
                if IEEE or INTERPRETED:
                    part = tl.dot(x, tl.trans(w), input_precision="ieee")
                else:
                    part = tl.dot(x, tl.trans(w))
                acc += part * scale[None, :]
            else:
                if IEEE or INTERPRETED:
                    part = tl.dot(w, tl.trans(x), input_precision="ieee")
                else:
                    part = tl.dot(w, tl.trans(x))
                acc += part * scale[:, None]
    out = out_ptr + pid_k * stride_split
    if VARIANT == 0:
        tl.store(out + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)
    elif VARIANT == 1:
        tl.store(out + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    else:
        tl.store(out + rows[None, :] * N + cols[:, None], acc.to(out_ptr.dtype.element_ty), mask=col_ok[:, None] & row_ok[None, :])


def k_tile(group_k: int, limit: int = 128) -> int:
    """The largest power of two up to ``limit`` dividing ``group_k`` (so a K tile never spans two
    scale groups), at least 16 (callers check 16 divides it: ``kernels.use_fp8_gemm``)."""
    tile = 16
    while tile < limit and group_k % (tile * 2) == 0:
        tile *= 2
    return tile


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def default_config(m: int, n: int, k: int, group_k: int, sm_count: int) -> GemvConfig:
    """From the sweep of ``benchmarks/experiments/fp8_gemm.py`` on an H200 at Qwen3-8B's shapes
    (docs/results/2026-12-01-h200-session4/fp8_gemm.json): one token reads 512-wide K tiles of 8
    features with 2 warps (16 x 256 with 4 warps for the widest layers); more tokens take swap-AB
    dots over 32-feature tiles (64 where that still gives two programs per SM), K split in two for
    long K. Each program re-reads x from L2, 2 * M / BLOCK_N times its weight bytes, so wider
    tiles for more tokens."""
    pow2_group = group_k & (group_k - 1) == 0
    if m == 1:
        wide = n >= 16384
        block_k = (256 if wide else 512) if pow2_group and group_k <= 512 and k >= 512 else k_tile(group_k)
        return GemvConfig(1, 16 if wide else 8, block_k, 1, num_warps=4 if wide else 2, num_stages=4, variant="fma")
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    m_tiles = triton.cdiv(m, block_m)
    min_n = 32 if m <= 32 else 64
    block_n = 64 if triton.cdiv(n, 64) * m_tiles >= 2 * sm_count else min_n
    split_k = 2 if k >= 8192 else 1
    return GemvConfig(block_m, block_n, k_tile(group_k), split_k, num_warps=4, num_stages=6 if split_k > 1 else 4, variant="dot_t")


def check_config(config: GemvConfig, m: int, group_k: int) -> None:
    if config.variant not in _VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(_VARIANTS)}, got {config.variant!r}")
    if config.variant == "fma":
        if m != 1 or config.block_m != 1:
            raise ValueError(f"variant fma takes one token (block_m 1), got {m} tokens, block_m {config.block_m}")
        if config.block_k > group_k and (config.block_k % group_k or group_k & (group_k - 1)):
            raise ValueError(f"K tile {config.block_k} must be a multiple of the power-of-two scale group, got {group_k}")
    elif group_k % config.block_k or config.block_m < 16:
        raise ValueError(f"dots take K tiles dividing the scale group {group_k} and block_m >= 16, got {config}")


def fp8_gemv(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int],
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32, unit stride along K) @ (weight * block scales).T -> [M, N] in
    x's dtype. ``scale_inv`` [ceil(N / bn), >= ceil(K / bk)] (its row stride is read)."""
    m, k = x.shape
    n = weight.shape[0]
    if config is None:
        sm_count = _sm_count(x.device.index or 0) if x.device.type == "cuda" else 132
        config = default_config(m, n, k, block_size[1], sm_count)
    check_config(config, m, block_size[1])
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    k_tiles = triton.cdiv(k, config.block_k)
    tiles_per_split = triton.cdiv(k_tiles, config.split_k)
    splits = triton.cdiv(k_tiles, tiles_per_split)
    target = out if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m), splits)
    _gemv_kernel[grid](
        x, weight, scale_inv, target, m, n, k, x.stride(0), scale_inv.stride(0), m * n, tiles_per_split,
        triton.cdiv(k, block_size[1]),
        GROUP_N=block_size[0], GROUP_K=block_size[1], BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, VARIANT=_VARIANTS[config.variant], IEEE=x.dtype == torch.float32,
        INTERPRETED=_INTERPRETED, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if splits > 1:
        out.copy_(target.sum(dim=0))
    return out
