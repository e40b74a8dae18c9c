"""One Triton kernel that writes a step's new k and v rows into the paged cache, read through their
row strides (v is a view of the qkv output): the torch path is two scatters plus a copy of v.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpserve.quant.fp8 import FP8_DTYPE, FP8_MAX


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
    k_row_stride, v_row_stride,
    ROW: tl.constexpr, BLOCK: tl.constexpr, CLAMP: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < ROW
    k = tl.load(k_ptr + token.to(tl.int64) * k_row_stride + cols, mask=mask)
    v = tl.load(v_ptr + token.to(tl.int64) * v_row_stride + cols, mask=mask)
    if CLAMP > 0:  # an FP8 cache: stored with a scale of 1, in e4m3's range
        k = tl.clamp(k.to(tl.float32), -CLAMP, CLAMP)
        v = tl.clamp(v.to(tl.float32), -CLAMP, CLAMP)
    tl.store(k_cache_ptr + slot * ROW + cols, k, mask=mask)
    tl.store(v_cache_ptr + slot * ROW + cols, v, mask=mask)


def rows_supported(x: torch.Tensor) -> bool:
    """[T, H, D] with each token's H * D values contiguous (a row may start anywhere)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write k, v [T, H, D] into contiguous caches [pages, page_size, H, D] at flat ``slots`` [T]."""
    if not (rows_supported(k) and rows_supported(v) and k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("store_kv needs row-contiguous k/v and contiguous caches; use KVCachePool.store")
    tokens, row = k.shape[0], k.shape[1] * k.shape[2]
    if tokens == 0:
        return
    _store_kv_kernel[(tokens,)](
        k, v, k_cache, v_cache, slots, k.stride(0), v.stride(0),
        ROW=row, BLOCK=triton.next_power_of_2(row), CLAMP=FP8_MAX if k_cache.dtype == FP8_DTYPE else 0.0, num_warps=4,
    )
