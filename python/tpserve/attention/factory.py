"""Picks and builds the attention backend the engine asked for."""

from __future__ import annotations

import logging

import torch

from tpserve.attention.base import AttentionBackend
from tpserve.attention.flashinfer_backend import FlashInferAttentionBackend
from tpserve.attention.torch_backend import TorchAttentionBackend
from tpserve.config import FLASHINFER_DTYPES
from tpserve.engine_config import CHOICES
from tpserve.kernels import optional_import
from tpserve.kvcache.pool import KVCachePool

logger = logging.getLogger(__name__)


def resolve_backend_name(name: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
    """``auto`` is flashinfer on CUDA in half precision when it imports, else torch."""
    if name not in CHOICES["attention_backend"]:
        raise ValueError(f"unknown attention backend {name!r} (choose {', '.join(CHOICES['attention_backend'])})")
    if name != "auto" or device.type != "cuda":
        return name if name != "auto" else "torch"
    if dtype not in FLASHINFER_DTYPES:
        logger.info("FlashInfer attention takes bfloat16 and float16 only: torch attention for %s", dtype)
        return "torch"
    return "flashinfer" if optional_import("flashinfer") is not None else "torch"


def create_backend(
    name: str,
    pool: KVCachePool,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
    fused_rope_store: bool = False,
    decode_attention: str = "auto",
    scale: float | None = None,
    layer_windows: tuple[int, ...] = (),
    softcap: float | None = None,
    rows_per_sequence: int = 1,
) -> AttentionBackend:
    """``scale``: the softmax scale (None: head_dim ** -0.5); ``layer_windows``: each layer's sliding window (0: none);
    ``softcap``: the attention logit soft-cap (None: none); ``rows_per_sequence``: the most one-token rows a
    sequence has in a decode step (1 + its drafts: ``engine/batch.py`` ``one_token_rows``)."""
    if resolve_backend_name(name, device, pool.compute_dtype) == "flashinfer":
        return FlashInferAttentionBackend(
            pool, num_heads, num_kv_heads, head_dim, device, fused_rope_store, decode_kernel=decode_attention,
            scale=scale, layer_windows=layer_windows, softcap=softcap, rows_per_sequence=rows_per_sequence,
        )
    if decode_attention in ("xqa", "triton"):
        raise ValueError(
            f"decode attention {decode_attention} is a kernel of the flashinfer attention backend, which is not in use"
        )
    return TorchAttentionBackend(pool, num_heads, num_kv_heads, head_dim, fused_rope_store, scale, layer_windows,
                                 softcap)
