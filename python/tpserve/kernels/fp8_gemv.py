"""FP8-weight GEMM for few tokens (decode): y = x @ (w * scale).T with x left in its dtype.

At decode a step's linears are bound by the bytes of their weights, so reading the FP8 weight
at the memory's bandwidth is what pays; quantizing the activations too (``fp8_gemm``) only adds
a kernel and error. Each program takes ``BLOCK_N`` output features over one of ``SPLIT_K``
slices of K, in ``BLOCK_K`` tiles (16-byte loads along K). Bytes in flight are what a GEMV
needs: with ``prefetch`` a program issues the next tile's loads (weight, activations, scales)
before reducing the current one, so every program keeps one tile in flight without Triton's
pipeliner (``num_stages`` > 1 adds that too). Per tile the FP8 weights convert to float32
(exact) and meet their block scales: for one token and tiles inside one scale group the products
accumulate elementwise and are reduced once at the end (``FLAT``: no shuffles in the loop);
otherwise each scale group's sum is reduced per tile, on CUDA cores for up to
``FMA_MAX_TOKENS`` tokens (``variant="fma"``), as a swap-AB tensor-core dot above
(``variant="dot_t"``: the weight tile is the MMA's wide side, tokens padded to 16). A K split
writes float32 partial sums that ``_gemv_sum_splits_kernel`` adds in a fixed order (deterministic, no
atomics). ``pdl`` launches with programmatic dependent launch (sm90): the first weight tile is
requested before waiting for the previous kernel. The torch reference is
``tpserve.quant.fp8.weight_only_reference``. No host synchronisation: CUDA graphs can hold it.
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
# Up to this many tokens the products run on CUDA cores; above, on tensor cores.
FMA_MAX_TOKENS = 4


@dataclass(frozen=True)
class GemvConfig:
    block_m: int  # tokens per program: a power of two >= the tokens with "fma", >= 16 with "dot_t"
    block_n: int
    block_k: int  # "fma": a power of two, several scale groups per tile allowed; "dot_t": inside one group
    split_k: int
    num_warps: int
    num_stages: int
    variant: str = "fma"  # "fma": CUDA-core products; "dot_t": swap-AB tensor-core dot
    prefetch: bool = True
    pdl: bool = False


@triton.jit
def _tile(w_rows, s_rows, x_rows, k0, ks, K, col_ok, row_ok, live, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
          GROUP_K: tl.constexpr, GROUPS: tl.constexpr, LOAD_X: tl.constexpr, GATED: tl.constexpr):
    """The weight tile [BN, BK], its scales [BN, GROUPS] and (``LOAD_X``) the activations [BM, BK]
    at k0 (``GATED``: the gate's and the up half's); ``live`` (a scalar) false loads nothing (the
    prefetch past a split's end)."""
    # masks of tiles, never of scalars: the interpreter takes no scalar masks (nor their "&")
    k_ok = (k0 + ks) < K
    w_mask = tl.broadcast_to(live, (w_rows.shape[0], ks.shape[0])) != 0
    if not EVEN_N:
        w_mask = w_mask & col_ok[:, None]
    if not EVEN_K:
        w_mask = w_mask & k_ok[None, :]
    w = tl.load(w_rows[:, None] + (k0 + ks)[None, :], mask=w_mask, other=0.0)
    groups = k0 // GROUP_K + tl.arange(0, GROUPS)
    s_mask = (tl.broadcast_to(live, (w_rows.shape[0], GROUPS)) != 0) & col_ok[:, None] & (groups * GROUP_K < K)[None, :]
    s = tl.load(s_rows[:, None] + groups[None, :], mask=s_mask, other=0.0)
    x, up = w, w  # unused unless LOAD_X
    if LOAD_X:
        x, up = _x_tile(x_rows, k0, ks, K, row_ok, live, GATED)
    return w, s, x, up


@triton.jit
def _x_tile(x_rows, k0, ks, K, row_ok, live, GATED: tl.constexpr):
    """The activations [BM, BK] at k0, and (``GATED``) the up half's, K further."""
    mask = (tl.broadcast_to(live, (x_rows.shape[0], ks.shape[0])) != 0) & row_ok[:, None] & ((k0 + ks) < K)[None, :]
    x = tl.load(x_rows[:, None] + (k0 + ks)[None, :], mask=mask, other=0.0)
    up = x
    if GATED:
        up = tl.load(x_rows[:, None] + K + (k0 + ks)[None, :], mask=mask, other=0.0)
    return x, up


@triton.jit
def _gated(x, up, GATED: tl.constexpr):
    """x, or silu(x) * up in float32 (SwiGLU's product, before the down projection)."""
    out = x
    if GATED:
        gate = x.to(tl.float32)
        out = gate / (1.0 + tl.exp(-gate)) * up.to(tl.float32)
    return out


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_xm, stride_s, stride_split, split_len, n_blocks,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT: tl.constexpr, GATED: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr, INTERPRETED: tl.constexpr,
):
    # scale groups per K tile, and the K width each scale covers in it
    GROUPS: tl.constexpr = BLOCK_K // GROUP_K if BLOCK_K > GROUP_K else 1
    GSIZE: tl.constexpr = BLOCK_K // GROUPS
    # one token, one scale group per tile: products accumulate elementwise, reduced once at the end
    FLAT: tl.constexpr = BLOCK_M == 1 and GROUPS == 1 and not DOT
    pid = tl.program_id(0)
    pid_n = pid % n_blocks
    pid_k = pid // n_blocks
    pid_m = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    col_ok, row_ok = cols < N, rows < M
    w_rows = w_ptr + cols.to(tl.int64) * K
    s_rows = s_ptr + (cols // GROUP_N) * stride_s
    x_rows = x_ptr + rows * stride_xm
    k_begin = pid_k * split_len
    k_end = tl.minimum(K, k_begin + split_len)
    if DOT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    elif FLAT:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PREFETCH:
        w_next, s_next, x_next, up_next = _tile(w_rows, s_rows, x_rows, k_begin, ks, K, col_ok, row_ok, k_begin < k_end,
                                                EVEN_N, EVEN_K, GROUP_K, GROUPS, False, False)
        if PDL:  # weights and scales are never written: only the activations wait for the previous kernel
            tl.extra.cuda.gdc_wait()
        x_next, up_next = _x_tile(x_rows, k_begin, ks, K, row_ok, k_begin < k_end, GATED)
    elif PDL:
        tl.extra.cuda.gdc_wait()
    for k0 in range(k_begin, k_end, BLOCK_K):
        if PREFETCH:
            w, s, x, up = w_next, s_next, x_next, up_next
            w_next, s_next, x_next, up_next = _tile(w_rows, s_rows, x_rows, k0 + BLOCK_K, ks, K, col_ok, row_ok,
                                                    k0 + BLOCK_K < k_end, EVEN_N, EVEN_K, GROUP_K, GROUPS, True, GATED)
        else:
            w, s, x, up = _tile(w_rows, s_rows, x_rows, k0, ks, K, col_ok, row_ok, k0 < k_end, EVEN_N, EVEN_K, GROUP_K,
                                GROUPS, True, GATED)
        x = _gated(x, up, GATED)
        if DOT:
            # through float32: exact, and Triton's CPU interpreter has no direct fp8 -> bf16
            x = x.to(x_ptr.dtype.element_ty)
            w = w.to(tl.float32).to(x.dtype)
            if INTERPRETED:  # the interpreter's bf16 dot is wrong; float32 gives the same sums
                x, w = x.to(tl.float32), w.to(tl.float32)
            if IEEE or INTERPRETED:
                part = tl.dot(w, tl.trans(x), input_precision="ieee")
            else:
                part = tl.dot(w, tl.trans(x))
            acc += part * s  # one scale group per tile: s [BLOCK_N, 1]
        elif FLAT:  # x [1, BLOCK_K], s [BLOCK_N, 1]
            acc += w.to(tl.float32) * x.to(tl.float32) * s
        else:
            prod = w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
            part = tl.sum(tl.reshape(prod, (BLOCK_M, BLOCK_N, GROUPS, GSIZE)), axis=3)
            acc += tl.sum(part * s[None, :, :], axis=2)
    out = out_ptr + pid_k * stride_split
    if FLAT:
        tl.store(out + cols, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=col_ok)
    elif DOT:
        tl.store(out + rows[None, :] * N + cols[:, None], acc.to(out_ptr.dtype.element_ty), mask=col_ok[:, None] & row_ok[None, :])
    else:
        tl.store(out + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _gemv_sum_splits_kernel(part_ptr, out_ptr, size, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < size
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in tl.static_range(SPLITS):
        acc += tl.load(part_ptr + split * size + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


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


def fma_block_k(k: int, group_k: int, want: int) -> int:
    """The largest power of two up to ``want`` and to K (at least 16) that the scale groups
    tile: one dividing the group, or a multiple of a power-of-two group."""
    tile = want
    while tile > 16 and (tile > k or (group_k % tile and (group_k & (group_k - 1) or tile % group_k))):
        tile //= 2
    return tile


def default_config(m: int, n: int, k: int, group_k: int, sm_count: int) -> GemvConfig:
    """One token: 64 features x one scale group (8 KB tiles of 128-byte rows, 8 warps: two
    16-byte loads a thread) accumulated elementwise (compiled for sm_90 it has no shuffles nor
    shared memory in its loop, where 512-1024-byte tiles spend ~20 instructions a byte), the
    next tile in flight (``prefetch``), K split until there are two programs per SM. 2-4 tokens:
    8 KB tiles of 8 or 16 features x 1024 or 512 bytes, four warps. The sweep
    (``benchmarks/experiments/fp8_gemv_sweep.py``) measures the alternatives. More tokens take
    swap-AB dots over 32-feature tiles (64 where that still gives two programs per SM), K split
    in two for long K: x is re-read from L2 by each program, 2 * M / BLOCK_N times its weight
    bytes, so wider tiles for more tokens."""
    if m <= FMA_MAX_TOKENS:
        if m == 1:
            block_n, block_k, warps = 64, k_tile(group_k), 8
        else:
            block_n = 16 if triton.cdiv(n, 16) >= 3 * sm_count else 8
            block_k, warps = fma_block_k(k, group_k, 8192 // block_n), 4
        split_k = 1
        while triton.cdiv(n, block_n) * split_k < 2 * sm_count and k // (2 * split_k) >= 2 * block_k:
            split_k *= 2
        return GemvConfig(triton.next_power_of_2(m), block_n, block_k, split_k, num_warps=warps, num_stages=1)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    m_tiles = triton.cdiv(m, block_m)
    min_n = 32 if m <= 32 else 64
    block_n = 64 if triton.cdiv(n, 64) * m_tiles >= 2 * sm_count else min_n
    split_k = 2 if k >= 8192 else 1
    return GemvConfig(block_m, block_n, k_tile(group_k), split_k, num_warps=4, num_stages=6 if split_k > 1 else 4,
                      variant="dot_t", prefetch=False)


def check_config(config: GemvConfig, m: int, group_k: int) -> None:
    pow2 = config.block_m & (config.block_m - 1) == 0 and config.block_k & (config.block_k - 1) == 0
    if config.variant == "fma":
        if not pow2 or config.block_m < m and m > 1:
            raise ValueError(f"variant fma takes all {m} tokens in one power-of-two block_m, got {config}")
        if config.block_k > group_k and (config.block_k % group_k or group_k & (group_k - 1)):
            raise ValueError(f"K tile {config.block_k} must be a multiple of the power-of-two scale group, got {group_k}")
        if config.block_k < group_k and group_k % config.block_k:
            raise ValueError(f"K tile {config.block_k} must divide the scale group {group_k}")
    elif config.variant == "dot_t":
        if group_k % config.block_k or config.block_m < 16 or config.block_n < 16:
            raise ValueError(f"dots take K tiles dividing the scale group {group_k}, block_m and block_n >= 16, got {config}")
    else:
        raise ValueError(f"variant must be fma or dot_t, got {config.variant!r}")


def fp8_gemv(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int],
    config: GemvConfig | None = None, gated: bool = False,
) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32, unit stride along K) @ (weight * block scales).T -> [M, N] in
    x's dtype. ``scale_inv`` [ceil(N / bn), >= ceil(K / bk)] (its row stride is read).
    ``gated``: x is [M, 2K], [gate | up], and the product is silu(gate) * up @ ... (SwiGLU fused
    into the down projection's loads)."""
    n, k = weight.shape
    m = x.shape[0]
    if x.shape[1] != (2 * k if gated else k):
        raise ValueError(f"x has {x.shape[1]} features, the weight {k}{' (gated: twice that)' if gated else ''}")
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
    n_blocks = triton.cdiv(n, config.block_n)
    extra = {"launch_pdl": True} if config.pdl else {}
    _gemv_kernel[(n_blocks * splits, triton.cdiv(m, config.block_m))](
        x, weight, scale_inv, target, m, n, k, x.stride(0), scale_inv.stride(0), m * n, tiles_per_split * config.block_k,
        n_blocks, GROUP_N=block_size[0], GROUP_K=block_size[1], BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, DOT=config.variant == "dot_t", GATED=gated, PREFETCH=config.prefetch, PDL=config.pdl,
        EVEN_N=n % config.block_n == 0, EVEN_K=k % config.block_k == 0, IEEE=x.dtype == torch.float32,
        INTERPRETED=_INTERPRETED, num_warps=config.num_warps, num_stages=config.num_stages, **extra,
    )
    if splits > 1:
        block = 1024
        _gemv_sum_splits_kernel[(triton.cdiv(m * n, block),)](target, out, m * n, SPLITS=splits, BLOCK=block, num_warps=4)
    return out
