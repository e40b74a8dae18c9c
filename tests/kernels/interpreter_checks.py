"""Checks of tpserve's Triton kernels on the CPU, through Triton's interpreter.

Run by test_triton_interpreter.py in a child process with TRITON_INTERPRET=1 (Triton reads it
when a kernel is defined, so it cannot be switched on inside a process that already holds the
compiled kernels). The interpreter has no libdevice, so the sampler uses numpy's float32
exp/log there; the hashing, the race and the tie rule are the kernel's own.
Its tl.dot of two bfloat16 tiles returns garbage (triton 3.9; float32 tiles are right), so the
MoE checks run in float32.
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the shared helpers
from tpserve.engine.sampler import Sampler, SamplingBatch
from tpserve.kvcache.pool import KVCachePool
from tpserve.quant.fp8 import FP8_DTYPE
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

    # Rows wider than one chunk: the chunks' maxes and winners are combined; a greedy tie
    # across chunks still goes to the first index.
    vocab = 10_000
    logits = (3 * torch.randn(6, vocab, generator=gen)).to(torch.bfloat16)
    logits[0, 9_000] = logits[0, 100] = 40.0
    logits[1, 8_500] = 40.0  # the max in the last chunk
    params = [SP(temperature=0.0), SP(temperature=0.5)] + [SP(temperature=1.0 + i) for i in range(4)]
    batch = SamplingBatch.build(params, list(range(6)), [3] * 6, vocab, "cpu")
    got = sample(logits, batch.temperatures, batch.seeds, batch.steps)
    assert torch.equal(got, Sampler().sample_torch(logits, batch)), got.tolist()
    assert got[:2].tolist() == [100, 8_500]


def kept_sets(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[B, V] bool: the tokens the torch path's top-k/top-p/min-p keep."""
    from tpserve.engine.sampler import Workspace, _keep_thresholds, _tempered_weights

    weights = _tempered_weights(logits, batch.temperatures, Workspace()).clone()
    threshold = _keep_thresholds(weights, batch)
    return weights >= threshold[:, None] if threshold is not None else torch.ones_like(weights, dtype=torch.bool)


def check_sampler_filters() -> None:
    """top-k/top-p/min-p mixes, bisection in the kernel against the torch path's sort."""
    from tpserve.kernels.sampling import sample

    gen = torch.Generator().manual_seed(2)
    rows, vocab = 20, 600
    # bf16 logits over a small vocab: many exact ties, also at the cut-offs.
    logits = (3 * torch.randn(rows, vocab, generator=gen)).to(torch.bfloat16)
    logits[3, :50] = 5.0  # 50 tokens tied at the top: top-k 20 keeps all of them
    kinds = [
        SP(temperature=0.8, top_k=20), SP(temperature=1.0, top_p=0.8), SP(temperature=0.7, min_p=0.1),
        SP(temperature=0.9, top_k=20, top_p=0.8), SP(temperature=0.0, top_k=3), SP(temperature=1.2),
        SP(temperature=1.5, top_k=5, top_p=0.5, min_p=0.2), SP(temperature=2.0, top_p=0.95),
        SP(temperature=0.6, top_k=1), SP(temperature=3.0, top_k=200, top_p=0.3, min_p=0.01),
    ]
    params = [kinds[i % len(kinds)] for i in range(rows)]
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=gen).tolist()
    steps = [i * 31 for i in range(rows)]
    batch = SamplingBatch.build(params, seeds, steps, vocab, "cpu")
    reference = Sampler().sample_torch(logits, batch)
    got = sample(logits, batch.temperatures, batch.seeds, batch.steps, batch.top_ks, batch.top_ps, batch.min_ps)
    kept = kept_sets(logits, batch)
    greedy = batch.temperatures == 0
    assert bool(kept[~greedy].gather(1, got[~greedy, None]).all()), "a token outside the kept set"
    agree = (got == reference).float().mean().item()
    assert agree >= 0.99, f"only {agree:.1%} of rows agree: kernel {got.tolist()} != torch {reference.tolist()}"

    # One row, many seeds: every kept token's share tracks the torch path's.
    samples = 8
    row = logits[1:2].expand(samples, -1)
    for param in (SP(temperature=1.0, top_k=20, top_p=0.7), SP(temperature=2.0, top_p=0.5, min_p=0.05)):
        batch = SamplingBatch.build([param] * samples, list(range(samples)), [7] * samples, vocab, "cpu")
        reference = Sampler().sample_torch(row, batch)
        got = sample(row, batch.temperatures, batch.seeds, batch.steps, batch.top_ks, batch.top_ps, batch.min_ps)
        assert bool(kept_sets(row, batch).gather(1, got[:, None]).all()), "a token outside the kept set"
        assert (got == reference).float().mean().item() >= 0.99, f"{got.tolist()} != {reference.tolist()}"


