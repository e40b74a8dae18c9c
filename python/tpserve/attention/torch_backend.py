"""Attention in plain torch over the paged cache: the CPU path and the reference.

All sequences of a step (prefills, chunks and decodes alike) are padded into one
[B, max_new, heads, dim] query block against a [B, max_len] gather of their cached keys, with a
mask that is causal from each sequence's prefix length. One SDPA call per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tpserve.attention.base import AttentionBackend
from tpserve.forward import SequenceInput


@dataclass
class TorchAttentionMetadata:
    query_index: torch.Tensor  # [B, max_new] index into the step's T tokens (T = padding row)
    kv_slots: torch.Tensor  # [B, max_len] flat cache slots (slot 0 = scratch for padding)
    mask: torch.Tensor  # [B, 1, max_new, max_len] True where attention is allowed
    token_rows: torch.Tensor  # [T] row of each real token in the flattened [B * max_new] block


class TorchAttentionBackend(AttentionBackend):
    def describe(self) -> str:
        return "torch attention"

    def prepare(self, seqs: list[SequenceInput], device: torch.device) -> TorchAttentionMetadata:
        page_size = self.pool.page_size
        new_len = torch.tensor([s.extend_len for s in seqs])
        prefix_len = torch.tensor([s.prefix_len for s in seqs])
        max_new, max_len = int(new_len.max()), int((prefix_len + new_len).max())
        kv_slots = torch.zeros((len(seqs), max_len), dtype=torch.int64)
        for b, seq in enumerate(seqs):
            positions = torch.arange(seq.seq_len)
            pages = torch.tensor(seq.page_table, dtype=torch.int64)[positions // page_size]
            kv_slots[b, : seq.seq_len] = pages * page_size + positions % page_size
        cols = torch.arange(max_new)
        real = cols[None, :] < new_len[:, None]  # [B, max_new], False on padding rows
        starts = new_len.cumsum(0) - new_len
        query_index = torch.where(real, starts[:, None] + cols, int(new_len.sum()))
        k_pos = torch.arange(max_len)
        causal = k_pos <= (prefix_len[:, None] + cols)[:, :, None]
        # Padding query rows attend to key 0 only, so they stay finite; their output is dropped.
        mask = torch.where(real[:, :, None], causal, k_pos == 0)
        return TorchAttentionMetadata(
            query_index=query_index.to(device),
            kv_slots=kv_slots.to(device),
            mask=mask.unsqueeze(1).to(device),
            token_rows=real.flatten().nonzero().squeeze(1).to(device),
        )

    def attend(self, layer: int, q: torch.Tensor, meta: TorchAttentionMetadata) -> torch.Tensor:
        k_cache = self.pool.k[layer].view(-1, self.num_kv_heads, self.head_dim)
        v_cache = self.pool.v[layer].view(-1, self.num_kv_heads, self.head_dim)
        q_padded = torch.cat([q, q.new_zeros(1, *q.shape[1:])])[meta.query_index]  # [B, N, H, D]
        keys = self.pool.read(k_cache[meta.kv_slots])  # [B, L, Hkv, D]
        values = self.pool.read(v_cache[meta.kv_slots])
        out = F.scaled_dot_product_attention(
            q_padded.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=meta.mask,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )  # [B, H, N, D]
        out = out.transpose(1, 2).reshape(-1, self.num_heads, self.head_dim)
        return out[meta.token_rows]
