"""Checks of tpserve's Triton kernels on the CPU, through Triton's interpreter.

Run by test_triton_interpreter.py in a child process with TRITON_INTERPRET=1 (Triton reads it
when a kernel is defined, so it cannot be switched on inside a process that already holds the
compiled kernels). The interpreter has no libdevice, so the sampler uses numpy's float32
exp/log there; the hashing, the race and the tie rule are the kernel's own.
"""

from __future__ import annotations

import os
import sys

import torch
from tpserve.engine.sampler import Sampler, SamplingBatch
from tpserve.kvcache.pool import KVCachePool
from tpserve.sampling_params import SamplingParams as SP


def check_sampler() -> None:
    from tpserve.kernels.sampling import sample

    gen = torch.Generator().manual_seed(0)
    rows, vocab = 24, 3001
    wide = (3 * torch.randn(rows, vocab + 7, generator=gen)).to(torch.bfloat16)
    logits = wide[:, :vocab]  # a padded row stride, as tensor-parallel logits have
    logits[5, 17] = logits[5, 900] = 40.0  # an exact tie under greedy: the first index wins
    params = [SP(temperature=0.0 if i % 5 == 0 else 0.2 + 0.1 * i) for i in range(rows)]
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=gen).tolist()
    steps = [i * 977 + (i % 3) * 2**33 for i in range(rows)]
    batch = SamplingBatch.build(params, seeds, steps, vocab, "cpu")
    reference = Sampler().sample_torch(logits, batch)
    got = sample(logits, batch.temperatures, batch.seeds, batch.steps)
    assert got.dtype == torch.int64
    assert torch.equal(got, reference), f"kernel {got.tolist()} != torch {reference.tolist()}"
    assert int(got[5]) == 17


def check_kv_store() -> None:
    from tpserve.kernels.kv_store import store_kv

    gen = torch.Generator().manual_seed(1)
    tokens, kv_heads, head_dim = 9, 2, 16
    qkv = torch.randn(tokens, 3 * kv_heads * head_dim, generator=gen)
    k = qkv[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, 2 * kv_heads * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(8 * 4, generator=gen)[:tokens]
    fused = KVCachePool(1, 8, 4, kv_heads, head_dim, torch.float32, torch.device("cpu"))
    reference = KVCachePool(1, 8, 4, kv_heads, head_dim, torch.float32, torch.device("cpu"))
    store_kv(fused.k[0], fused.v[0], slots, k, v)
    reference.store(0, slots, k, v)
    assert torch.equal(fused.k[0], reference.k[0]) and torch.equal(fused.v[0], reference.v[0])


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    check_sampler()
    check_kv_store()
    print("ok")
