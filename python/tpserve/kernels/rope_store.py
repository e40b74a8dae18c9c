"""One Triton kernel per layer from the qkv output to attention's inputs, replacing four
launch-bound decode kernels (q norm, k norm, rotary, KV store; plus a q copy without q/k norm).

Program (token, head), or (16 tokens, head) in a prefill, normalises its head (with q/k norm), rotates q/k (neox,
float32 cos/sin) and writes q to a new tensor, k and v into their cache slots. Rounding as the unfused path: the
normed head rounded to the model dtype, rotated in float32, rounded again; an FP8 cache then gets
k and v clamped to e4m3's range (``KVCachePool.to_cache``).

Why not inside the decode attention kernel: session 19 folded it into ``attention/triton_decode.py`` (each
program norming and rotating its q heads and the newest k, that token's split storing k and v; the same
bits). Whole batch-1 steps on an H200 were slower: Qwen3-8B bf16 1.019x, FP8 1.033x, Qwen3-30B-A3B 1.036x
(docs/benchmarks.md). With this kernel between, attention launches (PDL) while it runs and reads its K/V
pages meanwhile; fused, that read waits on the qkv GEMV. Session 24 moved it into the qkv GEMV's epilogue instead
(each head's last block, told by a counter, finishing the head): the same outputs, but batch-1 steps 2.1% slower
(Qwen3-8B bf16 and FP8; Qwen3-30B-A3B no faster), for the same reason (docs/results/history.md, session 24).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpserve.kernels.pdl import triton_pdl
from tpserve.quant.fp8 import FP8_DTYPE, FP8_MAX


@triton.jit
def _rotated_head(
    src, weight_ptr, cos, sin, eps, cols, rows_ok,
    HALF: tl.constexpr, HAS_NORM: tl.constexpr,
):
    x1 = tl.load(src + cols, mask=rows_ok).to(tl.float32)
    x2 = tl.load(src + HALF + cols, mask=rows_ok).to(tl.float32)
    if HAS_NORM:
        rms = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(weight_ptr + cols).to(tl.float32)
        w2 = tl.load(weight_ptr + HALF + cols).to(tl.float32)
        x1 = (x1 * rms * w1).to(src.dtype.element_ty).to(tl.float32)
        x2 = (x2 * rms * w2).to(src.dtype.element_ty).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _norm_rope_store_kernel(
    qkv_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, positions_ptr, cos_sin_ptr,
    q_weight_ptr, k_weight_ptr, qkv_row_stride, eps, num_tokens,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_NORM: tl.constexpr, CLAMP: tl.constexpr, PDL: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Program (block of BLOCK_T tokens, head); each tile is [BLOCK_T, HEAD_DIM / 2] (the two halves rotate together)."""
    if PDL:  # the next kernel (attention) may launch and read its page table meanwhile
        tl.extra.cuda.gdc_launch_dependents()
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tokens_ok = tokens < num_tokens
    rows_ok = tokens_ok[:, None]
    head = tl.program_id(1)
    HALF: tl.constexpr = HEAD_DIM // 2
    cols = tl.arange(0, HALF)[None, :]
    src = qkv_ptr + tokens[:, None] * qkv_row_stride + head * HEAD_DIM
    if head < NUM_Q_HEADS + NUM_KV_HEADS:
        position = tl.load(positions_ptr + tokens, mask=tokens_ok, other=0).to(tl.int64)[:, None]  # the host's
        cos = tl.load(cos_sin_ptr + position * HEAD_DIM + cols)
        sin = tl.load(cos_sin_ptr + position * HEAD_DIM + HALF + cols)
        if PDL:  # qkv: the previous kernel's output
            tl.extra.cuda.gdc_wait()
        if head < NUM_Q_HEADS:
            o1, o2 = _rotated_head(src, q_weight_ptr, cos, sin, eps, cols, rows_ok, HALF, HAS_NORM)
            q_dst = q_out_ptr + (tokens[:, None] * NUM_Q_HEADS + head) * HEAD_DIM
            tl.store(q_dst + cols, o1.to(q_dst.dtype.element_ty), mask=rows_ok)
            tl.store(q_dst + HALF + cols, o2.to(q_dst.dtype.element_ty), mask=rows_ok)
        else:
            o1, o2 = _rotated_head(src, k_weight_ptr, cos, sin, eps, cols, rows_ok, HALF, HAS_NORM)
            slot = tl.load(slots_ptr + tokens, mask=tokens_ok, other=0).to(tl.int64)[:, None]
            k_dst = k_cache_ptr + (slot * NUM_KV_HEADS + head - NUM_Q_HEADS) * HEAD_DIM
            if CLAMP > 0:  # an FP8 cache: k in the model dtype first, as the unfused path stores it
                o1 = tl.clamp(o1.to(src.dtype.element_ty).to(tl.float32), -CLAMP, CLAMP)
                o2 = tl.clamp(o2.to(src.dtype.element_ty).to(tl.float32), -CLAMP, CLAMP)
            tl.store(k_dst + cols, o1.to(k_dst.dtype.element_ty), mask=rows_ok)
            tl.store(k_dst + HALF + cols, o2.to(k_dst.dtype.element_ty), mask=rows_ok)
    else:  # a v head: copied as is (clamped into an FP8 cache's range)
        slot = tl.load(slots_ptr + tokens, mask=tokens_ok, other=0).to(tl.int64)[:, None]
        if PDL:
            tl.extra.cuda.gdc_wait()
        dst = v_cache_ptr + (slot * NUM_KV_HEADS + head - NUM_Q_HEADS - NUM_KV_HEADS) * HEAD_DIM
        v1 = tl.load(src + cols, mask=rows_ok)
        v2 = tl.load(src + HALF + cols, mask=rows_ok)
        if CLAMP > 0:
            v1 = tl.clamp(v1.to(tl.float32), -CLAMP, CLAMP)
            v2 = tl.clamp(v2.to(tl.float32), -CLAMP, CLAMP)
        tl.store(dst + cols, v1.to(dst.dtype.element_ty), mask=rows_ok)
        tl.store(dst + HALF + cols, v2.to(dst.dtype.element_ty), mask=rows_ok)


