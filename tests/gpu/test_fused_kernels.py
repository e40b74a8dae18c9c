"""Fused GPU kernels (tpserve.kernels) against the torch code they replace.

Per kernel: FlashInfer's RMSNorm (plain, per-head on a strided view) and the residual add + norm
(tpserve's Triton kernel, also against FlashInfer's),
SiLU-and-mul and rotary (plain and Llama 3 scaled), the Triton KV-cache store, the Triton
q/k norm + rotary + store kernel and the Triton sampler. Then whole tiny models with every fused path on against every fused path off.
Skipped without CUDA, flashinfer or triton, so CI on CPU stays green.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("flashinfer")
pytest.importorskip("triton")

from reference import rel_err
from tpserve import kernels
from tpserve.engine.sampler import Sampler, SamplingBatch
from tpserve.kvcache.pool import KVCachePool
from tpserve.layers.activation import silu_and_mul
from tpserve.layers.norm import RMSNorm
from tpserve.layers.rotary import RotaryEmbedding, inverse_frequencies
from tpserve.sampling_params import SamplingParams as SP

DEVICE = torch.device("cuda")
DTYPE = torch.bfloat16
# Relative L2 error against a float64 reference: bf16 output rounding alone is ~3e-3.
RTOL = 1e-2
PLAIN_ROPE = {"rope_type": "default", "rope_theta": 500000.0}
LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 8192}



def torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "ENABLED", False)


def make_norm(size: int, gen: torch.Generator) -> RMSNorm:
    norm = RMSNorm(size, 1e-6).to(DEVICE)
    norm.weight.data = (1 + 0.3 * torch.randn(size, generator=gen, device=DEVICE)).to(DTYPE)
    return norm


def rms_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_rms_norm(tokens):
    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    norm = make_norm(1024, gen)
    x = torch.randn(tokens, 1024, generator=gen, device=DEVICE).to(DTYPE)
    before = x.clone()
    out = norm(x)
    assert torch.equal(x, before), "plain RMSNorm must not write its input"
    assert rel_err(out, rms_ref(x, norm.weight)) < RTOL


@pytest.mark.parametrize("tokens", [1, 5, 130])
def test_per_head_norm_on_strided_view(tokens):
    """Qwen3's q/k norm reads q straight out of the fused qkv output."""
    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    heads, kv_heads, head_dim = 16, 8, 128
    norm = make_norm(head_dim, gen)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen, device=DEVICE).to(DTYPE)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    for x in (q, k):
        out = norm(x)
        assert out.shape == x.shape
        assert rel_err(out, rms_ref(x, norm.weight)) < RTOL


@pytest.mark.parametrize("tokens", [1, 9, 257])
def test_fused_add_rms_norm_in_place(tokens, monkeypatch):
    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    norm = make_norm(2048, gen)
    x = torch.randn(tokens, 2048, generator=gen, device=DEVICE).to(DTYPE)
    residual = torch.randn(tokens, 2048, generator=gen, device=DEVICE).to(DTYPE)
    x_in, residual_in = x.clone(), residual.clone()
    normed, new_residual = norm(x, residual)
    # In place: the outputs are the input tensors, rewritten.
    assert normed.data_ptr() == x.data_ptr() and new_residual.data_ptr() == residual.data_ptr()
    assert torch.equal(new_residual, x_in + residual_in), "residual is the bf16 sum, as in torch"
    assert rel_err(normed, rms_ref(x_in + residual_in, norm.weight)) < RTOL

    torch_path(monkeypatch)
    ref_normed, ref_residual = norm(x_in.clone(), residual_in.clone())
    assert torch.equal(ref_residual, new_residual)
    assert rel_err(normed, ref_normed) < RTOL


@pytest.mark.parametrize("hidden", [2048, 4096, 5120])
@pytest.mark.parametrize("tokens", [1, 8, 300])
def test_triton_add_rms_norm_matches_flashinfer(tokens, hidden):
    """tpserve's add + RMSNorm (the decoder's, launched with PDL) against FlashInfer's fused kernel,
    whose arithmetic it copies: the residual to the bit, the output within one bf16 step (their
    sums of squares add in different orders)."""
    from tpserve.kernels import flashinfer_ops
    from tpserve.kernels.add_rmsnorm import add_rms_norm_

    gen = torch.Generator(device=DEVICE).manual_seed(hidden + tokens)
    weight = make_norm(hidden, gen).weight
    x = (3 * torch.randn(tokens, hidden, generator=gen, device=DEVICE)).to(DTYPE)
    residual = torch.randn(tokens, hidden, generator=gen, device=DEVICE).to(DTYPE)
    ours = add_rms_norm_(x.clone(), residual.clone(), weight, 1e-6)
    theirs = flashinfer_ops.fused_add_rms_norm_(x.clone(), residual.clone(), weight, 1e-6)
    assert torch.equal(ours[1], theirs[1]), "the new residual differs from FlashInfer's"
    step = torch.exp2(torch.floor(torch.log2(theirs[0].float().abs().clamp_min(1e-30))) - 7)
    assert bool(((ours[0].float() - theirs[0].float()).abs() <= step).all()), "normed rows differ by over a bf16 step"
    assert float((ours[0] == theirs[0]).float().mean()) > 0.99


