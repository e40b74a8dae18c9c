"""One step's work, as the scheduler hands it to the engine."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SequenceInput:
    """One request's part of a step: its new tokens on top of ``prefix_len`` cached ones."""

    token_ids: list[int]
    prefix_len: int
    page_table: list[int]  # pages holding positions [0, prefix_len + len(token_ids))

    @property
    def extend_len(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        return self.prefix_len + len(self.token_ids)


@dataclass
class ForwardInputs:
    """Flattened device tensors for one step; ``attn`` is the backend's own metadata."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_slots: torch.Tensor  # [T] flat KV slot of each new token
    last_indices: torch.Tensor  # [B] index in T of each sequence's last new token
    attn: object


def build_forward_inputs(
    seqs: list[SequenceInput], page_size: int, device: torch.device, attn: object
) -> ForwardInputs:
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    last: list[int] = []
    for seq in seqs:
        if (seq.seq_len + page_size - 1) // page_size > len(seq.page_table):
            raise ValueError(f"page table of {len(seq.page_table)} pages is too short for {seq.seq_len} tokens")
        ids.extend(seq.token_ids)
        for pos in range(seq.prefix_len, seq.seq_len):
            positions.append(pos)
            slots.append(seq.page_table[pos // page_size] * page_size + pos % page_size)
        last.append(len(ids) - 1)

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

    return ForwardInputs(tensor(ids), tensor(positions), tensor(slots), tensor(last), attn)
