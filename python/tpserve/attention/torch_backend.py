"""Attention in plain torch over the paged cache: the CPU path and the reference (sliding windows as masks; a logit
soft-cap, which SDPA lacks, in plain torch).

A step's sequences are grouped by size (new tokens and cached length, each to the next power of two); each group
is padded into one [B, max_new, heads, dim] query block against a [B, max_len] gather of its cached keys, with a
mask that is causal from each sequence's prefix length: one SDPA call per group and layer. Padding the whole step
into one block made its cost B x the longest chunk x the longest context: a 3,000-token prompt among 116 decodes
held a CPU server's step for 100 s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tpserve.attention.base import AttentionBackend
from tpserve.forward import SequenceInput


@dataclass
class TorchAttentionGroup:
    query_index: torch.Tensor  # [B, max_new] index into the step's T tokens (T = padding row)
    kv_slots: torch.Tensor  # [B, max_len] flat cache slots (slot 0 = scratch for padding)
    masks: dict[int, torch.Tensor]  # by window (0: none): [B, 1, max_new, max_len] True where attention is allowed
    token_rows: torch.Tensor  # [t] row of each real token in the flattened [B * max_new] block
    tokens: torch.Tensor  # [t] those tokens' indices in the step


@dataclass
class TorchAttentionMetadata:
    groups: list[TorchAttentionGroup]
    num_tokens: int  # T, the step's tokens


CAPPED_SCORES = 1 << 24  # float32 scores a soft-capped attention holds at once (64 MiB)


class TorchAttentionBackend(AttentionBackend):
    def describe(self) -> str:
        return "torch attention" + self.describe_scores()

    def prepare(self, seqs: list[SequenceInput], device: torch.device) -> TorchAttentionMetadata:
        starts, total = [], 0
        for seq in seqs:
            starts.append(total)
            total += seq.extend_len
        by_size: dict[tuple[int, int], list[int]] = {}
        for b, seq in enumerate(seqs):
            by_size.setdefault((seq.extend_len.bit_length(), seq.seq_len.bit_length()), []).append(b)
        groups = [self._group([seqs[b] for b in members], [starts[b] for b in members], total, device)
                  for members in by_size.values()]
        return TorchAttentionMetadata(groups, total)

    def _group(self, seqs: list[SequenceInput], starts: list[int], total: int,
               device: torch.device) -> TorchAttentionGroup:
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
        query_index = torch.where(real, torch.tensor(starts)[:, None] + cols, total)
        k_pos = torch.arange(max_len)
        q_pos = (prefix_len[:, None] + cols)[:, :, None]
        masks = {}
        for window in self.windows:
            allowed = (k_pos <= q_pos) & (k_pos > q_pos - window) if window else k_pos <= q_pos
            # Padding query rows attend to key 0 only, so they stay finite; their output is dropped.
            masks[window] = torch.where(real[:, :, None], allowed, k_pos == 0).unsqueeze(1).to(device)
        token_rows = real.flatten().nonzero().squeeze(1)
        return TorchAttentionGroup(
            query_index=query_index.to(device),
            kv_slots=kv_slots.to(device),
            masks=masks,
            token_rows=token_rows.to(device),
            tokens=query_index.flatten()[token_rows].to(device),
        )

    def attend(self, layer: int, q: torch.Tensor, meta: TorchAttentionMetadata) -> torch.Tensor:
        k_cache = self.pool.k[layer].view(-1, self.num_kv_heads, self.head_dim)
        v_cache = self.pool.v[layer].view(-1, self.num_kv_heads, self.head_dim)
        q_rows = torch.cat([q, q.new_zeros(1, *q.shape[1:])])
        out = q.new_empty(meta.num_tokens, self.num_heads, self.head_dim)
        for group in meta.groups:
            keys = self.pool.read(k_cache[group.kv_slots])  # [B, L, Hkv, D]
            values = self.pool.read(v_cache[group.kv_slots])
            queries = q_rows[group.query_index].transpose(1, 2)  # [B, H, N, D]
            mask = group.masks[self.window(layer)]
            if self.softcap is None:
                attended = F.scaled_dot_product_attention(
                    queries, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=self.scale,
                    enable_gqa=self.num_heads != self.num_kv_heads,
                )  # [B, H, N, D]
            else:
                attended = self._capped(queries, keys.transpose(1, 2), values.transpose(1, 2), mask)
            out[group.tokens] = attended.transpose(1, 2).reshape(-1, self.num_heads, self.head_dim)[group.token_rows]
        return out

    def _capped(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """SDPA's attention with soft-capped scores, as transformers' eager attention computes it: q [B, H, N, D], k and
        v [B, Hkv, L, D], mask [B, 1, N, L] -> [B, H, N, D]. Scores and softmax in float32, CAPPED_SCORES at a time
        (query rows in blocks: a long prefill chunk's whole [B, H, N, L] scores would take gigabytes a layer)."""
        group = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1).float(), v.repeat_interleave(group, dim=1)
        rows = max(1, CAPPED_SCORES // (q.shape[0] * q.shape[1] * k.shape[2]))
        out = torch.empty_like(q)
        for start in range(0, q.shape[2], rows):
            block = slice(start, start + rows)
            scores = torch.matmul(q[:, :, block].float(), k.transpose(2, 3)) * self.scale
            scores = torch.tanh(scores / self.softcap) * self.softcap
            weights = scores.masked_fill(~mask[:, :, block], float("-inf")).softmax(dim=-1)
            out[:, :, block] = torch.matmul(weights.to(v.dtype), v)
        return out
