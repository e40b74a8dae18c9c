"""The sort by expert in torch ops (``align_by_expert_torch``, the Triton sort's reference): what it returns, and
that it reads nothing back to the host. A read-back (``.item()``, ``.tolist()``, a tensor's truth value, a
Python scalar set into a tensor) is a stream sync on CUDA: session 30 found one a MoE layer, 48 in a
Qwen3-30B-A3B prefill step. The CPU cannot see a sync, so the torch calls are watched instead."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # tpserve.kernels.moe compiles its kernels' definitions

from no_read_back import NoReadBack  # noqa: E402
from tpserve.kernels.moe import aligned_capacity, align_by_expert_torch  # noqa: E402


def test_no_read_back_catches_a_scalar_set():
    counts = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(AssertionError, match="Python scalar"), NoReadBack():
        counts[3] = 0


@pytest.mark.parametrize("other_ranks", [False, True], ids=["all_experts", "expert_parallel"])
def test_align_by_expert_torch_sorts_without_reading_back(other_ranks):
    experts, top_k, tokens, block_m = 8, 2, 600, 16
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, experts + (1 if other_ranks else 0), (tokens, top_k), generator=gen)
    with NoReadBack():
        sorted_rows, block_expert, padded_len = align_by_expert_torch(ids, experts, block_m)
    flat = ids.flatten()
    used = int(padded_len)
    assert sorted_rows.numel() == aligned_capacity(flat.numel(), experts, block_m)
    rows = sorted_rows[:used]
    real = rows[rows < flat.numel()]
    mine = (flat < experts).nonzero().flatten()
    assert sorted(real.tolist()) == mine.tolist(), "every row of this rank's experts exactly once, others left out"
    for block, expert in enumerate(block_expert[: used // block_m].tolist()):
        chunk = rows[block * block_m:(block + 1) * block_m]
        chunk = chunk[chunk < flat.numel()]
        assert (flat[chunk] == expert).all(), "a block holds one expert's rows"
        assert torch.equal(chunk, chunk.sort().values), "stable: an expert's rows in order"
