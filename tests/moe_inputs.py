"""Random MoE expert inputs for the kernel tests: tokens, stacked expert weights and a top-k routing."""

from __future__ import annotations

import torch


def expert_inputs(tokens: int, experts: int, top_k: int, hidden: int, inter: int, seed: int,
                  dtype: torch.dtype = torch.bfloat16, device: str = "cuda"):
    """(x [T, H], gate_up [E, 2I, H], down [E, H, I], weights [T, k] (renormalised), ids [T, k])."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen, device=device).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen, device=device) / hidden**0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=gen, device=device) / inter**0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen, device=device)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    return x, gate_up, down, (weights / weights.sum(-1, keepdim=True)).to(dtype), ids