@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_silu_and_mul(tokens):
    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    x = (2 * torch.randn(tokens, 2 * 3072, generator=gen, device=DEVICE)).to(DTYPE)
    out = silu_and_mul(x)
    gate, up = x.double().chunk(2, dim=-1)
    assert out.shape == (tokens, 3072)
    assert rel_err(out, torch.nn.functional.silu(gate) * up) < RTOL


def rotary_ref(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    angles = positions.double()[:, None] * inv_freq.double().to(x.device)[None, :]
    cos = torch.cat((angles.cos(), angles.cos()), -1)[:, None, :]
    sin = torch.cat((angles.sin(), angles.sin()), -1)[:, None, :]
    x = x.double()
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


@pytest.mark.parametrize("rope", [PLAIN_ROPE, LLAMA3_ROPE, YARN_ROPE], ids=["plain", "llama3", "yarn"])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "qkv-view"])
def test_rotary_in_place(rope, strided, monkeypatch):
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    tokens, heads, kv_heads, head_dim, max_pos = 77, 8, 2, 128, 32768
    rotary = RotaryEmbedding(head_dim, max_pos, rope, 8192)
    rotary.build_cache(DEVICE, DTYPE)
    assert rotary.cos_sin_cache is not None and rotary.cos_sin_cache.dtype == torch.float32
    positions = torch.randint(0, max_pos, (tokens,), generator=gen, device=DEVICE)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen, device=DEVICE).to(DTYPE)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    if not strided:
        q, k = q.contiguous(), k.contiguous()
    q_in, k_in = q.clone(), k.clone()
    inv_freq, attention_scaling = inverse_frequencies(head_dim, rope, 8192)

    q_out, k_out = rotary(positions, q, k)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr(), "rotates in place"
    assert rel_err(q_out, attention_scaling * rotary_ref(q_in, positions, inv_freq)) < RTOL
    assert rel_err(k_out, attention_scaling * rotary_ref(k_in, positions, inv_freq)) < RTOL

    torch_path(monkeypatch)
    q_torch, k_torch = rotary(positions, q_in, k_in)
    assert rel_err(q_out, q_torch) < RTOL and rel_err(k_out, k_torch) < RTOL


@pytest.mark.parametrize("tokens", [1, 40, 1000])
def test_kv_store_matches_torch(tokens, monkeypatch):
    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    pages, page_size, kv_heads, head_dim = 128, 16, 4, 128
    fused = KVCachePool(2, pages, page_size, kv_heads, head_dim, DTYPE, DEVICE)
    qkv = torch.randn(tokens, 3 * kv_heads * head_dim, generator=gen, device=DEVICE).to(DTYPE)
    k = qkv[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, 2 * kv_heads * head_dim :].view(tokens, kv_heads, head_dim)  # strided, as in the model
    slots = torch.randperm(pages * page_size, generator=gen, device=DEVICE)[:tokens]
    fused.store(1, slots, k, v)

    torch_path(monkeypatch)
    reference = KVCachePool(2, pages, page_size, kv_heads, head_dim, DTYPE, DEVICE)
    reference.store(1, slots, k, v)
    for layer in range(2):
        assert torch.equal(fused.k[layer], reference.k[layer]) and torch.equal(fused.v[layer], reference.v[layer])


