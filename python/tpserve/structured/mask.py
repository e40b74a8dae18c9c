"""Applying grammar token bitmasks to logits in place with xgrammar's kernels (C++ on the CPU,
Triton on a GPU), where the sampler does not apply them itself (its unfiltered GPU kernel reads
the bitmask with the logits: ``kernels/sampling.py``); the same on every TP rank (the masks are the
same because every rank's matchers saw the same tokens)."""

from __future__ import annotations

import torch

from tpserve.kernels import use_triton


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 (bit j of word w allows token 32 w + j) -> [R, vocab_size] bool allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | torch.Tensor | None = None) -> None:
    """In place: for each row r in ``rows`` (default: every row), the tokens that ``bitmask[r]``
    does not allow get -inf in ``logits[r]``. ``bitmask`` is on the logits' device; on a GPU
    ``rows`` is an int32 device tensor, on the CPU a list."""
    from xgrammar.matcher import apply_token_bitmask_inplace

    vocab_size = logits.shape[-1]
    if logits.device.type == "cpu":
        backend = "cpu"
    else:
        backend = "triton" if use_triton(logits.device) else "torch_native"
    apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=rows, backend=backend)


def warm_up(logits: torch.Tensor) -> None:
    """Compile the GPU kernel now rather than in the middle of serving."""
    bitmask = torch.full((logits.shape[0], -(-logits.shape[-1] // 32)), -1, dtype=torch.int32, device=logits.device)
    apply_bitmask(logits, bitmask)
