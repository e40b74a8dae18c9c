"""Paged KV cache: per-layer K and V tensors of [num_pages, page_size, kv_heads, head_dim]
(FlashInfer's NHD layout), and an allocator that hands out whole pages.

Page 0 is never handed out: it is a scratch page that padded tokens (e.g. CUDA-graph padding)
may write to without touching any request's KV.
"""

from __future__ import annotations

import torch

from tpserve.kernels import use_triton


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"the KV cache needs at least 2 pages, got {num_pages}")
        self.total = num_pages - 1  # usable pages (page 0 is scratch)
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
    ) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * page_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new tokens' k/v ([T, kv_heads, head_dim]) into flat slots page*page_size+offset.
        On CUDA one Triton kernel writes both (k and v may be strided views of the qkv output)."""
        if use_triton(k.device):
            from tpserve.kernels import kv_store

            if kv_store.rows_supported(k) and kv_store.rows_supported(v):
                kv_store.store_kv(self.k[layer], self.v[layer], slots, k, v)
                return
        self.k[layer].view(-1, *k.shape[1:])[slots] = k
        self.v[layer].view(-1, *v.shape[1:])[slots] = v