@pytest.mark.parametrize("cache", ["bf16", "fp8"])
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qwen3", "llama"])
@pytest.mark.parametrize("tokens", [1, 40, 1000])
def test_norm_rope_store_matches_unfused(tokens, qk_norm, cache):
    """The one-kernel q/k norm + rotary + KV store against FlashInfer's norm and rotary kernels
    followed by the Triton store: same rounding steps, so equal up to float32 summation order
    (into an FP8 cache: the same k within one e4m3 step, v equal)."""
    from tpserve.quant.fp8 import FP8_DTYPE

    from tpserve.kernels import flashinfer_ops
    from tpserve.kernels.rope_store import norm_rope_store

    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    pages, page_size, heads, kv_heads, head_dim, max_pos = 128, 16, 8, 2, 128, 40960
    rotary = RotaryEmbedding(head_dim, max_pos, {"rope_type": "default", "rope_theta": 1000000.0}, max_pos)
    rotary.build_cache(DEVICE, DTYPE)
    q_norm, k_norm = make_norm(head_dim, gen), make_norm(head_dim, gen)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen, device=DEVICE).to(DTYPE)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen, device=DEVICE)
    slots = torch.randperm(pages * page_size, generator=gen, device=DEVICE)[:tokens]
    if cache == "fp8":
        qkv = qkv * 300  # past e4m3's 448, so the clamp is exercised
    cache_dtype = FP8_DTYPE if cache == "fp8" else DTYPE
    fused = KVCachePool(1, pages, page_size, kv_heads, head_dim, cache_dtype, DEVICE, DTYPE)
    weights = (q_norm.weight, k_norm.weight) if qk_norm else (None, None)
    q_fused = norm_rope_store(qkv, positions, rotary.cos_sin_cache, *weights, 1e-6, fused.k[0], fused.v[0], slots,
                              heads, kv_heads, head_dim)

    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
    if qk_norm:
        q, k = q_norm(q), k_norm(k)
    else:
        q, k = q.clone(), k.clone()
    flashinfer_ops.rotary_(positions, q, k, rotary.cos_sin_cache)
    unfused = KVCachePool(1, pages, page_size, kv_heads, head_dim, cache_dtype, DEVICE, DTYPE)
    unfused.store(0, slots, k, v)
    # One bf16 ulp where a float32 sum in another order rounds the other way.
    torch.testing.assert_close(q_fused, q, rtol=8e-3, atol=8e-3)
    k_tol = 0.13 if cache == "fp8" else 8e-3  # e4m3 has 3 mantissa bits: one step is up to 2^-3 relative
    torch.testing.assert_close(fused.k[0].float(), unfused.k[0].float(), rtol=k_tol, atol=k_tol)
    assert torch.equal(fused.v[0].view(torch.uint8) if cache == "fp8" else fused.v[0],
                       unfused.v[0].view(torch.uint8) if cache == "fp8" else unfused.v[0])
    if cache == "fp8":
        assert float(fused.v[0].float().abs().max()) == 448.0
    assert (q_fused == q).float().mean() > 0.99


# ---- sampling ----

VOCAB = 151_936  # Qwen3's


def random_batch(rows: int, seed: int, greedy_every: int = 4) -> tuple[torch.Tensor, SamplingBatch]:
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(rows, VOCAB, generator=gen)).to(DEVICE, DTYPE)
    temps = (0.1 + 1.9 * torch.rand(rows, generator=gen)).tolist()
    params = [SP(temperature=0.0 if i % greedy_every == 0 else temps[i]) for i in range(rows)]
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=gen).tolist()
    steps = torch.randint(0, 2**40, (rows,), generator=gen).tolist()
    return logits, SamplingBatch.build(params, seeds, steps, VOCAB, DEVICE)


@pytest.mark.parametrize("rows", [1, 64, 256])
def test_sampler_kernel_matches_torch(rows):
    logits, batch = random_batch(rows, seed=rows)
    sampler = Sampler()
    fused = sampler(logits, batch)
    reference = sampler.sample_torch(logits, batch)
    greedy = batch.temperatures == 0
    assert torch.equal(fused[greedy], reference[greedy]), "greedy rows must be exactly equal"
    agree = (fused == reference).float().mean().item()
    assert agree >= 0.99, f"only {agree:.1%} of rows agree with the torch path"
    assert torch.equal(sampler(logits, batch), fused), "repeated calls must pick the same tokens"


@pytest.mark.parametrize("rows", [1, 3, 300])
def test_greedy_kernel_matches_argmax(rows):
    """An all-greedy batch takes the one-launch argmax kernel: torch.argmax's tokens (first index on
    ties, within a chunk and across chunks; the first NaN), on bf16 and float32 logits, twice in a row."""
    gen = torch.Generator(device=DEVICE).manual_seed(rows)
    logits = torch.randn(rows, VOCAB, generator=gen, device=DEVICE)
    logits[0, 7] = logits[0, VOCAB - 3] = 100.0  # a tie across chunks
    if rows > 1:
        logits[-1, 900] = logits[-1, 9000] = float("nan")  # torch.argmax's rule: the first NaN wins
    batch = SamplingBatch.build([SP(temperature=0.0)] * rows, [0] * rows, [0] * rows, VOCAB, DEVICE)
    sampler = Sampler()
    for dtype in (DTYPE, torch.float32):
        for _ in range(2):
            assert torch.equal(sampler(logits.to(dtype), batch), logits.to(dtype).argmax(dim=-1))
    assert int(sampler(logits, batch)[0]) == 7 and (rows == 1 or int(sampler(logits, batch)[-1]) == 900)