def check_sampler_on_edited_logits() -> None:
    """The kernel samples the logits the engine edits (penalties, bias, -inf bans and grammar
    masks) exactly as the torch path does, filtered or not."""
    from tpserve.engine.logit_edits import LogitEdits, PenaltyState
    from tpserve.kernels.sampling import sample
    from tpserve.structured.mask import apply_bitmask, unpack_bitmask

    gen = torch.Generator().manual_seed(2)
    rows, vocab = 8, 1500
    raw = (3 * torch.randn(rows, vocab, generator=gen)).to(torch.bfloat16)
    params = [SP(temperature=0.7 + 0.1 * i, repetition_penalty=1.3, presence_penalty=0.5, logit_bias={3: 5.0},
                 min_tokens=4, top_k=50 if i % 2 else -1, top_p=0.9 if i % 3 else 1.0) for i in range(rows)]
    state = PenaltyState(vocab, torch.device("cpu"))
    new = [(i, [i, i + 1, 40]) for i in range(rows)]
    edits = LogitEdits.build(params, list(range(rows)), [0] * rows, [True] * rows, new, [7, 9], vocab, "cpu")
    logits = state.apply(raw, edits)
    bitmask = torch.full((rows, -(-vocab // 32)), -1, dtype=torch.int32)
    bitmask[:, 1:] = 0x0F0F0F0F  # a grammar allowing a scattered half of the tokens
    apply_bitmask(logits, bitmask, list(range(0, rows, 2)))
    batch = SamplingBatch.build(params, list(range(rows)), [0] * rows, vocab, "cpu")
    reference = Sampler().sample_torch(logits, batch)
    got = sample(logits, batch.temperatures, batch.seeds, batch.steps, batch.top_ks, batch.top_ps, batch.min_ps)
    assert torch.equal(got, reference), f"kernel {got.tolist()} != torch {reference.tolist()}"
    plain = [SP(temperature=0.8)] * rows
    batch = SamplingBatch.build(plain, list(range(rows)), [0] * rows, vocab, "cpu")
    got = sample(logits, batch.temperatures, batch.seeds, batch.steps)
    assert torch.equal(got, Sampler().sample_torch(logits, batch))
    assert not torch.isin(got, torch.tensor([7, 9])).any()  # banned by min_tokens
    # The unfiltered kernel reading the bitmask itself picks what it picks from logits masked first,
    # greedy rows too; rows the grammar does not constrain carry an all-allowing mask.
    every_row = bitmask.clone()
    every_row[1::2] = -1
    mixed = [SP(temperature=0.0 if i % 3 == 0 else 0.8) for i in range(rows)]
    batch = SamplingBatch.build(mixed, list(range(rows)), [0] * rows, vocab, "cpu")
    fused = sample(state.apply(raw, edits), batch.temperatures, batch.seeds, batch.steps, bitmask=every_row)
    assert torch.equal(fused, sample(logits, batch.temperatures, batch.seeds, batch.steps)), fused.tolist()
    allowed = unpack_bitmask(every_row, vocab)
    assert bool(allowed.gather(1, fused[:, None]).all())


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

    # An FP8 cache: clamped to +-448 and rounded to e4m3 (up to the interpreter's own float8 cast,
    # see check_fp8_gemm).
    k, v = 100 * k, v.clone()
    k[0, 0, 0], v[1, 1, 1] = 1000.0, -900.0
    caches = [KVCachePool(1, 8, 4, kv_heads, head_dim, FP8_DTYPE, torch.device("cpu"), torch.float32) for _ in range(2)]
    store_kv(caches[0].k[0], caches[0].v[0], slots, k, v)
    caches[1].store(0, slots, k, v)
    for got, ref in ((caches[0].k[0].float(), caches[1].k[0].float()), (caches[0].v[0].float(), caches[1].v[0].float())):
        assert float(got.abs().max()) == 448.0
        ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(2**-9))) - 3)
        assert bool(((got - ref).abs() <= ulp).float().mean() > 0.95), "fp8 KV store differs"


def check_norm_rope_store() -> None:
    """q/k norm + rotary + KV store in one kernel, as the attention backend's forward_fused runs
    it, against the layers' torch code."""
    for tokens in (7, 150):  # one token a program; 16 a program (prefill), the last block partial
        _check_norm_rope_store(tokens)


def _check_norm_rope_store(tokens: int) -> None:
    from tpserve.attention.torch_backend import TorchAttentionBackend
    from tpserve.layers.norm import RMSNorm
    from tpserve.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim, max_pos, pages = 4, 2, 32, 64, 64
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width + 5, generator=gen)[:, :width]  # a padded row stride
    positions = torch.randint(0, max_pos, (tokens,), generator=gen)
    slots = torch.randperm(pages * 4, generator=gen)[:tokens]
    rotary = RotaryEmbedding(head_dim, max_pos, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                 "original_max_position_embeddings": 16}, max_pos)
    rotary.build_cache(torch.device("cpu"), torch.float32)
    half = head_dim // 2  # the fused table: cos then sin of each angle, once
    table = torch.cat((rotary.cos[:, :half], rotary.sin[:, :half]), dim=-1).contiguous()
    for with_norm in (True, False):
        q_norm, k_norm = RMSNorm(head_dim, 1e-6), RMSNorm(head_dim, 1e-6)
        q_norm.weight.data = 1 + 0.1 * torch.randn(head_dim, generator=gen)
        k_norm.weight.data = 1 + 0.1 * torch.randn(head_dim, generator=gen)
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q, k, v = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
        if with_norm:
            q, k = q_norm(q), k_norm(k)
        q_ref, k_ref = rotary(positions, q, k)
        reference = KVCachePool(1, pages, 4, kv_heads, head_dim, torch.float32, torch.device("cpu"))
        reference.store(0, slots, k_ref, v)
        fused = KVCachePool(1, pages, 4, kv_heads, head_dim, torch.float32, torch.device("cpu"))
        backend = TorchAttentionBackend(fused, heads, kv_heads, head_dim, fused_rope_store=True)
        backend.attend = lambda layer, q, meta: q  # the kernel's q, before attention
        norm = (q_norm.weight, k_norm.weight, 1e-6) if with_norm else None
        got = backend.forward_fused(0, qkv, positions, table, norm, slots, None)
        torch.testing.assert_close(got, q_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fused.k[0], reference.k[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(fused.v[0], reference.v[0])
        # An FP8 cache: the same k and v, clamped into e4m3's range and cast (scaled up so the
        # clamp is exercised). The interpreter's float8 cast is not the GPU's (see check_fp8_gemm),
        # so, as check_kv_store, most values within one e4m3 step (tests/gpu checks the bits).
        big = qkv * 200
        reference = KVCachePool(1, pages, 4, kv_heads, head_dim, FP8_DTYPE, torch.device("cpu"), torch.float32)
        q, k, v = big.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        k, v = k.reshape(tokens, kv_heads, head_dim), v.reshape(tokens, kv_heads, head_dim)
        if with_norm:
            k = k_norm(k)
        _, k_ref = rotary(positions, q.reshape(tokens, heads, head_dim), k)
        reference.store(0, slots, k_ref, v)
        fused = KVCachePool(1, pages, 4, kv_heads, head_dim, FP8_DTYPE, torch.device("cpu"), torch.float32)
        backend = TorchAttentionBackend(fused, heads, kv_heads, head_dim, fused_rope_store=True)
        backend.attend = lambda layer, q, meta: q
        backend.forward_fused(0, big, positions, table, norm, slots, None)
        assert float(fused.v[0].float().abs().max()) == 448.0
        for got, ref in ((fused.k[0].float(), reference.k[0].float()), (fused.v[0].float(), reference.v[0].float())):
            ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(2**-9))) - 3)
            assert bool(((got - ref).abs() <= ulp).float().mean() > 0.95), "fused FP8 KV store differs"


