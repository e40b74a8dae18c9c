"""Applying grammar token bitmasks to logits: plain torch, the same on CPU and GPU and on every
TP rank (the masks are the same because every rank's matchers saw the same tokens)."""

from __future__ import annotations

import torch


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 (bit j of word w allows token 32 w + j) -> [R, vocab_size] bool allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: disallowed tokens of the given rows get -inf."""
    allowed = unpack_bitmask(bitmask, logits.shape[-1])
    sub = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows, sub)
