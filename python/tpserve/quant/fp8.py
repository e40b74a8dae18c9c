"""FP8 (e4m3) block quantization in torch (the CPU path and the GPU kernels' reference): per (bn, bk)
block ``w = w_fp8 * weight_scale_inv``; activations per token and group of bk features ("dynamic")."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_MIN_AMAX = 1e-10  # a block of zeros still gets a usable (non-zero) scale


@dataclass(frozen=True)
class ExpertScales:
    """FP8 experts' float32 block scales (the real weight is ``weight * scale`` per bn x bk block, as the
    checkpoint's ``weight_scale_inv``): gate_up [E, 2, ceil(I / bn), ceil(H / bk)] (gate, then up) for
    gate_up [E, 2I, H], down [E, ceil(H / bn), ceil(I / bk)] for down [E, H, I]."""

    gate_up: torch.Tensor
    down: torch.Tensor
    block: tuple[int, int]


def num_blocks(size: int, block: int) -> int:
    return -(-size // block)


def _expand(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    """Each block's scale repeated over its elements, cut to ``shape``."""
    bn, bk = block
    return scale.repeat_interleave(bn, dim=0).repeat_interleave(bk, dim=1)[: shape[0], : shape[1]]


def per_row_scales(loaded: torch.Tensor, rows: int, name: str) -> torch.Tensor:
    """A checkpoint's scale per output row ([rows, 1] or [rows]) or per tensor (one element), as [rows]."""
    if loaded.numel() == 1:
        return loaded.reshape(1).expand(rows)
    if (loaded.dim() == 1 or loaded.dim() == 2 and loaded.shape[1] == 1) and loaded.numel() == rows:
        return loaded.reshape(-1)
    raise ValueError(f"{name}: expected one scale per output row ({rows}, or [{rows}, 1]) or per tensor, got shape "
                     f"{tuple(loaded.shape)}")


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv per block): each block's amax maps to FP8_MAX."""
    n, k = weight.shape
    bn, bk = block
    rows, cols = num_blocks(n, bn), num_blocks(k, bk)
    padded = F.pad(weight.float(), (0, cols * bk - k, 0, rows * bn - n))
    amax = padded.abs().view(rows, bn, cols, bk).amax(dim=(1, 3)).clamp_min(_MIN_AMAX)
    scale_inv = amax / FP8_MAX
    q = (weight.float() / _expand(scale_inv, weight.shape, block)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale_inv


def dequantize_blocks(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """``weight * scale_inv`` per block, in float32, then rounded once to ``dtype``."""
    return (weight.float() * _expand(scale_inv.float(), weight.shape, block)).to(dtype)


def quantize_experts(
    gate_up: torch.Tensor, down: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, ExpertScales]:
    """Stacked experts (gate_up [E, 2I, H] as [gate; up], down [E, H, I]) in FP8 as an FP8 checkpoint holds them: each
    expert's gate, up and down quantized apart in ``block`` blocks."""
    inter = gate_up.shape[1] // 2
    gate_up_q, gate_up_s, down_q, down_s = [], [], [], []
    for e in range(gate_up.shape[0]):
        parts = [quantize_blocks(gate_up[e, p * inter:(p + 1) * inter], block) for p in (0, 1)]
        gate_up_q.append(torch.cat([q for q, _ in parts]))
        gate_up_s.append(torch.stack([s for _, s in parts]))
        q, s = quantize_blocks(down[e], block)
        down_q.append(q)
        down_s.append(s)
    scales = ExpertScales(torch.stack(gate_up_s), torch.stack(down_s), block)
    return torch.stack(gate_up_q), torch.stack(down_q), scales


def dequantize_experts(
    gate_up: torch.Tensor, down: torch.Tensor, scales: ExpertScales, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 experts (``quantize_experts``' layout) in ``dtype``, one expert at a time."""
    inter = gate_up.shape[1] // 2
    gate_up_out = torch.empty(gate_up.shape, dtype=dtype, device=gate_up.device)
    down_out = torch.empty(down.shape, dtype=dtype, device=down.device)
    for e in range(gate_up.shape[0]):
        for part in (0, 1):
            rows = slice(part * inter, (part + 1) * inter)
            gate_up_out[e, rows] = dequantize_blocks(gate_up[e, rows], scales.gate_up[e, part], scales.block, dtype)
        down_out[e] = dequantize_blocks(down[e], scales.down[e], scales.block, dtype)
    return gate_up_out, down_out


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn x, float32 scale_inv [M, ceil(K / group)]): per token and ``group`` features."""
    return quantize_blocks(x.reshape(-1, x.shape[-1]), (1, group))


def fp8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """What the block GEMMs (Triton's W8A8, FlashInfer's) compute, in float32 torch: x quantized
    per token and bk-group, times the fp8 weight (the CPU path keeps activations unquantized)."""
    xq, xs = quantize_activations(x, block[1])
    a = dequantize_blocks(xq, xs, (1, block[1]), torch.float32)
    w = dequantize_blocks(weight, scale_inv, block, torch.float32)
    return (a @ w.T).to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def weight_only_reference(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """What the one-token CUDA GEMV (``kernels.gemv``) computes: x times the dequantized weight in float32."""
    w = dequantize_blocks(weight, scale_inv, block, torch.float32)
    return (x.float() @ w.T).to(x.dtype)