def check_fp8_gemm() -> None:
    """The FP8 block GEMM against torch: partial M, N and K tiles, non-square blocks, a K group
    wider than the K tile, a row of zeros, bfloat16 and float32 activations, scales with padded
    rows.

    The interpreter's cast to float8 is not the GPU's: a value that rounds up into the next
    power of two comes out halved (124.3 -> 64, not 128) and ties round away from zero. So the
    activation quantization is checked up to those cases, and the GEMM on its own output."""
    from tpserve.kernels.fp8_gemm import quantize_activations
    from tpserve.kernels.fp8_linear import fp8_linear
    from tpserve.quant.fp8 import dequantize_blocks, quantize_blocks

    gen = torch.Generator().manual_seed(0)
    for m, n, k, block, dtype in [
        (1, 96, 256, (128, 128), torch.bfloat16),
        (37, 200, 176, (32, 48), torch.float32),
        (20, 64, 64, (16, 64), torch.bfloat16),
        (70, 40, 48, (16, 16), torch.bfloat16),  # K groups of 16: the dot in bf16 (FP8 dots need K >= 32)
    ]:
        x = torch.randn(m, k, generator=gen).to(dtype)
        if m > 1:
            x[-1, :] = 0.0
        weight, scale = quantize_blocks(torch.randn(n, k, generator=gen) * 0.05, block)
        q, xs = quantize_activations(x, block[1])
        q_ref, xs_ref = quantize_blocks(x, (1, block[1]))
        torch.testing.assert_close(xs, xs_ref, rtol=1e-6, atol=0)
        got_q, ref_q = q.float(), q_ref.float()
        differ = got_q != ref_q
        ulp = torch.exp2(torch.floor(torch.log2(ref_q.abs().clamp_min(2**-9))) - 3)
        carried = (got_q == ref_q / 2) & (torch.log2(ref_q.abs()) == torch.log2(ref_q.abs()).round())
        assert bool((carried | ((got_q - ref_q).abs() <= ulp))[differ].all()), "activation quantization differs"
        assert differ.float().mean() < 0.05
        got = fp8_linear(x.view(1, m, k), weight, scale, block, "triton")
        padded = torch.nn.functional.pad(scale, (0, 3), value=float("nan"))[:, : scale.shape[1]]  # the row stride read
        assert torch.equal(fp8_linear(x.view(1, m, k), weight, padded, block, "auto"), got)  # auto on the CPU: this GEMM
        a = dequantize_blocks(q, xs, (1, block[1]), torch.float32)
        ref = a @ dequantize_blocks(weight, scale, block, torch.float32).T
        assert got.shape == (1, m, n) and got.dtype == dtype
        torch.testing.assert_close(got[0].float(), ref, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-4)
        if m > 1:
            assert torch.equal(got[0, -1], torch.zeros(n, dtype=dtype))


def check_fp8_gemm_rowwise() -> None:
    """The row-scaled FP8 GEMM (compressed-tensors' per-channel weights) against torch on its own quantized
    activations (one scale a token over all of K): partial M, N and K tiles, a row of zeros, bf16 and float32, the
    weight's scales [N, 1] as the layers hold them, and the engine's GEMM for such a layer above one token
    (``fp8_linear`` with ``row_scales``) is this one."""
    from tpserve.kernels.fp8_gemm import RowwiseTiles, fp8_gemm_rowwise, quantize_activations
    from tpserve.kernels.fp8_linear import fp8_linear
    from tpserve.quant.fp8 import dequantize_blocks, quantize_blocks

    gen = torch.Generator().manual_seed(0)
    for m, n, k, dtype, tiles in [
        (5, 72, 176, torch.bfloat16, None),
        (37, 200, 304, torch.float32, None),
        (70, 40, 96, torch.bfloat16, RowwiseTiles(64, 32, 64, 2)),
        (3, 40, 200, torch.bfloat16, None),  # K % 16 != 0 (a row-parallel cut): the K tiles masked
    ]:
        x = torch.randn(m, k, generator=gen).to(dtype)
        x[-1, :] = 0.0
        weight, row_scale = quantize_blocks(torch.randn(n, k, generator=gen) * 0.05, (1, k))
        assert row_scale.shape == (n, 1)
        got = fp8_gemm_rowwise(x, weight, row_scale, tiles)
        q, xs = quantize_activations(x, k)
        assert xs.shape == (m, 1)
        ref = dequantize_blocks(q, xs, (1, k), torch.float32) @ dequantize_blocks(weight, row_scale, (1, k), torch.float32).T
        assert got.shape == (m, n) and got.dtype == dtype
        torch.testing.assert_close(got.float(), ref, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-4)
        assert torch.equal(got[-1], torch.zeros(n, dtype=dtype))
        if tiles is None:
            engine = fp8_linear(x.view(1, m, k), weight, row_scale, (1, k), "triton", row_scales=True)
            assert torch.equal(engine[0], got)


