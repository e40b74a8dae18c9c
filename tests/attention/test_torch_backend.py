"""The torch attention backend over the paged cache against plain causal attention."""

from __future__ import annotations

import pytest
import torch

from tpserve.attention.torch_backend import TorchAttentionBackend
from tpserve.engine.batch import build_forward_inputs
from tpserve.forward import SequenceInput
from tpserve.kvcache.pool import KVCachePool


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, window: int = 0,
              softcap: float | None = None) -> torch.Tensor:
    """q: [n, H, D] new tokens at positions prefix.., k/v: [prefix + n, Hkv, D]; ``window``: each query attends to
    itself and the window - 1 keys before it (0: all before it); ``softcap``: the scaled scores become
    softcap * tanh(score / softcap) before the mask (transformers' Gemma). In float64."""
    rep = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    k_pos, q_pos = torch.arange(k.shape[0])[None, :], torch.arange(prefix, prefix + q.shape[0])[:, None]
    allowed = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


@pytest.mark.parametrize("window,softcap,capped_scores", [(0, None, None), (4, None, None), (1, None, None),
                                                        (0, 1.0, None), (4, 0.5, None), (4, 0.5, 200), (0, 1.0, 1)])
def test_mixed_prefill_chunk_and_decode_batch(window, softcap, capped_scores, monkeypatch):
    """Layer 1 attends within ``window`` tokens (a sliding window; 0: none), layer 0 to the whole context; every layer
    soft-caps its scores where ``softcap`` is set (Gemma 2's attn_logit_softcapping: plain torch, SDPA has no cap), its
    query rows in blocks of CAPPED_SCORES scores (``capped_scores``: 200 makes blocks of 2 rows or more, 1 of one)."""
    if capped_scores is not None:
        monkeypatch.setattr("tpserve.attention.torch_backend.CAPPED_SCORES", capped_scores)
    torch.manual_seed(0)
    heads, kv_heads, dim, page = 4, 2, 8, 3
    pool = KVCachePool(2, 32, page, kv_heads, dim, torch.float32, torch.device("cpu"))
    backend = TorchAttentionBackend(pool, heads, kv_heads, dim, layer_windows=(0, window), softcap=softcap)
    # (cached prefix, new tokens, page table): a fresh prefill, a chunk on a prefix, a decode, and a prefill and a
    # decode of the first's and the third's sizes (one padded block each pair)
    shapes = [(0, 7, [5, 9, 2]), (4, 5, [1, 3, 4]), (10, 1, [6, 7, 8, 10]), (0, 6, [11, 12]), (9, 1, [13, 14, 15, 16])]
    full_k = [torch.randn(p + n, kv_heads, dim) for p, n, _ in shapes]
    full_v = [torch.randn(p + n, kv_heads, dim) for p, n, _ in shapes]
    # Write each prefix into the cache as earlier steps would have.
    for (p, _, table), k, v in zip(shapes, full_k, full_v):
        if p:
            slots = torch.tensor([table[i // page] * page + i % page for i in range(p)])
            for layer in (0, 1):
                pool.store(layer, slots, k[:p], v[:p])
    seqs = [SequenceInput([1] * n, p, table) for p, n, table in shapes]
    meta = backend.prepare(seqs, torch.device("cpu"))
    assert sorted(tuple(g.masks[0].shape) for g in meta.groups) == [(1, 1, 5, 9), (2, 1, 1, 11), (2, 1, 7, 7)]
    inputs = build_forward_inputs(seqs, page, torch.device("cpu"), meta)
    qs = [torch.randn(n, heads, dim) for _, n, _ in shapes]
    for layer in (0, 1):
        out = backend.forward(
            layer,
            torch.cat(qs),
            torch.cat([k[p:] for (p, _, _), k in zip(shapes, full_k)]),
            torch.cat([v[p:] for (p, _, _), v in zip(shapes, full_v)]),
            inputs.out_slots,
            meta,
        )
        expected = torch.cat([reference(q, k, v, p, (0, window)[layer], softcap)
                              for q, k, v, (p, _, _) in zip(qs, full_k, full_v, shapes)])
        assert torch.allclose(out, expected, atol=1e-5), (out - expected).abs().max()
    if window:  # the window changed layer 1's answer
        assert not torch.allclose(out, torch.cat([reference(q, k, v, p, 0, softcap) for q, k, v, (p, _, _)
                                                  in zip(qs, full_k, full_v, shapes)]), atol=1e-3)
    if softcap is not None:  # so did the cap
        assert not torch.allclose(out, torch.cat([reference(q, k, v, p, window) for q, k, v, (p, _, _)
                                                  in zip(qs, full_k, full_v, shapes)]), atol=1e-3)
    assert pool.k[0][0].abs().sum() == 0, "the scratch page is never written by real tokens"


def test_a_long_prompt_is_not_padded_into_the_decodes():
    """A step's padded attention stays near its real work: a 3,000-token prompt among 100 decodes of 200 cached tokens
    (one padded block made that 100 x 3,000 x 3,000 scores; a CPU server's step took 100 s)."""
    pool = KVCachePool(1, 4, 16, 2, 8, torch.float32, torch.device("cpu"))
    backend = TorchAttentionBackend(pool, 4, 2, 8)
    seqs = [SequenceInput([1], 200, list(range(13))) for _ in range(100)]
    seqs.insert(40, SequenceInput([1] * 3000, 0, list(range(188))))
    meta = backend.prepare(seqs, torch.device("cpu"))
    assert sorted(tuple(g.masks[0].shape) for g in meta.groups) == [(1, 1, 3000, 3000), (100, 1, 1, 201)]
    assert sorted(torch.cat([g.tokens for g in meta.groups]).tolist()) == list(range(3100))


def test_a_soft_cap_is_a_positive_number():
    pool = KVCachePool(1, 4, 4, 2, 8, torch.float32, torch.device("cpu"))
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="soft-cap must be a positive number"):
            TorchAttentionBackend(pool, 4, 2, 8, softcap=bad)
