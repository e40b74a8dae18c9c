"""FP8-weight GEMM for few tokens (decode): y = x @ (w * scale).T with x left in its dtype.

At decode a step's linears are bound by the bytes of their weights, so reading the FP8 weight
is what pays; quantizing the activations too (``fp8_gemm``) only adds a kernel and error. Each
program takes ``BLOCK_N`` output features over one K split; per K tile (inside one scale group)
it converts the FP8 tile to the activations' dtype (exact) and accumulates the tile's product
times its block scale in float32: a reduction over K on CUDA cores for one token
(``DOT=False``), a tensor-core dot for more. ``SPLIT_K > 1`` writes float32 partial sums that
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
    block_m: int  # tokens per program (1: the CUDA-core reduction, no dot)
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_xm, stride_s, stride_split, tiles_per_split,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr, INTERPRETED: tl.constexpr,
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
    if DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k_ok = (k0 + ks) < K
        w = tl.load(w_rows + (k0 + ks)[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        scale = tl.load(s_rows + k0 // GROUP_K, mask=col_ok, other=0.0)
        if DOT:
            x = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            # through float32: exact, and Triton's CPU interpreter has no direct fp8 -> bf16
            w = tl.trans(w.to(tl.float32).to(x.dtype))
            if INTERPRETED:  # the interpreter's bf16 dot is wrong; float32 gives the same sums
                part = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            elif IEEE:
                part = tl.dot(x, w, input_precision="ieee")
            else:
                part = tl.dot(x, w)
            acc += part * scale[None, :]
        else:
            x = tl.load(x_ptr + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1) * scale
    if DOT:
        out = out_ptr + pid_k * stride_split + rows[:, None] * N + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    else:
        tl.store(out_ptr + pid_k * stride_split + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


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
    """Enough programs for two per SM: the widest output tile that still gives them, then K
    splits if even 16 features per program do not. (First guesses; the benchmark sweeps them.)"""
    block_m = 1 if m == 1 else 16 if m <= 16 else 32 if m <= 32 else 64
    block_k = k_tile(group_k)
    target = 2 * sm_count
    m_tiles = triton.cdiv(m, block_m)
    block_n = next((b for b in (64, 32) if triton.cdiv(n, b) * m_tiles >= target), 16)
    programs = triton.cdiv(n, block_n) * m_tiles
    k_tiles = triton.cdiv(k, block_k)
    split_k = 1
    while programs * split_k < target and k_tiles // (split_k * 2) >= 8:
        split_k *= 2
    return GemvConfig(block_m, block_n, block_k, split_k, num_warps=4, num_stages=4)


def fp8_gemv(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int],
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32, unit stride along K) @ (weight * block scales).T -> [M, N] in
    x's dtype. ``scale_inv`` [ceil(N / bn), >= ceil(K / bk)] (its row stride is read)."""
    m, k = x.shape
    n = weight.shape[0]
    if config is None:
        index = x.device.index if x.device.type == "cuda" else 0
        sm_count = _sm_count(index) if x.device.type == "cuda" else 132
        config = default_config(m, n, k, block_size[1], sm_count)
    if block_size[1] % config.block_k:
        raise ValueError(f"K tile {config.block_k} does not divide the scale group {block_size[1]}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    dot = config.block_m > 1
    if not dot and m != 1:
        raise ValueError(f"block_m 1 (the reduction without a dot) takes one token, got {m}")
    k_tiles = triton.cdiv(k, config.block_k)
    tiles_per_split = triton.cdiv(k_tiles, config.split_k)
    splits = triton.cdiv(k_tiles, tiles_per_split)
    target = out if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m), splits)
    _gemv_kernel[grid](
        x, weight, scale_inv, target, m, n, k, x.stride(0), scale_inv.stride(0), m * n, tiles_per_split,
        GROUP_N=block_size[0], GROUP_K=block_size[1], BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, DOT=dot, IEEE=x.dtype == torch.float32, INTERPRETED=_INTERPRETED,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if splits > 1:
        out.copy_(target.sum(dim=0))
    return out
