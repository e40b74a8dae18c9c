"""Grammar bitmasks on logits: xgrammar's fused kernel equals unpacking the bits, only on the
given rows, for the layouts the engine hands it (bf16 rows padded at TP > 1, float32 edits)."""

from __future__ import annotations

import pytest
import torch

from tpserve.structured.mask import apply_bitmask, unpack_bitmask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_bitmask_masks_only_the_given_rows(dtype):
    gen = torch.Generator().manual_seed(0)
    rows, vocab = 6, 1000
    padded = torch.randn(rows, vocab + 24, generator=gen).to(dtype)
    logits = padded[:, :vocab]  # the LM head's layout at TP > 1
    padding = padded[:, vocab:].clone()
    words = -(-vocab // 32)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=gen)
    constrained = [1, 4]
    expected = logits.clone()
    for r in constrained:
        expected[r].masked_fill_(~unpack_bitmask(bitmask[r : r + 1], vocab)[0], float("-inf"))
    apply_bitmask(logits, bitmask, constrained)
    assert torch.equal(logits, expected)
    assert torch.equal(padded[:, vocab:], padding)  # the padding is untouched
    assert torch.isinf(logits[1]).any() and not torch.isinf(logits[0]).any()
