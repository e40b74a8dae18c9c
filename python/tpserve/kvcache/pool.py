"""Paged KV cache: per-layer K and V [num_pages, page_size, kv_heads, head_dim] (FlashInfer's NHD) and
a page allocator. Page 0 is a scratch page for padded tokens (CUDA graphs), never handed out. An
fp8_e4m3 cache stores k and v with a scale of 1, clamped to +-448 (far outside post-norm values)."""

from __future__ import annotations

import torch

from tpserve.kernels import use_triton
from tpserve.quant.fp8 import FP8_DTYPE, FP8_MAX


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"the KV cache needs at least 2 pages, got {num_pages}")
        self.total = num_pages - 1
        # Lowest page first, so allocation order is the same on every rank.
        self._free = list(range(num_pages - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.total - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV pages, only {len(self._free)} free")
        pages = self._free[len(self._free) - n :][::-1]
        del self._free[len(self._free) - n :]
        return pages

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


def kv_cache_dtype(name: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The cache's storage dtype for ``--kv-cache-dtype``: auto is the compute dtype."""
    if name == "auto":
        return compute_dtype
    if name == "fp8_e4m3":
        return FP8_DTYPE
    raise ValueError(f"kv_cache_dtype must be auto or fp8_e4m3, got {name!r}")


class KVCachePool:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype = dtype  # as stored
        self.compute_dtype = dtype if compute_dtype is None else compute_dtype  # as written and read
        self.fp8 = dtype == FP8_DTYPE
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * page_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new tokens' k/v [T, kv_heads, head_dim] (maybe strided views) into flat slots."""
        if use_triton(k.device):
            from tpserve.kernels import kv_store

            if kv_store.rows_supported(k) and kv_store.rows_supported(v):
                kv_store.store_kv(self.k[layer], self.v[layer], slots, k, v)
                return
        self.k[layer].view(-1, *k.shape[1:])[slots] = self.to_cache(k)
        self.v[layer].view(-1, *v.shape[1:])[slots] = self.to_cache(v)

    def to_cache(self, x: torch.Tensor) -> torch.Tensor:
        return x.clamp(-FP8_MAX, FP8_MAX).to(self.dtype) if self.fp8 else x

    def read(self, cache: torch.Tensor) -> torch.Tensor:
        """Cache rows as the model computes with them."""
        return cache.to(self.compute_dtype) if self.fp8 else cache
