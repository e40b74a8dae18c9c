"""One step's work, as the scheduler hands it to the engine."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
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


@dataclass
class HostBatch:
    """A step's per-token arrays on the host, built without a Python loop over tokens."""

    tokens: np.ndarray  # [3, T] int64 rows: token ids, positions, flat KV slots
    last_indices: np.ndarray  # [B] int64
    prefix_lens: np.ndarray  # [B] int64
    extend_lens: np.ndarray  # [B] int64

    @property
    def seq_lens(self) -> np.ndarray:
        return self.prefix_lens + self.extend_lens

    @property
    def is_decode(self) -> bool:
        return bool((self.extend_lens == 1).all())


def _int_array(values, count: int) -> np.ndarray:
    return np.fromiter(values, dtype=np.int64, count=count)


def check_page_tables(seqs: list[SequenceInput], seq_lens: np.ndarray, page_size: int) -> None:
    table_lens = _int_array((len(s.page_table) for s in seqs), len(seqs))
    short = np.flatnonzero(-(-seq_lens // page_size) > table_lens)
    if short.size:
        b = int(short[0])
        raise ValueError(f"page table of {table_lens[b]} pages is too short for {seq_lens[b]} tokens")


def build_host_batch(seqs: list[SequenceInput], page_size: int) -> HostBatch:
    if not seqs:
        raise ValueError("a step needs at least one sequence")
    batch = len(seqs)
    extend = _int_array((len(s.token_ids) for s in seqs), batch)
    prefix = _int_array((s.prefix_len for s in seqs), batch)
    if (extend < 1).any():
        raise ValueError("every sequence of a step needs at least one new token")
    seq_lens = prefix + extend
    check_page_tables(seqs, seq_lens, page_size)
    ends = np.cumsum(extend)
    total = int(ends[-1])

    tokens = np.empty((3, total), dtype=np.int64)
    tokens[0] = _int_array(chain.from_iterable(s.token_ids for s in seqs), total)
    positions = np.arange(total, dtype=np.int64) + np.repeat(prefix - (ends - extend), extend)
    tokens[1] = positions
    # Only the pages the new tokens land on: [prefix // page_size, (seq_len - 1) // page_size].
    first_page = prefix // page_size
    page_counts = (seq_lens - 1) // page_size - first_page + 1
    pages = _int_array(
        chain.from_iterable(
            s.page_table[f : f + c] for s, f, c in zip(seqs, first_page.tolist(), page_counts.tolist())
        ),
        int(page_counts.sum()),
    )
    page_base = np.cumsum(page_counts) - page_counts
    page_index = np.repeat(page_base - first_page, extend) + positions // page_size
    tokens[2] = pages[page_index] * page_size + positions % page_size
    return HostBatch(tokens, ends - 1, prefix, extend)


def build_forward_inputs(
    seqs: list[SequenceInput], page_size: int, device: torch.device, attn: object
) -> ForwardInputs:
    host = build_host_batch(seqs, page_size)
    total, batch = host.tokens.shape[1], len(seqs)
    # One host-to-device copy for all four index arrays, each starting 16-byte aligned (an
    # even offset): Triton compiles a kernel variant per pointer alignment.
    row = total + total % 2
    packed = np.zeros(3 * row + batch, dtype=np.int64)
    packed[: 3 * row].reshape(3, row)[:, :total] = host.tokens
    packed[3 * row :] = host.last_indices
    flat = torch.from_numpy(packed).to(device, non_blocking=True)
    return ForwardInputs(
        input_ids=flat[:total],
        positions=flat[row : row + total],
        out_slots=flat[2 * row : 2 * row + total],
        last_indices=flat[3 * row :],
        attn=attn,
    )


def resolve_future_tokens(input_ids: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """Replace each placeholder -(r + 1) by ``previous[r]``, on the device (no host sync)."""
    rows = (-input_ids - 1).clamp(min=0, max=previous.numel() - 1)
    return torch.where(input_ids < 0, previous[rows], input_ids)
