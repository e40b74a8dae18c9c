"""Triton FP8 GEMMs, y = x @ w.T, w e4m3 [N, K], no host sync (CUDA-graph safe):

- ``fp8_gemm``: block scales ``scale_inv`` [ceil(N / bn), >= ceil(K / bk)] (checkpoint layout; row stride
  read); x quantized to e4m3 per token and bk features, float32 sums of FP8 dots times both tiles' scales.
- ``fp8_gemm_rowwise``: a scale per weight row (compressed-tensors' per-channel and per-tensor checkpoints, held
  as [N, 1]); x quantized per token over all of K, so the
  K loop is FP8 dots alone and both scales multiply the float32 sums once, in the epilogue. Above
  ``ROWWISE_MAX_TOKENS`` the same product goes to torch's ``_scaled_mm`` with row-wise scales (cuBLASLt / CUTLASS)
  where it runs. Qwen3-8B's four linears against bf16 cuBLAS (H100, session 45, fp8_rowwise_gemm.py): this kernel
  0.62x / 0.66x / 0.66x / 0.71x / 0.99x / 1.93x at 2 / 8 / 32 / 64 / 128 / 512 tokens (0.63x / 0.76x at 32 / 64 with
  its accumulator promoted, below), ``_scaled_mm`` 0.90x / 0.88x / 0.84x / 0.78x / 0.77x / 0.74x, the block GEMM
  above reading the row scales as (1, 128) blocks 0.91x-1.77x. ``_scaled_mm`` reads the held [N, 1] as its [1, N].

References: ``quant.fp8.fp8_linear_reference`` (block (1, K) for the row-wise one), also checked in Triton's
interpreter (tests/kernels/interpreter_checks.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tpserve.quant.fp8 import FP8_DTYPE, FP8_MAX, num_blocks

_MIN_AMAX = 1e-10


def k_tile(group_k: int) -> int:
    """The largest power of two in [16, 128] dividing ``group_k``: a K tile never spans two scale
    groups (``use_fp8_gemm`` checks 16 divides it)."""
    tile = 16
    while tile < 128 and group_k % (tile * 2) == 0:
        tile *= 2
    return tile


@triton.jit
def _quantize_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_x, stride_sm, stride_sg,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr,
):
    row = tl.program_id(0)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, BLOCK)
    mask = (tl.arange(0, BLOCK) < GROUP) & (cols < K)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), MIN_AMAX) / FP8_MAX
    q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + row * K + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + group * stride_sg, scale)


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [M, K], float32 scale_inv [M, ceil(K / group)]) of a 2-D x."""
    m, k = x.shape
    groups = num_blocks(k, group)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        _quantize_kernel[(m, groups)](
            x, q, scale, k, x.stride(0), scale.stride(0), scale.stride(1),
            GROUP=group, BLOCK=triton.next_power_of_2(group), FP8_MAX=FP8_MAX, MIN_AMAX=_MIN_AMAX,
        )
    return q, scale