def check_fp8_mlp() -> None:
    """The decoder's MLP with FP8 weights (gate/up column-parallel, down row-parallel, SiLU-and-mul
    between) on the GEMM ``auto`` picks off the GPU, the W8A8 one, at one token and 70, float32:
    each projection against torch on the kernel's own activation quantization (the interpreter's
    float8 cast, see check_fp8_gemm), and off the weight-only product (the activations were
    quantized)."""
    from tpserve.distributed.comm import SingleRankCommunicator
    from tpserve.distributed.info import set_tp_info
    from tpserve.kernels.fp8_gemm import quantize_activations
    from tpserve.kernels.fp8_linear import resolve_backend
    from tpserve.layers.mlp import MLP
    from tpserve.quant.fp8 import dequantize_blocks, quantize_blocks

    gen = torch.Generator().manual_seed(7)
    set_tp_info(0, 1)
    hidden, block = 96, (16, 32)
    mlp = MLP(hidden, 128, SingleRankCommunicator())
    dense = {}
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        weight, scale = quantize_blocks(torch.randn(layer.out_features, layer.in_features, generator=gen) * 0.05, block)
        layer.weight = torch.nn.Parameter(weight, requires_grad=False)
        layer.weight_scale_inv = torch.nn.Parameter(scale, requires_grad=False)
        layer.block_size = block
        layer.fp8_backend = resolve_backend("auto", weight.device, torch.float32, block, layer.in_features)
        assert layer.fp8_backend == "triton", layer.fp8_backend
        dense[layer] = dequantize_blocks(weight, scale, block, torch.float32)

    def w8a8(x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
        q, xs = quantize_activations(x, block[1])
        return dequantize_blocks(q, xs, (1, block[1]), torch.float32) @ dense[layer].T

    for m in (1, 70):
        x = torch.randn(m, hidden, generator=gen)
        gate_up = mlp.gate_up_proj(x)
        torch.testing.assert_close(gate_up, w8a8(x, mlp.gate_up_proj), rtol=1e-5, atol=1e-5)
        gate, up = gate_up.chunk(2, dim=-1)
        product = torch.nn.functional.silu(gate) * up
        got = mlp(x)
        assert got.shape == (m, hidden)
        torch.testing.assert_close(got, w8a8(product, mlp.down_proj), rtol=1e-5, atol=1e-5)
        weight_only = product @ dense[mlp.down_proj].T
        err = float((got - weight_only).norm() / weight_only.norm())
        assert 1e-3 < err < 0.1, f"{m} tokens: {err:.2e} from the weight-only product"


def check_fused_moe() -> None:
    """The grouped MoE GEMMs against the torch experts: decode-sized and prefill-sized blocks,
    experts with no tokens, sizes that are not multiples of the blocks; the launch in groups of row blocks
    (a group of 1 and of 3 over 16-column blocks: every program maps to its own tile), and with SiLU-and-mul
    in the first GEMM."""
    from tpserve.kernels.moe import Tile, align_by_expert, fused_experts, grouped_experts
    from tpserve.layers.moe import experts_dense_masked, experts_torch

    gen = torch.Generator().manual_seed(4)
    for tokens, experts, top_k, hidden, inter in ((1, 8, 2, 64, 32), (37, 16, 3, 48, 24), (300, 8, 2, 32, 16)):
        x, gate_up, down, weights, ids = random_experts(gen, tokens, experts, top_k, hidden, inter)
        reference = experts_torch(x, gate_up, down, weights, ids)
        torch.testing.assert_close(grouped_experts(x, gate_up, down, weights, ids), reference, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fused_experts(x, gate_up, down, weights, ids), reference, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(experts_dense_masked(x, gate_up, down, weights, ids), reference, rtol=1e-5, atol=1e-5)
        for group_m, fuse_silu in itertools.product((1, 3), (False, True)):
            tile = Tile(16, 16, 16, group_m=group_m, fuse_silu=fuse_silu)
            torch.testing.assert_close(grouped_experts(x, gate_up, down, weights, ids, tile=tile), reference,
                                       rtol=1e-5, atol=1e-5, msg=lambda m: f"{tile}: {m}")
    sorted_rows, block_expert, padded_len = align_by_expert(torch.tensor([[3, 1], [1, 0], [3, 1]]), 4, 4)
    assert int(padded_len) == 12 and sorted_rows.numel() == 20  # 6 rows + 4 experts * 3 padding, in whole blocks
    assert sorted_rows.tolist() == [3, 6, 6, 6, 1, 2, 5, 6, 0, 4, 6, 6] + [6] * 8
    assert block_expert[:3].tolist() == [0, 1, 3]


def random_experts(gen: torch.Generator, tokens: int, experts: int, top_k: int, hidden: int, inter: int):
    """x, gate_up [E, 2I, H], down [E, H, I], renormalised top-k weights and ids, in float32."""
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    weights, ids = torch.topk(torch.softmax(torch.randn(tokens, experts, generator=gen), dim=-1), top_k, dim=-1)
    return x, gate_up, down, weights / weights.sum(dim=-1, keepdim=True), ids


def check_small_batch_moe() -> None:
    """The unsorted small-batch kernels against the torch experts in float32: the default config
    and small blocks (several K steps, tails in N and K, top_k not a multiple of the experts read
    per step), one token to 64 rows, a TP 2 rank of Qwen3-30B-A3B's experts (H 2048, I 384);
    bfloat16 against float64 (no tl.dot here, so the interpreter's bf16 is right); a dense MLP
    as one expert; and fused_experts picking them up to SMALL_BATCH_MAX_ROWS rows, the grouped
    GEMMs above."""
    from tpserve.kernels.moe import SMALL_BATCH_MAX_ROWS, fused_experts, grouped_experts
    from tpserve.kernels.moe_small import KernelConfig, SmallBatchConfig, default_config, small_batch_experts
    from tpserve.layers.activation import silu_and_mul
    from tpserve.layers.moe import experts_torch

    gen = torch.Generator().manual_seed(8)
    small_blocks = SmallBatchConfig(KernelConfig(block_n=8, block_k=16), KernelConfig(block_n=16, block_k=16, experts_per_step=4))
    one_per_step = SmallBatchConfig(KernelConfig(block_n=32, block_k=32), KernelConfig(block_n=4, block_k=64, experts_per_step=1))
    def no_prefetch(config: SmallBatchConfig) -> SmallBatchConfig:
        return dataclasses.replace(config, down=dataclasses.replace(config.down, prefetch=False))

    prefetch = SmallBatchConfig(KernelConfig(block_n=8, block_k=16), KernelConfig(block_n=16, block_k=16, experts_per_step=8, prefetch=True))
    cases = ((1, 2, 8, 64, 32), (3, 3, 16, 48, 24), (8, 8, 16, 40, 20), (2, 6, 8, 32, 40), (1, 8, 8, 2048, 384))
    for tokens, top_k, experts, hidden, inter in cases:
        x, gate_up, down, weights, ids = random_experts(gen, tokens, experts, top_k, hidden, inter)
        reference = experts_torch(x, gate_up, down, weights, ids)
        configs = (default_config(top_k), small_blocks, one_per_step, prefetch) if hidden <= 64 else (default_config(top_k), no_prefetch(default_config(top_k)))
        for config in configs:
            got = small_batch_experts(x, gate_up, down, weights, ids, config)
            torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5, msg=lambda m: f"{tokens, top_k, config}: {m}")
    # The layer's RMSNorm in the first kernel (x the residual stream): the experts of the normed x.
    for tokens, top_k, experts, hidden, inter in ((1, 8, 8, 2048, 384), (2, 3, 16, 48, 24)):
        x, gate_up, down, weights, ids = random_experts(gen, tokens, experts, top_k, hidden, inter)
        x = 30 * x
        norm_weight = torch.rand(hidden, generator=gen) + 0.5
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weight
        reference = experts_torch(normed, gate_up, down, weights, ids)
        for config in (default_config(top_k),) if hidden > 64 else (default_config(top_k), small_blocks):
            got = small_batch_experts(x, gate_up, down, weights, ids, config, norm=(norm_weight, 1e-6))
            torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5, msg=lambda m: f"norm {tokens, config}: {m}")
    x, gate_up, down, weights, ids = random_experts(gen, 4, 16, 4, 128, 64)
    exact = experts_torch(x.double(), gate_up.double(), down.double(), weights.double(), ids)
    half = [t.bfloat16() for t in (x, gate_up, down, weights)]
    for got in (small_batch_experts(*half, ids), experts_torch(*half, ids)):
        err = float((got.double() - exact).norm() / exact.norm())
        assert got.dtype == torch.bfloat16 and err < 1e-2, f"bf16 relative error {err:.2e}"
    # A dense MLP (the layers of mlp_only_layers) is the one-expert case of the same kernels.
    x, gate_up, down, _, _ = random_experts(gen, 2, 1, 1, 64, 48)
    dense = torch.nn.functional.linear(silu_and_mul(torch.nn.functional.linear(x, gate_up[0])), down[0])
    one_expert = small_batch_experts(x, gate_up, down, torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.int64))
    torch.testing.assert_close(one_expert, dense, rtol=1e-5, atol=1e-5)
    for tokens in (SMALL_BATCH_MAX_ROWS // 4, SMALL_BATCH_MAX_ROWS // 4 + 1):
        x, gate_up, down, weights, ids = random_experts(gen, tokens, 8, 4, 32, 16)
        small = tokens * 4 <= SMALL_BATCH_MAX_ROWS
        expected = (small_batch_experts if small else grouped_experts)(x, gate_up, down, weights, ids)
        assert torch.equal(fused_experts(x, gate_up, down, weights, ids), expected)


def check_fp8_experts() -> None:
    """FP8 experts (block scales per expert, gate and up apart) in the small-batch kernels, routed or not,
    and the grouped GEMMs, against the torch experts on the dequantized weights (float32): blocks whose
    rows a program shares (128, 16), blocks thinner than a program's rows (8 x 32, gathered per row), a scale a row,
    partial blocks at the ends; every block's scale far from its neighbours', so a wrong index shows."""
    from fp8_checkpoint import fp8_experts
    from tpserve.kernels.moe import Tile, fused_experts, grouped_experts
    from tpserve.kernels.moe_small import KernelConfig, RouterLogits, SmallBatchConfig, routed_experts, small_batch_experts
    from tpserve.layers.moe import experts_torch

    gen = torch.Generator().manual_seed(12)
    small = SmallBatchConfig(KernelConfig(block_n=16, block_k=16), KernelConfig(block_n=8, block_k=32, experts_per_step=4))
    prefetch = SmallBatchConfig(KernelConfig(block_n=8, block_k=16), KernelConfig(block_n=16, block_k=16, experts_per_step=4, prefetch=True))
    # and a scale a row as compressed-tensors' experts are held ((1, max(hidden, inter)) blocks: StackedExperts), each
    # program's K chunk in one block or (hidden 72, chunks of 16) not
    cases = ((1, 4, 8, 64, 48, (16, 16)), (3, 2, 8, 80, 40, (8, 32)), (2, 4, 6, 96, 72, (128, 128)),
             (40, 2, 8, 48, 40, (16, 16)), (1, 4, 8, 64, 48, (1, 64)), (3, 2, 8, 80, 40, (1, 80)),
             (2, 4, 6, 72, 40, (1, 72)), (40, 2, 8, 48, 40, (1, 48)))
    for tokens, top_k, experts, hidden, inter, block in cases:
        x, gate_up, down, weights, ids = random_experts(gen, tokens, experts, top_k, hidden, inter)
        gate_up = gate_up * torch.rand(experts, 2 * inter, 1, generator=gen) * 8  # rows (and so blocks) of other ranges
        down = down * torch.rand(experts, 1, inter, generator=gen) * 8
        gu_q, d_q, scales, gu_deq, d_deq = fp8_experts(gate_up, down, block)
        reference = experts_torch(x, gu_deq, d_deq, weights, ids)
        got = {"fused": fused_experts(x, gu_q, d_q, weights, ids, scales),
               "grouped": grouped_experts(x, gu_q, d_q, weights, ids, scales),
               "grouped, SiLU in the GEMM": grouped_experts(x, gu_q, d_q, weights, ids, scales,
                                                           tile=Tile(16, 16, 16, fuse_silu=True))}
        if tokens * top_k <= 64:
            got["small blocks"] = small_batch_experts(x, gu_q, d_q, weights, ids, small, scales=scales)
            router = RouterLogits(torch.log(torch.zeros(tokens, experts).scatter_(1, ids, weights)), top_k, True)
            got["routed"] = routed_experts(x, gu_q, d_q, router, prefetch, scales=scales)
        for name, out in got.items():
            torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4, msg=lambda m: f"fp8 {name} {tokens, block}: {m}")