def test_sampler_kernel_reads_padded_rows():
    """Tensor-parallel logits are a slice of a wider (padded) tensor."""
    logits, batch = random_batch(8, seed=5)
    wide = torch.zeros(8, VOCAB + 64, dtype=DTYPE, device=DEVICE)
    wide[:, :VOCAB] = logits
    assert torch.equal(Sampler()(wide[:, :VOCAB], batch), Sampler()(logits, batch))


FILTER_KINDS = [
    SP(temperature=0.7), SP(temperature=0.0), SP(temperature=0.9, top_k=50), SP(temperature=1.0, top_p=0.8),
    SP(temperature=0.8, min_p=0.05), SP(temperature=1.3), SP(temperature=0.6, top_k=20, top_p=0.8),
    SP(temperature=1.5, top_k=5, top_p=0.5, min_p=0.2), SP(temperature=2.0, top_p=0.95), SP(temperature=0.7, top_k=1),
    SP(temperature=1.2, top_k=1000, top_p=0.9, min_p=0.01),
]


def kept_sets(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[B, V] bool: the tokens the torch path's top-k/top-p/min-p keep."""
    from tpserve.engine.sampler import Workspace, _keep_thresholds, _tempered_weights

    weights = _tempered_weights(logits, batch.temperatures, Workspace()).clone()
    threshold = _keep_thresholds(weights, batch)
    return weights >= threshold[:, None] if threshold is not None else torch.ones_like(weights, dtype=torch.bool)


@pytest.mark.parametrize("rows", [48, 256])
def test_sampler_filters_in_kernel_match_torch(rows):
    """top-k/top-p/min-p rows are sampled in the kernel (bisection, no sort), like the torch path."""
    gen = torch.Generator().manual_seed(11 + rows)
    logits = (3 * torch.randn(rows, VOCAB, generator=gen)).to(DEVICE, DTYPE)
    logits[0, :100] = 9.0  # ties at the top, across the top-k cut-off
    params = [FILTER_KINDS[i % len(FILTER_KINDS)] for i in range(rows)]
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=gen).tolist()
    batch = SamplingBatch.build(params, seeds, [3] * rows, VOCAB, DEVICE)
    sampler = Sampler()
    fused = sampler(logits, batch)
    reference = sampler.sample_torch(logits, batch)
    sampled = batch.temperatures > 0
    assert torch.equal(fused[~sampled], reference[~sampled]), "greedy rows must be exactly equal"
    assert bool(kept_sets(logits, batch)[sampled].gather(1, fused[sampled, None]).all()), "a token outside the kept set"
    agree = (fused == reference).float().mean().item()
    assert agree >= 0.99, f"only {agree:.1%} of rows agree with the torch path"
    assert torch.equal(sampler(logits, batch), fused), "repeated calls must pick the same tokens"


@pytest.mark.parametrize("param", [SP(temperature=0.6, top_k=20, top_p=0.8), SP(temperature=1.0, top_p=0.9, min_p=0.02)])
def test_sampler_filters_many_seeds(param):
    """One row, many seeds: the kernel's tokens stay in the torch path's kept set and agree."""
    samples = 4096
    gen = torch.Generator().manual_seed(3)
    row = (3 * torch.randn(VOCAB, generator=gen)).to(DTYPE)
    logits = row.to(DEVICE).expand(samples, -1)
    batch = SamplingBatch.build([param] * samples, list(range(samples)), [0] * samples, VOCAB, DEVICE)
    sampler = Sampler()
    fused = sampler(logits, batch)
    reference = sampler.sample_torch(logits.contiguous(), batch)
    assert bool(kept_sets(logits.contiguous(), batch).gather(1, fused[:, None]).all()), "a token outside the kept set"
    agree = (fused == reference).float().mean().item()
    assert agree >= 0.99, f"only {agree:.1%} of rows agree with the torch path"


