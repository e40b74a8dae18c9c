"""Decode attention through FlashInfer's XQA kernel (TensorRT-LLM's decode kernel).

Over FP8 pages on Hopper XQA computes in FP8 (q and the softmax weights rounded to e4m3: 1.6%
error against fp32, the decode wrapper 0.1%) and takes 0.53-0.73x the wrapper's time on one H200
(`benchmarks/experiments/xqa_decode.py`, heads 16:2 to 64:8). Over bf16 pages whole batch-1 steps
were not faster (0.94-1.16x; with the graphs' ``max_model_len``-wide page table bf16 XQA alone is
1.1-1.4x slower, FP8 is not; docs/benchmarks.md). So ``auto`` takes XQA for FP8 caches only.

XQA reads a dense page table ``[batch, pages]`` and lengths (``attention/page_table.py``), not
FlashInfer's CSR table. Its workspace starts with semaphores that every call leaves at zero: a
buffer of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from tpserve.attention.page_table import TableMetadata

if TYPE_CHECKING:
    from tpserve.kvcache.pool import KVCachePool

SEMAPHORE_BYTES = 8 * 2**20  # the workspace's head, as flashinfer.decode lays it out
SCRATCH_BYTES = 56 * 2**20  # multi-block partial results: < 1 MiB at 132 SMs x head_dim 128
PAGE_SIZES = (16, 32, 64, 128)


def shape_unsupported_reason(page_size: int, head_dim: int, num_heads: int, num_kv_heads: int) -> str | None:
    """Why XQA's kernels cannot take this cache layout, or None when they can."""
    if page_size not in PAGE_SIZES:
        return f"XQA takes page sizes {PAGE_SIZES}, not {page_size}"
    if head_dim % 16 or not 16 <= head_dim <= 256:
        return f"XQA takes head_dim a multiple of 16 up to 256, not {head_dim}"
    if num_heads % num_kv_heads:
        return f"{num_heads} query heads do not group over {num_kv_heads} KV heads"
    return None


def attention_unsupported_reason(windowed: bool, softcap: float | None) -> str | None:
    """Why tpserve does not run XQA on this model's attention (a sliding window, a logit soft-cap), or None."""
    if windowed:
        return "tpserve does not run XQA with sliding-window attention"
    if softcap is not None:
        return "tpserve does not run XQA with attention logit soft-capping"
    return None


def unsupported_reason(
    flashinfer: ModuleType, device: torch.device, page_size: int, head_dim: int, num_heads: int, num_kv_heads: int
) -> str | None:
    """Why XQA cannot run this configuration, or None when it can."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return "XQA decode runs here on Hopper (sm90) GPUs only"
    if xqa_function() is None:
        return f"flashinfer {getattr(flashinfer, '__version__', '?')} has no XQA kernel"
    return shape_unsupported_reason(page_size, head_dim, num_heads, num_kv_heads)


def xqa_function() -> Callable | None:
    """``flashinfer.xqa.xqa`` (the package's ``xqa`` attribute is that function, not the module)."""
    try:
        return import_module("flashinfer.xqa").xqa
    except (ImportError, AttributeError):
        return None


class XqaDecode:
    """XQA over one engine's cache: its kernel, built at start-up, and its own workspace."""

    name = "XQA"

    def __init__(
        self, pool: KVCachePool, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, device: torch.device,
        pdl: bool = True,
    ) -> None:
        """``pdl``: launch it with programmatic dependent launch. FlashInfer builds XQA's "aggressive" PDL on sm90,
        which loads every 64-key tile but the newest before its wait: a drafted step's rows (``one_token_rows``),
        whose newest keys are that step's, need it off."""
        self.kernel = xqa_function()
        # FlashInfer compiles XQA for each layout on first use: do it now, not in a served step.
        import_module("flashinfer.xqa").get_xqa_module(
            pool.compute_dtype, pool.dtype, pool.page_size, head_dim, num_heads // num_kv_heads, False,
            pool.compute_dtype, 1,
        )
        self.num_kv_heads = num_kv_heads
        self.page_size = pool.page_size
        self.q_scale = scale * head_dim**0.5  # XQA scales by 1/sqrt(head_dim) itself
        self.workspace = torch.zeros(SEMAPHORE_BYTES + SCRATCH_BYTES, dtype=torch.uint8, device=device)
        self.sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        self.pdl = pdl

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: TableMetadata,
            window: int = 0) -> torch.Tensor:
        if window:  # the backend never builds XQA for a windowed model
            raise ValueError("XQA decode is not run with a sliding window in tpserve")
        q = q.contiguous()
        out = torch.empty_like(q)
        self.kernel(
            q.unsqueeze(1),  # [batch, beam 1, heads, head_dim]
            k_cache,
            v_cache,
            meta.page_table,
            meta.seq_lens.unsqueeze(1),
            out.unsqueeze(1),
            self.workspace[SEMAPHORE_BYTES:],
            self.workspace[:SEMAPHORE_BYTES],
            self.num_kv_heads,
            self.page_size,
            q_scale=self.q_scale,
            kv_scale=1.0,  # tpserve's FP8 pages hold k and v as they are
            sm_count=self.sm_count,
            enable_pdl=self.pdl,
        )
        return out
