"""One step's sequences flattened into host arrays and device tensors."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from tpserve.forward import ForwardInputs, SequenceInput, check_page_tables, int_array
from tpserve.layers.lora import LoRABatch


@dataclass
class HostBatch:
    """A step's per-token arrays on the host, built without a Python loop over tokens."""

    tokens: np.ndarray  # [3, T] int64 rows: token ids, positions, flat KV slots
    last_indices: np.ndarray  # [B + E] int64: each sequence's last token, then the extra logits rows


def build_host_batch(seqs: list[SequenceInput], page_size: int) -> HostBatch:
    if not seqs:
        raise ValueError("a step needs at least one sequence")
    batch = len(seqs)
    extend = int_array((len(s.token_ids) for s in seqs), batch)
    prefix = int_array((s.prefix_len for s in seqs), batch)
    if (extend < 1).any():
        raise ValueError("every sequence of a step needs at least one new token")
    seq_lens = prefix + extend
    check_page_tables(seqs, seq_lens, page_size)
    ends = np.cumsum(extend)
    total = int(ends[-1])

    tokens = np.empty((3, total), dtype=np.int64)
    tokens[0] = int_array(chain.from_iterable(s.token_ids for s in seqs), total)
    positions = np.arange(total, dtype=np.int64) + np.repeat(prefix - (ends - extend), extend)
    tokens[1] = positions
    # Only the pages the new tokens land on: [prefix // page_size, (seq_len - 1) // page_size].
    first_page = prefix // page_size
    page_counts = (seq_lens - 1) // page_size - first_page + 1
    pages = int_array(
        chain.from_iterable(
            s.page_table[f : f + c] for s, f, c in zip(seqs, first_page.tolist(), page_counts.tolist())
        ),
        int(page_counts.sum()),
    )
    page_base = np.cumsum(page_counts) - page_counts
    page_index = np.repeat(page_base - first_page, extend) + positions // page_size
    tokens[2] = pages[page_index] * page_size + positions % page_size
    return HostBatch(tokens, head_rows(seqs, ends))


def head_rows(seqs: list[SequenceInput], ends: np.ndarray) -> np.ndarray:
    """The LM head's rows among a step's tokens (``ends``: where each sequence's new tokens end): each sequence's last
    token, then the first ``extra_logits`` tokens of each."""
    starts = ends - int_array((len(s.token_ids) for s in seqs), len(seqs))
    extra = [np.arange(start, start + s.extra_logits) for s, start in zip(seqs, starts.tolist()) if s.extra_logits]
    return np.concatenate([ends - 1, *extra]) if extra else ends - 1


@dataclass
class OneTokenRows:
    """A step of short multi-token sequences as one-token rows, so a decode CUDA graph can run it."""

    seqs: list[SequenceInput]  # a row per token: its sequence's pages, its own position
    order: np.ndarray  # [B + E] int64: the rows whose logits the step's LM head rows are, in their order


def one_token_rows(seqs: list[SequenceInput], most: int) -> OneTokenRows | None:
    """``seqs`` as one-token rows where every sequence has at most ``most`` new tokens and wants each one's logits
    (a drafted step: the last token and, as extra rows, its drafts' positions); None otherwise. A row attends to its
    sequence's cache up to its own position, which holds the rows before it: every layer stores the step's K/V
    before attention reads them (decode kernels that read keys before that store must re-read the newest ``most``:
    ``TritonDecode``'s ``fresh_tokens``)."""
    if most < 2 or any(
        len(s.token_ids) > most or s.extra_logits != len(s.token_ids) - 1 or s.pooled for s in seqs
    ) or all(len(s.token_ids) == 1 for s in seqs):
        return None
    rows = [SequenceInput([token], s.prefix_len + i, s.page_table, lora=s.lora)
            for s in seqs for i, token in enumerate(s.token_ids)]
    return OneTokenRows(rows, head_rows(seqs, np.cumsum(int_array((len(s.token_ids) for s in seqs), len(seqs)))))


def upload(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` copied to ``device`` without blocking the host. On a GPU through pinned memory: a copy
    from pageable memory is staged by the driver and may first wait for the work queued before it
    (the step in flight), undoing overlap scheduling."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    # the caching host allocator reuses the pinned block only once this copy has run
    return host.pin_memory().to(device, non_blocking=True)


def lora_batch(seqs: list[SequenceInput], device: torch.device) -> LoRABatch | None:
    """Each token's LoRA slot (its sequence's), or None where no sequence has an adapter."""
    slots = sorted({s.lora for s in seqs if s.lora})
    if not slots:
        return None
    counts = int_array((len(s.token_ids) for s in seqs), len(seqs))
    ids = np.repeat(int_array((s.lora for s in seqs), len(seqs)), counts)
    return LoRABatch(upload(torch.from_numpy(ids), device), tuple(slots))


def build_forward_inputs(
    seqs: list[SequenceInput], page_size: int, device: torch.device, attn: object
) -> ForwardInputs:
    host = build_host_batch(seqs, page_size)
    total, batch = host.tokens.shape[1], len(host.last_indices)
    identity = len(seqs) == total == batch  # one token a sequence, no extra rows: every token is a head row, in order
    # One upload for all the index arrays, each 16-byte aligned (an even offset): Triton compiles a
    # kernel variant per pointer alignment.
    row = total + total % 2
    packed = np.zeros(3 * row + (0 if identity else batch), dtype=np.int64)
    packed[: 3 * row].reshape(3, row)[:, :total] = host.tokens
    if not identity:
        packed[3 * row :] = host.last_indices
    flat = upload(torch.from_numpy(packed), device)
    pooled = [i for i, s in enumerate(seqs) if s.pooled]
    return ForwardInputs(
        input_ids=flat[:total],
        positions=flat[row : row + total],
        out_slots=flat[2 * row : 2 * row + total],
        last_indices=None if identity else flat[3 * row :],
        attn=attn,
        pooled_rows=upload(torch.tensor(pooled, dtype=torch.int64), device) if pooled else None,
    )
