"""One step's data, as the engine builds it and the attention backends and the model read it
(below all three: this module imports none of them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:  # annotation only: attention sits above this module
    from tpserve.attention.base import AttentionBackend
    from tpserve.layers.lora import LoRABatch


@dataclass
class SequenceInput:
    """One request's part of a step: its new tokens on top of ``prefix_len`` cached ones."""

    token_ids: list[int]
    prefix_len: int
    page_table: list[int]  # pages holding positions [0, prefix_len + len(token_ids))
    # the first this many new tokens' logits are wanted too (prompt log-probabilities), after the last one's
    extra_logits: int = 0
    pooled: bool = False  # its last new token's final hidden state (or class logits) is wanted too (a pooled request)
    lora: int = 0  # its LoRA adapter's slot (models/adapters.py); 0: none

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
    # [B + E] index in T of each sequence's last new token, then of the E tokens in ``extra_logits``: the LM
    # head's rows; None where those are all T tokens in order (one token a sequence: decode)
    last_indices: torch.Tensor | None
    attn: object
    # [P] rows of the LM head's input whose hidden states the step returns (``SequenceInput.pooled``); None: none
    pooled_rows: torch.Tensor | None = None


@dataclass
class ForwardContext:
    """What every layer needs for one step, passed explicitly down the model."""

    inputs: ForwardInputs
    attention: AttentionBackend
    pooled: torch.Tensor | None = None  # set by the model: [P, hidden] final hidden states of ``inputs.pooled_rows``
    lora: LoRABatch | None = None  # the step's LoRA adapters, where a sequence has one


def int_array(values, count: int) -> np.ndarray:
    return np.fromiter(values, dtype=np.int64, count=count)


def check_page_tables(seqs: list[SequenceInput], seq_lens: np.ndarray, page_size: int) -> None:
    table_lens = int_array((len(s.page_table) for s in seqs), len(seqs))
    short = np.flatnonzero(-(-seq_lens // page_size) > table_lens)
    if short.size:
        b = int(short[0])
        raise ValueError(f"page table of {table_lens[b]} pages is too short for {seq_lens[b]} tokens")


def resolve_future_tokens(input_ids: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """Replace each placeholder -(r + 1) by ``previous[r]``, on the device (no host sync)."""
    rows = (-input_ids - 1).clamp(min=0, max=previous.numel() - 1)
    return torch.where(input_ids < 0, previous[rows], input_ids)
