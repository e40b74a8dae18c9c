"""Rotary position embedding (neox style, rotate-half), with Llama 3 frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch

from tpserve.kernels import FLASHINFER_DTYPES, use_flashinfer, use_triton


def inverse_frequencies(head_dim: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    # Same float32 arithmetic as transformers, so positions encode bit-identically.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Holds a [max_positions, head_dim] cos/sin table, built on the engine's device after the
    model is materialised (it is not a checkpoint weight).

    On CUDA in half precision it also holds the float32 [max_positions, head_dim] table of the
    fused rotary kernels (FlashInfer's, and tpserve's ``kernels.rope_store``): cos then sin of the
    same angles. With FlashInfer ``forward`` rotates q and k in place and returns its own
    (modified) inputs.
    """

    def __init__(self, head_dim: int, max_positions: int, base: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.base = base
        self.scaling = scaling
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None
        self.cos_sin_cache: torch.Tensor | None = None  # float32, for the fused kernel only

    def build_cache(self, device: torch.device, dtype: torch.dtype) -> None:
        inv_freq = inverse_frequencies(self.head_dim, self.base, self.scaling).to(device)
        positions = torch.arange(self.max_positions, device=device, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos().to(dtype), emb.sin().to(dtype)
        if use_flashinfer(device, dtype) or (use_triton(device) and dtype in FLASHINFER_DTYPES):
            self.cos_sin_cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).contiguous()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D], positions: [T]."""
        if self.cos is None or self.sin is None:
            raise RuntimeError("RotaryEmbedding.build_cache was not called")
        if self.cos_sin_cache is not None and use_flashinfer(q.device, q.dtype):
            from tpserve.kernels.flashinfer_ops import rotary_

            rotary_(positions, q, k, self.cos_sin_cache)
            return q, k
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _apply(q, cos, sin), _apply(k, cos, sin)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
