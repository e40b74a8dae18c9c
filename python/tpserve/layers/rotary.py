"""Rotary position embedding (neox style, rotate-half), with the frequency scalings of
Llama 3, YaRN and linear interpolation."""

from __future__ import annotations

from typing import Any

import torch

from tpserve.config import FLASHINFER_DTYPES
from tpserve.kernels import use_flashinfer, use_triton


def inverse_frequencies(
    head_dim: int, rope_parameters: dict[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2], YaRN's cos/sin scaling or 1) for transformers'
    ``rope_parameters``. Scaled types call transformers' own functions, so positions encode
    bit-identically (the config reader rejects the types whose frequencies change at run time)."""
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type == "default":  # same float32 arithmetic as transformers
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        return 1.0 / (rope_parameters["rope_theta"] ** exponents), 1.0
    from transformers import PreTrainedConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = PreTrainedConfig(
        rope_parameters=dict(rope_parameters),
        head_dim=head_dim,
        hidden_size=head_dim,
        num_attention_heads=1,
        max_position_embeddings=max_position_embeddings,
    )
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device=torch.device("cpu"))
    return inv_freq.float(), float(attention_scaling)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables [max_positions, head_dim] built after materialising (on CUDA in half precision
    also the fused kernels' float32 [cos | sin]); with FlashInfer ``forward`` rotates q, k in place."""

    def __init__(
        self, head_dim: int, max_positions: int, rope_parameters: dict[str, Any], max_position_embeddings: int
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.rope_parameters = rope_parameters
        self.max_position_embeddings = max_position_embeddings
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None
        self.cos_sin_cache: torch.Tensor | None = None

    def build_cache(self, device: torch.device, dtype: torch.dtype) -> None:
        inv_freq, scaling = inverse_frequencies(self.head_dim, self.rope_parameters, self.max_position_embeddings)
        positions = torch.arange(self.max_positions, device=device, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.to(device)[None, :]
        cos, sin = freqs.cos() * scaling, freqs.sin() * scaling  # as transformers: scaled in float32
        self.cos, self.sin = torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((sin, sin), dim=-1).to(dtype)
        if use_flashinfer(device, dtype) or (use_triton(device) and dtype in FLASHINFER_DTYPES):
            self.cos_sin_cache = torch.cat((cos, sin), dim=-1).contiguous()

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