def test_sampler_kernel_distribution():
    """Many seeds on one row: the empirical distribution is softmax(logits / t)."""
    samples, temperature = 40_000, 0.7
    gen = torch.Generator().manual_seed(7)
    row = torch.full((VOCAB,), -30.0)
    hot = torch.randperm(VOCAB, generator=gen)[:12]
    row[hot] = torch.randn(12, generator=gen) * 1.5
    row = row.to(DTYPE)
    logits = row.to(DEVICE).expand(samples, -1)  # row stride 0: every row reads the same logits
    batch = SamplingBatch.build([SP(temperature=temperature)] * samples, list(range(samples)), [0] * samples, VOCAB, DEVICE)
    tokens = Sampler()(logits, batch).cpu()
    counts = torch.bincount(tokens, minlength=VOCAB).double() / samples
    expected = torch.softmax(row.double() / temperature, dim=-1)
    tv = 0.5 * (counts - expected).abs().sum().item()
    assert tv < 0.02, f"total variation {tv:.4f} from softmax(logits / t)"


# ---- whole models ----


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model_dir(request, tmp_path_factory) -> str:
    from tpserve.tiny import make_tiny_model

    # head_dim 128 everywhere: the FlashInfer attention kernels cached for the benchmarks.
    # Llama (no q/k norm: rotary runs in place on views of qkv; Llama 3 scaled frequencies) at
    # GQA 2, Qwen3 (per-head q/k norm) at GQA 4.
    heads, kv_heads = (2, 1) if request.param == "llama" else (8, 2)
    out = tmp_path_factory.mktemp(f"tiny-fused-{request.param}")
    return make_tiny_model(
        str(out), request.param, num_layers=2, hidden_size=256, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=128, intermediate_size=512, seed=2,
    )


def make_engine(model_dir: str, dtype: str, backend: str, graphs: int):
    from tpserve.engine_config import EngineConfig
    from tpserve.engine.engine import Engine

    config = EngineConfig(
        model=model_dir, device="cuda", dtype=dtype, attention_backend=backend,
        cuda_graph_max_bs=graphs, max_total_tokens=16384, page_size=16,
    )
    return Engine(config)


def logits_errors(actual: list[torch.Tensor], exact: list[torch.Tensor]) -> list[float]:
    """Per step, relative L2 error of the rows that ran."""
    errors = []
    for a, e in zip(actual, exact):
        valid = ~torch.isnan(e[:, 0])
        assert torch.equal(valid, ~torch.isnan(a[:, 0])), "different rows ran"
        if valid.any():
            assert torch.isfinite(a[valid]).all(), "non-finite logits"
            errors.append(rel_err(a[valid], e[valid]))
    return errors


@pytest.mark.parametrize("graphs", [0, 16], ids=["eager", "graphs"])
def test_model_fused_as_accurate_as_torch_path(model_dir, graphs, monkeypatch):
    """bf16 with every fused path on, and with every one off, against the model computed in
    float32 on the same (bf16-rounded) weights, teacher-forced on that model's greedy tokens
    (prefills, a chunked prefill mixed with decodes, 16 decode steps). On these tiny models
    (sharp attention by construction) the bf16 torch path is itself 2-7% off per step (measured
    on the CPU), so the two bf16 paths are not compared with each other: the fused one must be,
    on average over the steps, about as close to float32 as the torch one (or closer), and no
    step may be far off (a wrong kernel gives errors of order 1)."""
    from engine_scenario import prompts_for, run_scenario

    exact = make_engine(model_dir, "float32", "torch", 0)
    with torch.no_grad():
        for param in exact.model.parameters():
            param.copy_(param.to(DTYPE).float())
    prompts = prompts_for(5, exact.model_config.vocab_size, seed=graphs)
    exact_tokens, exact_logits = run_scenario(exact, prompts)
    del exact

    fused = make_engine(model_dir, "bfloat16", "flashinfer", graphs)
    assert fused.model.rotary.cos_sin_cache is not None, "fused path expected on CUDA"
    _, fused_logits = run_scenario(fused, prompts, forced=exact_tokens)
    del fused

    torch_path(monkeypatch)
    reference = make_engine(model_dir, "bfloat16", "flashinfer", graphs)
    assert reference.model.rotary.cos_sin_cache is None
    _, torch_logits = run_scenario(reference, prompts, forced=exact_tokens)

    fused_err, torch_err = logits_errors(fused_logits, exact_logits), logits_errors(torch_logits, exact_logits)
    fused_mean, torch_mean = sum(fused_err) / len(fused_err), sum(torch_err) / len(torch_err)
    print(f"relative logits error vs float32, mean over {len(fused_err)} steps: fused {fused_mean:.3f}, torch path {torch_mean:.3f}")
    assert max(fused_err) < 0.25, f"fused path far off float32 at some step: {fused_err}"
    assert fused_mean <= max(2e-2, 1.25 * torch_mean), f"fused {fused_err} vs torch path {torch_err}"
