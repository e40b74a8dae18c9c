"""The attention backend interface.

``prepare`` turns a step's sequences into backend metadata once per step (FlashInfer plans its
wrappers there). Every layer calls ``forward`` with that metadata: it stores the new k/v into
the paged cache (unless the layer's fused kernel already did), then the backend's ``attend``
computes attention over the cache.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import torch

from tpserve.config import FLASHINFER_ATTENTION_DTYPES
from tpserve.engine.batch import SequenceInput
from tpserve.kvcache.pool import KVCachePool

logger = logging.getLogger(__name__)

class AttentionBackend(ABC):
    supports_cuda_graphs = False  # whether cuda_graph_metadata/plan_cuda_graph are implemented

    def __init__(self, pool: KVCachePool, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.pool = pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    @abstractmethod
    def prepare(self, seqs: list[SequenceInput], device: torch.device) -> object:
        """Per-step metadata, built once and shared by all layers."""

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        out_slots: torch.Tensor,
        meta: object,
    ) -> torch.Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] -> [T, num_heads, head_dim].
        k and v None: the caller already wrote them into the pool at ``out_slots``."""
        if k is not None and v is not None:
            self.pool.store(layer, out_slots, k, v)
        return self.attend(layer, q, meta)

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, meta: object) -> torch.Tensor:
        """Attention of q [T, num_heads, head_dim] over layer ``layer``'s cache, this step's k/v
        already stored."""

    def cuda_graph_metadata(self, batch_size: int, max_pages_per_seq: int) -> object:
        """Metadata with fixed-address buffers for a decode graph of ``batch_size`` sequences."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def plan_cuda_graph(self, seqs: list[SequenceInput], meta: object, batch_size: int) -> None:
        """Fill ``meta`` (from cuda_graph_metadata) for ``seqs`` padded to ``batch_size``."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")


BACKENDS = ("auto", "flashinfer", "torch")


def resolve_backend_name(name: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
    """``auto`` is flashinfer on CUDA in half precision when it imports, else torch."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} (choose {', '.join(BACKENDS)})")
    if name != "auto":
        return name
    if device.type == "cuda":
        if dtype not in FLASHINFER_ATTENTION_DTYPES:
            logger.info("FlashInfer attention takes bfloat16 and float16 only: torch attention for %s", dtype)
            return "torch"
        from tpserve.attention.flashinfer_backend import flashinfer_available

        if flashinfer_available():
            return "flashinfer"
    return "torch"


def create_backend(
    name: str,
    pool: KVCachePool,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
    options: Mapping[str, Any] | None = None,
) -> AttentionBackend:
    """``options`` go to the FlashInfer backend (decode_tensor_cores, prefill_backend)."""
    name = resolve_backend_name(name, device, pool.k[0].dtype)
    if name == "flashinfer":
        from tpserve.attention.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend(pool, num_heads, num_kv_heads, head_dim, device, **dict(options or {}))
    from tpserve.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend(pool, num_heads, num_kv_heads, head_dim)
