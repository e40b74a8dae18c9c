"""LoRAWeights: only filled slots are read; a cleared slot is zero and skipped."""

from __future__ import annotations

import torch

from tpserve.layers.lora import LoRABatch, LoRAWeights


def test_filled_slots_only_and_clear_zeroes():
    weights = LoRAWeights(3, 1, 2, 4, 5, torch.device("cpu"), torch.float32)
    weights.a[2].normal_()
    weights.b[2].normal_()
    weights.filled.add(2)
    x = torch.randn(3, 4)
    batch = LoRABatch(torch.tensor([2, 0, 1]), (1, 2))
    assert weights.adapts(batch) and not weights.adapts(LoRABatch(torch.tensor([1]), (1,)))
    expected = (x[0] @ weights.a[2].T) @ weights.b[2].T
    out = weights.delta(x, batch)
    assert torch.allclose(out[0], expected) and not out[1:].any()
    weights.clear(2)
    assert not weights.adapts(batch) and not weights.a.any() and not weights.b.any()