def check_routed_moe() -> None:
    """The expert kernels that route from the router's logits themselves (``routed_experts``) against the
    router kernel then the same kernels: the same bits, with and without renormalisation and the fused
    norm, added to a residual stream or not, a prefetching config of small blocks, experts not a power of two, tied logits; a config that does not
    prefetch falls back to the router kernel; the routed down kernel refuses such a config."""
    from tpserve.kernels.moe_small import router_topk
    from tpserve.kernels.moe_small import (KernelConfig, RouterLogits, SmallBatchConfig, default_config, down_sum,
                                           routed_experts, small_batch_experts)

    gen = torch.Generator().manual_seed(11)
    prefetch = SmallBatchConfig(KernelConfig(block_n=8, block_k=16), KernelConfig(block_n=16, block_k=16, experts_per_step=8, prefetch=True))
    plain = SmallBatchConfig(KernelConfig(block_n=8, block_k=16), KernelConfig(block_n=16, block_k=16, experts_per_step=2))
    for tokens, top_k, experts, hidden, inter, renormalize in ((1, 8, 60, 64, 32, True), (2, 3, 16, 48, 24, False),
                                                               (3, 4, 8, 32, 40, True)):
        x, gate_up, down, _, _ = random_experts(gen, tokens, experts, top_k, hidden, inter)
        norm = (torch.rand(hidden, generator=gen) + 0.5, 1e-6)
        ties = torch.randint(0, 3, (tokens, experts), generator=gen).float()  # ranked by id among equals
        runs = [(torch.randn(tokens, experts, generator=gen), c, n) for c in (default_config(top_k), prefetch, plain)
                for n in (None, norm)] + [(ties, default_config(top_k), None)]
        for logits, config, with_norm in runs:
            weights, ids = router_topk(logits, top_k, renormalize, x.dtype)
            expected = small_batch_experts(x, gate_up, down, weights, ids, config, norm=with_norm)
            got = routed_experts(x, gate_up, down, RouterLogits(logits, top_k, renormalize), config, norm=with_norm)
            assert torch.equal(got, expected), f"routed {tokens, top_k, config, with_norm is not None}"
            if config in (prefetch, plain) and with_norm is None:  # the sum added to a residual stream in place
                residual = torch.randn(tokens, hidden, generator=gen)
                stream = residual.clone()
                assert routed_experts(x, gate_up, down, RouterLogits(logits, top_k, renormalize), config,
                                      add_to=stream) is stream
                assert torch.equal(stream, residual + expected), f"routed add_to {tokens, top_k, config}"
    act = torch.zeros(2, 8)
    try:
        down_sum(act, torch.zeros(4, 8, 8), None, RouterLogits(torch.zeros(1, 4), 2, True), plain.down)
    except ValueError as exc:
        assert "first step" in str(exc)
    else:
        raise AssertionError("the routed down kernel took a config that does not prefetch")