# From this many tokens (prefill) a program takes PREFILL_BLOCK_T tokens of its head: one (token, head) a program
# ran Qwen3-30B-A3B's 8,192-token prefill at ~4x its bytes' time (H100, 2026-12-05: 199 us a layer, 8% of the step).
PREFILL_MIN_TOKENS = 128
PREFILL_BLOCK_T = 16


def supported(head_dim: int, cos_sin_cache: torch.Tensor | None) -> bool:
    """A power-of-two head_dim (the kernel's block) and a float32 table."""
    table_ok = cos_sin_cache is not None and cos_sin_cache.dtype == torch.float32
    return table_ok and head_dim >= 32 and head_dim & (head_dim - 1) == 0


def norm_rope_store(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """From qkv [T, (Hq + 2 Hkv) * D]: returns q [T, Hq, D], writes k and v into contiguous caches
    [pages, page_size, Hkv, D] (model dtype or e4m3) at flat ``slots`` [T]. ``cos_sin_cache``:
    [max_positions, D] float32, cos then sin. No q/k norm: both weights None."""
    if (q_weight is None) != (k_weight is None):
        raise ValueError("pass both q/k norm weights or neither")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and qkv.dim() == 2 and qkv.stride(1) == 1):
        raise ValueError("norm_rope_store needs contiguous KV caches and qkv rows")
    tokens = qkv.shape[0]
    q = torch.empty((tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q
    has_norm = q_weight is not None
    pdl = triton_pdl(qkv.device, tokens)
    block_t = PREFILL_BLOCK_T if tokens >= PREFILL_MIN_TOKENS else 1
    _norm_rope_store_kernel[(triton.cdiv(tokens, block_t), num_heads + 2 * num_kv_heads)](
        qkv, q, k_cache, v_cache, slots, positions, cos_sin_cache,
        q_weight if has_norm else qkv, k_weight if has_norm else qkv, qkv.stride(0), eps, tokens,
        NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HAS_NORM=has_norm,
        CLAMP=FP8_MAX if k_cache.dtype == FP8_DTYPE else 0.0, PDL=pdl, BLOCK_T=block_t,
        num_warps=1 if block_t == 1 else 4, launch_pdl=pdl,
    )
    return q
