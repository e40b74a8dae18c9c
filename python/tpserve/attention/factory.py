"""Picks and builds the attention backend the engine asked for."""

from __future__ import annotations

import torch

from tpserve.attention.base import AttentionBackend
from tpserve.attention.flashinfer_backend import FlashInferAttentionBackend, flashinfer_available
from tpserve.attention.torch_backend import TorchAttentionBackend
from tpserve.kvcache.pool import KVCachePool

BACKENDS = ("auto", "flashinfer", "torch")


def resolve_backend_name(name: str, device: torch.device) -> str:
    """``auto`` is flashinfer on CUDA when it imports, else torch."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} (choose {', '.join(BACKENDS)})")
    if name != "auto":
        return name
    return "flashinfer" if device.type == "cuda" and flashinfer_available() else "torch"


def create_backend(
    name: str,
    pool: KVCachePool,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
    fused_rope_store: bool = False,
) -> AttentionBackend:
    if resolve_backend_name(name, device) == "flashinfer":
        return FlashInferAttentionBackend(pool, num_heads, num_kv_heads, head_dim, device, fused_rope_store)
    return TorchAttentionBackend(pool, num_heads, num_kv_heads, head_dim, fused_rope_store)