def check_router_topk() -> None:
    """The one-kernel router against TopKRouter's torch ops: ids equal, weights to float32
    rounding, with and without renormalisation, a row of ties, more experts than a power of 2."""
    from tpserve.kernels.moe_small import router_topk

    gen = torch.Generator().manual_seed(6)
    for tokens, experts, top_k in ((1, 128, 8), (9, 60, 4), (4, 8, 2)):
        logits = torch.randn(tokens, experts, generator=gen)
        for renormalize in (False, True):
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            want_w, want_ids = torch.topk(probs, top_k, dim=-1)
            if renormalize:
                want_w = want_w / want_w.sum(dim=-1, keepdim=True)
            got_w, got_ids = router_topk(logits, top_k, renormalize, torch.float32)
            assert torch.equal(got_ids, want_ids), (got_ids, want_ids)
            torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)
    ties = torch.zeros(1, 8)
    _, ids = router_topk(ties, 3, True, torch.float32)
    assert sorted(ids[0].tolist()) == ids[0].tolist() and len(set(ids[0].tolist())) == 3


def check_align_kernel_matches_torch() -> None:
    """The sort's kernels equal torch's stable sort, padding and block labels exactly: one token, experts with
    no rows, rows over many programs (each places its own, from counts of all), the production tiles' BLOCK_M,
    other ranks' rows (id = experts) left out; in one kernel and with the rows counted per chunk first (the form
    past ALIGN_ONE_KERNEL_MAX_ROWS rows, here forced at fewer rows, a program's rows inside a chunk or at its
    start)."""
    from tpserve.kernels.moe import ALIGN_COUNT_CHUNK, ALIGN_ONE_KERNEL_MAX_ROWS, align_by_expert, align_by_expert_torch

    gen = torch.Generator().manual_seed(5)
    cases = ((1, 8, 128, 16), (37, 3, 16, 16), (5, 2, 4, 64), (45, 8, 16, 64), (150, 8, 32, 32), (256, 8, 128, 32),
             (ALIGN_ONE_KERNEL_MAX_ROWS // 8, 8, 128, 16))
    for (tokens, top_k, experts, block_m), counted in itertools.product(cases, (False, True)):
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
        if block_m == 32:  # as expert parallelism's: another rank's expert is id ``experts``
            ids = torch.where(torch.rand(ids.shape, generator=gen) < 0.3, experts, ids)
        # the largest case counts in the production chunks (so its variant is compiled for sm_90), the others in 512s
        chunk = ALIGN_COUNT_CHUNK if tokens * top_k == ALIGN_ONE_KERNEL_MAX_ROWS else 512
        limits = dict(one_kernel_max_rows=0, count_chunk=chunk) if counted else {}
        got = align_by_expert(ids, experts, block_m, **limits)
        want = align_by_expert_torch(ids, experts, block_m)
        for g, w, name in zip(got, want, ("sorted_rows", "block_expert", "padded_len")):
            assert torch.equal(g.long(), w.long()), (f"{name} differs for {tokens} tokens, {experts} experts, "
                                                     f"block {block_m}, counted first: {counted}")


def check_expert_parallel_moe() -> None:
    """Expert parallelism's pieces: the router kernel's local ids equal ``localize`` of its global ones, and
    each rank's experts (other ranks' rows skipped) in the small-batch kernels, the grouped GEMMs (the sort
    leaving those rows out, in the kernel and in torch) and FP8 add up over the ranks to all experts'
    output. The kernels get the global router weights, not zero for other ranks' rows, and each rank's
    experts are a view into all of them, so a row not skipped by its id adds the next rank's expert; the
    down kernel also runs on activations written for every row. The routed kernels refuse to skip."""
    from fp8_checkpoint import fp8_experts
    from tpserve.kernels.moe import Tile, align_by_expert, align_by_expert_torch, fused_experts, grouped_experts
    from tpserve.kernels.moe_small import (KernelConfig, RouterLogits, default_config, down_sum, gate_up_silu,
                                           router_topk, small_batch_experts)
    from tpserve.layers.moe import experts_torch, localize

    gen = torch.Generator().manual_seed(13)
    for tokens, top_k, experts, ranks, hidden, inter in ((1, 8, 16, 4, 64, 32), (5, 2, 8, 2, 48, 24),
                                                          (40, 3, 12, 3, 32, 16)):
        x, gate_up, down, _, _ = random_experts(gen, tokens, experts, top_k, hidden, inter)
        logits = torch.randn(tokens, experts, generator=gen)
        weights, ids = router_topk(logits, top_k, True, x.dtype)
        reference = experts_torch(x, gate_up, down, weights, ids)
        gu_q, d_q, scales, gu_deq, d_deq = fp8_experts(gate_up, down, (8, 8))
        fp8_reference = experts_torch(x, gu_deq, d_deq, weights, ids)
        count = experts // ranks
        sums: dict[str, torch.Tensor] = {}
        for rank in range(ranks):
            start, mine = rank * count, slice(rank * count, (rank + 1) * count)
            local_w, local_ids = router_topk(logits, top_k, True, x.dtype, (start, count))
            want_w, want_ids = localize(weights, ids, start, count)
            assert torch.equal(local_ids, want_ids) and torch.equal(local_w, want_w), f"router rank {rank}"
            for block_m in (4, 16):
                got = align_by_expert(local_ids, count, block_m)
                for g, w, name in zip(got, align_by_expert_torch(local_ids, count, block_m), ("rows", "blocks", "len")):
                    assert torch.equal(g.long(), w.long()), f"align {name} rank {rank} block {block_m}"
            rank_scales = dataclasses.replace(scales, gate_up=scales.gate_up[mine], down=scales.down[mine])
            parts = {
                "torch": experts_torch(x, gate_up[mine], down[mine], local_w, local_ids),
                "grouped": grouped_experts(x, gate_up[mine], down[mine], weights, local_ids, skip_others=True),
                "fused": fused_experts(x, gate_up[mine], down[mine], weights, local_ids, skip_others=True),
                "fp8 grouped": grouped_experts(x, gu_q[mine], d_q[mine], weights, local_ids, rank_scales, True),
                "fp8 grouped, SiLU in the GEMM": grouped_experts(x, gu_q[mine], d_q[mine], weights, local_ids,
                                                                 rank_scales, True, Tile(16, 16, 16, fuse_silu=True)),
            }
            if tokens * top_k <= 64:
                parts["small"] = small_batch_experts(x, gate_up[mine], down[mine], weights, local_ids,
                                                     skip_others=True)
                parts["fp8 small"] = small_batch_experts(x, gu_q[mine], d_q[mine], weights, local_ids,
                                                         scales=rank_scales, skip_others=True)
                act = torch.randn(tokens * top_k, inter, generator=gen)  # every row's, other ranks' too
                kept = (local_ids < count).float() * weights
                want = torch.einsum("tk,tkh->th", kept, torch.einsum(
                    "tki,tkhi->tkh", act.view(tokens, top_k, inter), down[mine][local_ids.clamp(max=count - 1)]))
                for config in (default_config(top_k).down, KernelConfig(block_n=16, block_k=16, experts_per_step=2)):
                    got = down_sum(act, down[mine], weights, local_ids, config, skip_others=True)
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"ep down {config}: {m}")
            for name, part in parts.items():
                sums[name] = sums.get(name, 0) + part
        for name, total in sums.items():
            want = fp8_reference if name.startswith("fp8") else reference
            torch.testing.assert_close(total, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"ep {name} {tokens}: {m}")
    try:
        gate_up_silu(x, gate_up, RouterLogits(logits, top_k, True), default_config(top_k).gate_up, skip_others=True)
    except ValueError as exc:
        assert "this rank's" in str(exc)
    else:
        raise AssertionError("the routed gate_up kernel took skip_others")


def check_fused_moe_model() -> None:
    """A tiny Qwen3-MoE engine (float32; layer 0 dense, layers 1-2 sparse) with its MoE layers on
    the Triton kernels (router, sort by expert, grouped GEMMs) against the same engine on the torch
    path: a prefill of 64-row blocks (over 512 rows), then decode steps on the small-batch kernels, so the
    kernels see the normed activations and the stacked weights as the model hands them over."""
    import tempfile

    import tpserve.layers.moe as moe_layer
    from tpserve.engine_config import EngineConfig
    from tpserve.engine.engine import Engine
    from tpserve.forward import SequenceInput
    from tpserve.kvcache.pool import PageAllocator
    from tpserve.tiny import make_tiny_model

    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 200, (n,), generator=gen).tolist() for n in (150, 9, 1)]
    decode_steps = 2

    def run(model_dir: str) -> list[torch.Tensor]:
        engine = Engine(EngineConfig(model=model_dir, device="cpu", dtype="float32", max_total_tokens=1024, page_size=4))
        allocator = PageAllocator(engine.num_pages)
        tables = [allocator.allocate(-(-(len(p) + decode_steps) // 4)) for p in prompts]
        logits = [engine.forward([SequenceInput(p, 0, t) for p, t in zip(prompts, tables)])]
        for step in range(decode_steps):
            seqs = [SequenceInput([7 * i + step], len(p) + step, t) for i, (p, t) in enumerate(zip(prompts, tables))]
            logits.append(engine.forward(seqs))
        return logits

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(tmp, "qwen3_moe", num_layers=3, hidden_size=64, num_heads=2, num_kv_heads=1,
                                    head_dim=32, num_experts=8, num_experts_per_tok=4, moe_intermediate_size=48, seed=3)
        reference = run(model_dir)
        torch_path = moe_layer.use_triton
        moe_layer.use_triton = lambda device: True  # the CUDA path, here in the interpreter
        try:
            fused = run(model_dir)
        finally:
            moe_layer.use_triton = torch_path
    for step, (got, expected) in enumerate(zip(fused, reference)):
        err = float((got - expected).norm() / expected.norm())
        assert err < 1e-5, f"step {step}: relative logits error {err:.2e}"


def check_add_rmsnorm() -> None:
    """The residual add + RMSNorm kernel against float64 FlashInfer arithmetic (the sum rounded
    into the residual, the norm over the unrounded sum, one rounding at the end): float32 and
    bfloat16 rows, a hidden size below its power-of-two block, a padded row stride, one row."""
    from tpserve.kernels.add_rmsnorm import add_rms_norm_

    gen = torch.Generator().manual_seed(4)
    for dtype, rows, hidden in ((torch.float32, 5, 160), (torch.bfloat16, 3, 2048), (torch.bfloat16, 1, 96)):
        x = (3 * torch.randn(rows, hidden + 8, generator=gen))[:, :hidden].to(dtype)  # a padded row stride
        residual = torch.randn(rows, hidden, generator=gen).to(dtype)
        weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
        total = x.double() + residual.double()
        total32 = x.float() + residual.float()
        expected = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
        out, new_residual = add_rms_norm_(x, residual, weight, 1e-6)
        assert out.data_ptr() == x.data_ptr() and new_residual.data_ptr() == residual.data_ptr(), "not in place"
        # The interpreter's bfloat16 cast truncates (the GPU's rounds to nearest: tests/gpu checks
        # the bits against FlashInfer's kernel), so a bfloat16 residual within one step of the sum.
        exponent = torch.floor(torch.log2(total32.abs().clamp_min(1e-30)))
        step = 0.0 if dtype == torch.float32 else torch.exp2(exponent - 7)
        assert bool(((new_residual.float() - total32).abs() <= step).all()), f"{dtype}: the residual is not the sum"
        tol = 1e-5 if dtype == torch.float32 else 2**-7  # float32 rounding; one bfloat16 step
        err = float(((out.double() - expected).abs() / expected.abs().clamp_min(1e-3)).max())
        assert err <= tol, f"{dtype} {rows}x{hidden}: relative error {err:.2e}"


def check_greedy() -> None:
    """The one-launch greedy argmax against torch's: ties inside a chunk and across chunks (the
    first index wins), a padded row stride, a row of -inf but one token, NaNs (the first wins, as in
    torch); run twice (the counters are left zero for the next call)."""
    from tpserve.kernels.sampling import CHUNK, greedy

    gen = torch.Generator().manual_seed(6)
    rows, vocab = 5, 3 * CHUNK + 17
    logits = (3 * torch.randn(rows, vocab + 9, generator=gen)).to(torch.bfloat16)[:, :vocab]
    logits[0, 5] = logits[0, 9] = 50.0  # a tie inside one chunk
    logits[1, CHUNK + 3] = logits[1, 2 * CHUNK + 1] = 50.0  # a tie across chunks
    logits[2, 0] = logits[2, vocab - 1] = 50.0  # the first and the last token
    logits[3] = float("-inf")
    logits[3, vocab - 2] = 0.0
    logits[4, 2 * CHUNK + 5] = logits[4, 3 * CHUNK + 1] = float("nan")  # NaN wins, the first one (torch's rule)
    logits[4, 0] = 60.0
    counters = torch.zeros(8, dtype=torch.int32)
    for _ in range(2):
        got = greedy(logits, counters)
        assert torch.equal(got, logits.argmax(dim=-1)), f"greedy {got.tolist()} != argmax {logits.argmax(-1).tolist()}"
        assert got.tolist() == [5, CHUNK + 3, 0, vocab - 2, 2 * CHUNK + 5] and counters.eq(0).all()
    everything_nan = torch.full((1, vocab), float("nan"))
    assert greedy(everything_nan, counters).tolist() == [0] == everything_nan.argmax(dim=-1).tolist()


def check_graph_inputs() -> None:
    """The decode graph's install kernel against its torch reference: placeholders resolved from the
    previous samples (one out of range: clamped), a table narrower than the graph's and one wider
    than a block of the kernel, and no table."""
    import numpy as np
    from tpserve.kernels.graph_inputs import install, install_reference, pack

    rng = np.random.default_rng(5)
    for size, width, table_rows in ((1, 3, 2), (5, 300, 8), (4, 0, 0)):
        rows = rng.integers(0, 1000, (3, size), dtype=np.int64)
        rows[0, ::2] = -rng.integers(1, 4, (size + 1) // 2)  # placeholders -(r + 1), r up to 2
        rows[0, 0] = -1
        previous = torch.tensor([11, 22], dtype=torch.int64)  # r = 2 is past the end: clamped
        table = rng.integers(0, 500, (size, width), dtype=np.int32) if table_rows else None
        lens = rng.integers(1, 5000, size, dtype=np.int32) if table_rows else None
        packed = torch.from_numpy(pack(rows, table, lens))
        results = []
        for fn in (install, install_reference):
            tokens = torch.full((3, size + 2), -7, dtype=torch.int64)
            dest = (torch.full((table_rows, width + 5), -7, dtype=torch.int32),
                    torch.full((table_rows,), -7, dtype=torch.int32)) if table_rows else (None, None)
            fn(packed, size, previous, tokens, *dest, width)
            results.append((tokens, *(d for d in dest if d is not None)))
        for got, expected in zip(*results):
            assert torch.equal(got, expected), f"install {got.tolist()} != reference {expected.tolist()}"
        tokens = results[1][0]
        assert tokens[0, 0] == 11 and tokens[:, size:].eq(-7).all() and tokens[1:, :size].tolist() == rows[1:].tolist()
        if table_rows:
            assert results[1][1][:size, :width].tolist() == table.tolist() and results[1][1][:, width:].eq(-7).all()


# Longest first: two processes share them (the interpreter is single-threaded; CI has two cores).
CHECKS = (
    check_small_batch_moe, check_fused_moe, check_routed_moe, check_fp8_experts, check_fused_moe_model,
    check_expert_parallel_moe,
    check_sampler_filters, check_fp8_gemm, check_fp8_gemm_rowwise, check_fp8_mlp, check_sampler_on_edited_logits, check_sampler,
    check_align_kernel_matches_torch, check_router_topk, check_norm_rope_store, check_greedy, check_add_rmsnorm,
    check_kv_store, check_graph_inputs,
)


def run_check(index: int) -> str:
    CHECKS[index]()
    return CHECKS[index].__name__


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    if len(sys.argv) > 1:  # a file for the launches, which hopper_compile.py then compiles
        from hopper_compile import record_launches

        record_launches(sys.argv[1])  # (the forked workers inherit it)
    with multiprocessing.get_context("fork").Pool(min(2, os.cpu_count() or 1)) as pool:
        for name in pool.imap_unordered(run_check, range(len(CHECKS))):
            print(name, flush=True)
    print("ok")
