"""The attention backend interface.

``prepare`` turns a step's sequences into backend metadata once per step (FlashInfer plans its
wrappers there); ``forward`` is called by every layer with that metadata, stores the new k/v
into the paged cache and returns the attention output.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from tpserve.engine.batch import SequenceInput
from tpserve.kvcache.pool import KVCachePool


class AttentionBackend(ABC):
    def __init__(self, pool: KVCachePool, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.pool = pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    @abstractmethod
    def prepare(self, seqs: list[SequenceInput], device: torch.device) -> object:
        """Per-step metadata, built once and shared by all layers."""

    @abstractmethod
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out_slots: torch.Tensor, meta: object
    ) -> torch.Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] -> [T, num_heads, head_dim]."""


def create_backend(
    name: str, pool: KVCachePool, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device
) -> AttentionBackend:
    if name == "auto":
        name = "torch"  # FlashInfer becomes the CUDA default once its backend lands
    if name == "torch":
        from tpserve.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(pool, num_heads, num_kv_heads, head_dim)
    raise ValueError(f"unknown attention backend {name!r} (choose auto or torch)")
