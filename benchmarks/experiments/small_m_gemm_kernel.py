"""A Triton linear layer for a few tokens: ``y = x @ W^T (+ bias)`` with ``x`` [M, K], M <= 64.

Why: at decode time M (tokens in the step) is small, so a linear layer reads its weight
W [N, K] once and does 2 * M FLOPs per weight element. It is a stream of W through the SMs and
its time is W's bytes over the HBM read bandwidth. On an H200, Qwen3-8B at batch 1 spends most
of its GPU time in ``F.linear`` (cuBLAS), which reads the weights at ~85% of the device-copy
bandwidth. This kernel is written for that stream and nothing else:

* Each program owns a BLOCK_N slice of the outputs, for every one of the M rows (padded to
  BLOCK_M), and a slice of K: W is read exactly once, x (small, L2-resident) once per program.
  Padded x rows are masked (zero-filled, no memory traffic), not clamped.
* The K loop is software-pipelined (``tl.range(num_stages=...)``): with plain pointer loads the
  compiler turns the loads into ``cp.async`` copies into a ring of shared-memory buffers, so
  ``num_stages - 1`` tiles per program are in flight while one is multiplied.
* Three variants of the inner product (``SmallMConfig.variant``):
  ``"dot"``   ``tl.dot(x [BLOCK_M, BLOCK_K], W^T [BLOCK_K, BLOCK_N])``, BLOCK_M >= 16;
  ``"dot_t"`` swap-AB, ``tl.dot(W [BLOCK_N, BLOCK_K], x^T [BLOCK_K, BLOCK_M])``: the weight tile
  is the MMA's M side, so BLOCK_N >= 64 can use Hopper's wgmma with only 16 token columns;
  ``"fma"``   CUDA cores, ``sum(x[:, None, :] * W[None, :, :], axis=2)`` in float32 with
  BLOCK_M = next_power_of_2(M) (no padding to 16); the [BLOCK_M, BLOCK_N, BLOCK_K] product
  lives in registers, so it is for M <= 8 with narrow tiles (M * BLOCK_N <= 64 does not spill).
* Split-K (``split_k > 1``) gives more programs when N / BLOCK_N alone would leave SMs idle. It
  is deterministic: each split writes its float32 partial to a [split_k, M, N] workspace and a
  second small kernel sums the partials in split order, adds the bias and casts. No atomics, so
  the result does not depend on which program finished first, and every tensor-parallel rank
  computes the same bits from the same inputs.

Accumulation is float32; the bias is added in float32 before the one rounding to x's dtype.
There is no autotuning at call time: ``default_config`` is a heuristic on (M, N, K, SMs) and a
caller may pass an explicit ``SmallMConfig`` (``benchmarks/experiments/gemm_small_m.py`` sweeps them). No
host synchronisation and no data-dependent host decisions, so a call can be captured in a CUDA
graph (the split-K workspace comes from torch's allocator, i.e. the graph's pool).

Status: an experiment, not used by the engine. On the H200 (2026-11-29, docs/benchmarks.md) the
best of the swept configs beat cuBLAS by only 2-4% over Qwen3-8B/14B's decode linears at M = 1
and lost at M = 64; only Qwen3-0.6B's narrow layers at M <= 8 gained (1.5x, ~0.3 ms a step).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_M = 64
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
VARIANTS = ("dot", "dot_t", "fma")
# Triton's CPU interpreter (TRITON_INTERPRET=1, for tests without a GPU) runs the kernels on CPU
# tensors; anywhere else they need CUDA tensors.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# The interpreter's tl.dot multiplies bfloat16 tiles as their raw uint16 bits; there the tiles go
# to tl.dot as float32 (the same products, exact in float32). On the GPU they stay 16-bit.
_DOT_F32 = _INTERPRET
_REDUCE_BLOCK = 1024


@dataclass(frozen=True)
class SmallMConfig:
    """One launch configuration. ``split_k`` is an upper bound: it is lowered so that every
    split has at least one BLOCK_K step."""

    block_n: int = 32
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    variant: str = "dot_t"

    def block_m(self, m: int) -> int:
        """The padded token block: tl.dot needs at least 16; the CUDA-core path pads to a power of 2."""
        padded = triton.next_power_of_2(max(m, 1))
        return padded if self.variant == "fma" else max(16, padded)

    def validate(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        for name in ("block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of 2, got {value}")
        min_n = 1 if self.variant == "fma" else 16
        if self.block_n < min_n or self.block_k < 16:
            raise ValueError(
                f"{self.variant} needs block_n >= {min_n} and block_k >= 16, got {self}"
            )
        if self.split_k < 1 or self.num_stages < 1:
            raise ValueError(f"split_k and num_stages must be >= 1, got {self}")

    def __str__(self) -> str:
        return (
            f"{self.variant} n{self.block_n} k{self.block_k} s{self.split_k} "
            f"w{self.num_warps} st{self.num_stages}"
        )


def auto_split_k(
    n: int, k: int, block_n: int, block_k: int, num_sms: int, max_split: int = 8
) -> int:
    """Split K only when the N tiles leave SMs idle: enough splits for ~2 programs per SM, at
    most ``max_split``, at least 4 BLOCK_K steps per split (something for the pipeline to
    overlap), and a divisor of the step count so every split does the same work."""
    tiles = triton.cdiv(n, block_n)
    if tiles >= num_sms:
        return 1
    k_steps = triton.cdiv(k, block_k)
    want = max(1, min(max_split, triton.cdiv(2 * num_sms, tiles), k_steps // 4))
    return next(s for s in range(want, 0, -1) if k_steps % s == 0)


def default_config(m: int, n: int, k: int, num_sms: int) -> SmallMConfig:
    """A heuristic: swap-AB tensor-core tiles, narrow enough that the N tiles alone give every SM
    work (split-K only when they cannot), and wide enough that re-reading x per tile (M / BLOCK_N
    of the weight traffic, from L2) stays small."""
    min_n = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = min_n
    for candidate in (64, 32, 16):
        if candidate >= min_n and triton.cdiv(n, candidate) >= 2 * num_sms:
            block_n = candidate
            break
    # Shared memory per program ~ num_stages * (BLOCK_N + BLOCK_M) * BLOCK_K * 2 bytes: keep it
    # near 80 KB or less so that two programs fit on an SM.
    block_k = 256 if m <= 16 and block_n <= 32 else 128
    split_k = auto_split_k(n, k, block_n, block_k, num_sms)
    return SmallMConfig(
        block_n=block_n,
        block_k=block_k,
        split_k=split_k,
        num_warps=4,
        num_stages=4,
        variant="dot_t",
    )


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: any plausible count
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit(do_not_specialize=["M", "split_stride", "steps_per_split"])
def _small_m_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    split_stride,
    steps_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    VARIANT: tl.constexpr,  # 0 dot, 1 dot_t (swap-AB), 2 fma (CUDA cores)
    SPLIT: tl.constexpr,  # write float32 partials to out_ptr[pid_k] (a workspace)
    HAS_BIAS: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    k_steps = tl.cdiv(K, BLOCK_K)
    first = pid_k * steps_per_split
    last = tl.minimum(first + steps_per_split, k_steps)

    # The weight tile's rows from a 64-bit base (lm_head: N * K can pass 2**31), offsets in int32.
    # Rows past N (only when N % BLOCK_N != 0) re-read row N - 1; their outputs are not stored.
    local_n = tl.arange(0, BLOCK_N)
    if not EVEN_N:
        local_n = tl.minimum(local_n, N - 1 - pid_n * BLOCK_N)
    w_ptrs = w_ptr + (pid_n * BLOCK_N).to(tl.int64) * stride_wn
    w_ptrs = w_ptrs + local_n[:, None] * stride_wn + first * BLOCK_K + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + first * BLOCK_K + offs_k[None, :]
    x_rows = offs_m[:, None] < M

    if VARIANT == 1:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in tl.range(first, last, num_stages=NUM_STAGES):
        if EVEN_K:
            w = tl.load(w_ptrs)
            x = tl.load(x_ptrs, mask=x_rows, other=0.0)
        else:
            in_k = (step * BLOCK_K + offs_k[None, :]) < K
            w = tl.load(w_ptrs, mask=in_k, other=0.0)
            x = tl.load(x_ptrs, mask=x_rows & in_k, other=0.0)
        if DOT_F32:
            w = w.to(tl.float32)
            x = x.to(tl.float32)
        if VARIANT == 0:
            acc = tl.dot(x, tl.trans(w), acc)
        elif VARIANT == 1:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc += tl.sum(
                x[:, None, :].to(tl.float32) * w[None, :, :].to(tl.float32), axis=2
            )
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K

    # Epilogue: [BLOCK_M, BLOCK_N] outputs (transposed for swap-AB), rows < M and columns < N.
    if VARIANT == 1:
        out_offs = offs_m[None, :] * N + offs_n[:, None]
        out_mask = (offs_m[None, :] < M) & (offs_n[:, None] < N)
    else:
        out_offs = offs_m[:, None] * N + offs_n[None, :]
        out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT:
        tl.store(
            out_ptr + pid_k.to(tl.int64) * split_stride + out_offs, acc, mask=out_mask
        )
    else:
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
            if VARIANT == 1:
                acc += bias[:, None]
            else:
                acc += bias[None, :]
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["numel", "splits"])
def _split_k_reduce_kernel(
    ws_ptr,
    bias_ptr,
    out_ptr,
    N,
    numel,
    splits,
    BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """out = sum over splits, in split order, of ws[split] (+ bias), in float32, then cast."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for split in range(1, splits):
        acc += tl.load(ws_ptr + split * numel + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def check_supported(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """Raise ValueError unless ``small_m_linear`` takes these tensors."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be [N, K], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(
            f"x [..., K] does not match weight [N, K]: {tuple(x.shape)} vs {tuple(weight.shape)}"
        )
    if x.dtype not in SUPPORTED_DTYPES or weight.dtype != x.dtype:
        raise ValueError(
            f"x and weight must both be bfloat16 or float16, got {x.dtype} and {weight.dtype}"
        )
    if k == 0 or k % 16 != 0:
        raise ValueError(f"K (in_features) must be a positive multiple of 16, got {k}")
    if weight.stride(1) != 1 or weight.stride(0) < k:
        raise ValueError(
            f"weight must be row-major ([N, K] with contiguous rows), got strides {weight.stride()}"
        )
    if x.numel() // k > MAX_M:
        raise ValueError(
            f"at most {MAX_M} rows (tokens), got {x.numel() // k}; use F.linear"
        )
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise ValueError(
            f"bias must be [{n}] of {x.dtype}, got {tuple(bias.shape)} of {bias.dtype}"
        )
    if not _INTERPRET and not (x.is_cuda and weight.is_cuda):
        raise ValueError(
            "small_m_linear runs on CUDA tensors (or on CPU under TRITON_INTERPRET=1)"
        )


def small_m_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: SmallMConfig | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [..., K] with at most MAX_M rows, weight [N, K]."""
    check_supported(x, weight, bias)
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    if config is None:
        config = default_config(m, n, k, _num_sms(x.device))
    config.validate()
    if bias is not None:
        bias = bias.contiguous()

    block_m = config.block_m(m)
    k_steps = triton.cdiv(k, config.block_k)
    steps_per_split = triton.cdiv(k_steps, min(config.split_k, k_steps))
    splits = triton.cdiv(k_steps, steps_per_split)  # no split is left without a step
    tiles = triton.cdiv(n, config.block_n)
    target = (
        out
        if splits == 1
        else torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    )
    _small_m_kernel[(tiles, splits)](
        x2,
        weight,
        bias if bias is not None else out,
        target,
        m,
        n,
        k,
        x2.stride(0),
        weight.stride(0),
        m * n,
        steps_per_split,
        BLOCK_M=block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        VARIANT=VARIANTS.index(config.variant),
        SPLIT=splits > 1,
        HAS_BIAS=bias is not None,
        EVEN_N=n % config.block_n == 0,
        EVEN_K=k % config.block_k == 0,
        NUM_STAGES=config.num_stages,
        DOT_F32=_DOT_F32 and config.variant != "fma",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if splits > 1:
        _split_k_reduce_kernel[(triton.cdiv(m * n, _REDUCE_BLOCK),)](
            target,
            bias if bias is not None else out,
            out,
            n,
            m * n,
            splits,
            BLOCK=_REDUCE_BLOCK,
            HAS_BIAS=bias is not None,
            num_warps=4,
        )
    return out.view(*x.shape[:-1], n)
