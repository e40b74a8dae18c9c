"""float32 attention over a paged cache, the oracle of the GPU attention kernels' window and soft-cap tests
(test_sliding_window_gpu.py, test_gemma2_gpu.py), the random two-layer bf16 cache they read, and the decode graph
they replay."""

from __future__ import annotations

import math

import torch

from tpserve.forward import SequenceInput
from tpserve.kvcache.pool import KVCachePool

HEAD_DIM, PAGE, HEADS, KV_HEADS, WINDOW = 128, 16, 32, 8, 100
RTOL = 1e-2  # bf16 kernels against float32 (test_decode_kernels.py's bound)


def reference(pool: KVCachePool, layer: int, q: torch.Tensor, seq: SequenceInput, window: int,
              softcap: float | None = None) -> torch.Tensor:
    """float32 attention of ``seq``'s new tokens (q [n, H, D]) over its cache, each within ``window`` (0: none), the
    scaled scores soft-capped (transformers' Gemma 2) where ``softcap`` is set."""
    pages = torch.tensor(seq.page_table, device=q.device)
    k, v = (c[layer][pages].float().flatten(0, 1)[: seq.seq_len].repeat_interleave(HEADS // KV_HEADS, dim=1)
            for c in (pool.k, pool.v))
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) / math.sqrt(HEAD_DIM)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    k_pos = torch.arange(seq.seq_len, device=q.device)[None, :]
    q_pos = torch.arange(seq.prefix_len, seq.seq_len, device=q.device)[:, None]
    allowed = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)


def random_pool() -> KVCachePool:
    pool = KVCachePool(2, 1200, PAGE, KV_HEADS, HEAD_DIM, torch.bfloat16, torch.device("cuda"),
                       compute_dtype=torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for cache in (*pool.k, *pool.v):
        cache.copy_(torch.randn(cache.shape, generator=gen, device="cuda"))
    return pool


def capture_both_layers(backend, size: int) -> tuple[torch.cuda.CUDAGraph, object, torch.Tensor, list[torch.Tensor]]:
    """A decode graph of ``size`` sequences attending layers 0 and 1 of ``backend``'s cache, captured on padding
    (warmed up on a side stream first): (graph, its metadata to plan, q to fill, each layer's output)."""
    meta = backend.cuda_graph_metadata(size, 600)
    backend.plan_cuda_graph([], meta, size)
    q = torch.zeros(size, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    outs = [torch.empty_like(q) for _ in range(2)]

    def attend_both() -> None:
        for layer, out in enumerate(outs):
            out.copy_(backend.attend(layer, q, meta))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attend_both()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attend_both()
    return graph, meta, q, outs