@triton.jit
def _tile(pid_m, pid_n, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A program's rows of x and of the weight (output columns), and which of them exist."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, cols, rows < M, cols < N


@triton.jit
def _store_tile(c_ptr, out, rows, cols, row_ok, col_ok, N):
    mask = row_ok[:, None] & col_ok[None, :]
    tl.store(c_ptr + rows[:, None] * N + cols[None, :], out.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _k_tiles(a_ptr, b_ptr, rows, cols, row_ok, col_ok, k0, K, BLOCK_K: tl.constexpr):
    """The K step from ``k0`` of x's rows [BLOCK_M, BLOCK_K] and of the weight's rows as [BLOCK_K, BLOCK_N] (both
    row-major along K), 0 past M, N and K."""
    ks = k0 + tl.arange(0, BLOCK_K)
    k_ok = ks < K
    a = tl.load(a_ptr + rows[:, None] * K + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    b = tl.load(b_ptr + cols[None, :] * K + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
    return a, b


@triton.jit
def _gemm_kernel(
    a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, M, N, K, a_groups, b_groups,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows, cols, row_ok, col_ok = _tile(tl.program_id(0), tl.program_id(1), M, N, BLOCK_M, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a, b = _k_tiles(a_ptr, b_ptr, rows, cols, row_ok, col_ok, k0, K, BLOCK_K)
        group = k0 // GROUP_K
        a_scale = tl.load(a_scale_ptr + rows * a_groups + group, mask=row_ok, other=0.0)
        b_scale = tl.load(b_scale_ptr + (cols // GROUP_N) * b_groups + group, mask=col_ok, other=0.0)
        if BLOCK_K < 32:  # FP8 dots need K >= 32; e4m3 -> fp16 is exact
            part = tl.dot(a.to(tl.float16), b.to(tl.float16))
        else:
            part = tl.dot(a, b)
        acc += part * a_scale[:, None] * b_scale[None, :]
    _store_tile(c_ptr, acc, rows, cols, row_ok, col_ok, N)


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int]) -> torch.Tensor:
    """x [M, K] (unit stride along K) @ weight [N, K] (e4m3, block scales).T in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        a, a_scale = quantize_activations(x, block_size[1])
        block_m = 16 if m <= 16 else 64
        block_n = 64 if m <= 16 else 128
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _gemm_kernel[grid](
            a, weight, out, a_scale, scale_inv, m, n, k, a_scale.stride(0), scale_inv.stride(0),
            GROUP_N=block_size[0], GROUP_K=block_size[1], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=k_tile(block_size[1]),
        )
    return out


ROWWISE_MAX_TOKENS = 64


@dataclass(frozen=True)
class RowwiseTiles:
    block_m: int
    block_n: int
    block_k: int
    num_stages: int
    num_warps: int = 4


def rowwise_tiles(m: int, n: int) -> RowwiseTiles:
    """The tiles of ``fp8_gemm_rowwise`` at ``m`` tokens: rows of x per program as few as FP8 dots allow (16), and
    N split finely enough that even N = 4096 gives the GPU a program per SM to stream its weight rows."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    return RowwiseTiles(block_m, 32 if n <= 8192 else 64, 256 if block_m <= 32 else 128, 4)


@triton.jit
def _rowwise_kernel(
    a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, M, N, K, stride_bs,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IMPRECISE_K: tl.constexpr,
):
    # N on the grid's first axis: programs launched together share x's rows and stream different weight rows
    rows, cols, row_ok, col_ok = _tile(tl.program_id(1), tl.program_id(0), M, N, BLOCK_M, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a, b = _k_tiles(a_ptr, b_ptr, rows, cols, row_ok, col_ok, k0, K, BLOCK_K)
        # Hopper's FP8 wgmma (BLOCK_M 64) keeps a reduced-precision accumulator: Triton's default never promotes it,
        # and over K = 12,288 the error against float32 doubled (3.1e-3 against 1.7e-3; session 45, H100). Promoted
        # every 128 elements of K, as DeepGEMM does.
        acc = tl.dot(a, b, acc, max_num_imprecise_acc=IMPRECISE_K)
    a_scale = tl.load(a_scale_ptr + rows, mask=row_ok, other=0.0)
    b_scale = tl.load(b_scale_ptr + cols * stride_bs, mask=col_ok, other=0.0)
    _store_tile(c_ptr, acc * a_scale[:, None] * b_scale[None, :], rows, cols, row_ok, col_ok, N)


@functools.cache
def scaled_mm_runs(device_index: int) -> bool:
    """torch's ``_scaled_mm`` with row-wise scales runs on this GPU (probed once, before CUDA graph capture)."""
    device = torch.device("cuda", device_index)
    try:
        a = torch.ones(16, 32, device=device).to(FP8_DTYPE)
        out = torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1, device=device),
                               scale_b=torch.full((1, 16), 0.5, device=device), out_dtype=torch.bfloat16)
        return bool(torch.all(out == 16))
    except (RuntimeError, NotImplementedError):  # not built for this GPU (row-wise scaling needs sm89+/sm90)
        return False


def fp8_gemm_rowwise(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                     tiles: RowwiseTiles | None = None) -> torch.Tensor:
    """x [M, K] (unit stride along K) @ weight [N, K] (e4m3, a scale a row: ``scale_inv`` [N, 1]).T in x's dtype;
    ``tiles``: ``rowwise_tiles``' by default (experiments sweep others; they also keep it from ``_scaled_mm``)."""
    m, k = x.shape
    n = weight.shape[0]
    if m > ROWWISE_MAX_TOKENS and tiles is None and x.is_cuda and x.dtype == torch.bfloat16 and k % 16 == 0 \
            and n % 16 == 0 and scaled_mm_runs(x.device.index or 0):
        a, a_scale = quantize_activations(x, k)
        return torch._scaled_mm(a, weight.t(), scale_a=a_scale, scale_b=scale_inv.view(1, n), out_dtype=x.dtype)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        a, a_scale = quantize_activations(x, k)
        t = tiles or rowwise_tiles(m, n)
        grid = (triton.cdiv(n, t.block_n), triton.cdiv(m, t.block_m))
        _rowwise_kernel[grid](
            a, weight, out, a_scale, scale_inv, m, n, k, scale_inv.stride(0),
            BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, IMPRECISE_K=min(t.block_k, 128),
            num_stages=t.num_stages, num_warps=t.num_warps,
        )
    return out
