"""The CUDA small-M GEMV (``kernels.gemv``): every token count 1..8 at the linears of Qwen3-8B,
Qwen3-32B and Qwen3-30B-A3B's dense parts (TP 1 and TP 2 shards), bf16 and FP8 weights, against a
float32 torch reference; deterministic; in a CUDA graph; edge shapes and the errors; a tiny model
served with it on and off. Skipped without an FP8 GPU (sm89+)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs an FP8 GPU (sm89+)"
)

from reference import rel_err
from tpserve import LLM, SamplingParams
from tpserve.engine_config import EngineConfig
from tpserve.engine.engine import Engine
from fp8_checkpoint import write_dequantized, write_fp8_checkpoint
from gemv_reference import gemv_reference
from tpserve.forward import SequenceInput
from tpserve.kernels.gemv import (
    BF16_GEMV_ENV, FUSE_NORM_ENV, FUSED_MAX_TOKENS, PDL_ENV, MAX_TOKENS, SILU_MUL_MAX_TOKENS, gemv, supported,
)
from tpserve.kernels.pdl import TRITON_PDL_ENV
from tpserve.kvcache.pool import PageAllocator
from tpserve.quant.fp8 import quantize_blocks, weight_only_reference

DEVICE = torch.device("cuda")
BLOCK = (128, 128)
# (N, K) of qkv, o, gate_up, down at TP 1 (A3B: only qkv and o are dense)
TP1 = {
    "8B": [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)],
    "32B": [(10240, 5120), (5120, 8192), (51200, 5120), (5120, 25600)],
    "30B-A3B": [(5120, 2048), (2048, 4096)],
}
# and their TP 2 shards: qkv and gate_up split N, o and down split K
SHAPES = sorted(
    {s for shapes in TP1.values() for i, (n, k) in enumerate(shapes) for s in ((n, k), (n, k // 2) if i % 2 else (n // 2, k))}
)
# bf16 only: the MoE router of Qwen3-30B-A3B and the LM heads of Qwen3-0.6B/8B (tpserve.kernels.gemv.linear)
BF16_ONLY = [(128, 2048), (151936, 1024), (151936, 4096)]
TINY = dict(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=128, intermediate_size=512, seed=1)



def weights(n: int, k: int, fp8: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    w = (0.02 * torch.randn(n, k, device=DEVICE, generator=gen)).to(torch.bfloat16)
    return quantize_blocks(w, BLOCK) if fp8 else (w, None)


def reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    if scale is None:
        return x.float() @ w.float().T
    return weight_only_reference(x.float(), w, scale, BLOCK)


@pytest.mark.parametrize("fp8,n,k", [(fp8, n, k) for fp8 in (False, True) for n, k in SHAPES] + [(False, n, k) for n, k in BF16_ONLY])
def test_gemv_matches_reference(n, k, fp8):
    w, scale = weights(n, k, fp8)
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    for m in range(1, MAX_TOKENS + 1):
        x = torch.randn(m, k, device=DEVICE, generator=gen).to(torch.bfloat16)
        got = gemv(x, w, scale)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        err = rel_err(got, reference(x, w, scale))
        assert err < 5e-3, f"m={m}: relative error {err:.2e}"
        assert torch.equal(got, gemv(x, w, scale)), f"m={m}: not deterministic"


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("n,k", [(130, 144), (1, 16), (300, 4112), (6144, 4096)])
def test_gemv_edges_and_graph(n, k, fp8):
    """N not a multiple of a block's rows, partial scale blocks, one row; replayed in a CUDA graph
    over new activations, 3-D input."""
    w, scale = weights(n, k, fp8, seed=2)
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    for m in (1, 3, 8):
        x = torch.empty(1, m, k, device=DEVICE, dtype=torch.bfloat16)
        x.copy_(torch.randn(1, m, k, device=DEVICE, generator=gen))
        gemv(x, w, scale)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = gemv(x, w, scale)
        x.copy_(torch.randn(1, m, k, device=DEVICE, generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        assert out.shape == (1, m, n)
        assert rel_err(out, reference(x[0], w, scale).unsqueeze(0)) < 5e-3


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gemv_pdl_chain_in_graph(fp8):
    """Launched with PDL, a GEMV may start before the kernel that writes its x has finished: a
    FlashInfer RMSNorm (PDL too) then two GEMVs, the second reading the first's output, replayed in
    a CUDA graph on new inputs; the bits equal those of launches without PDL."""
    from flashinfer.norm import rmsnorm

    w1, s1 = weights(6144, 4096, fp8, seed=4)
    w2, s2 = weights(4096, 6144, fp8, seed=5)
    norm_weight = torch.rand(4096, device=DEVICE).to(torch.bfloat16) + 0.5
    gen = torch.Generator(device=DEVICE).manual_seed(6)
    src = torch.randn(1, 4096, device=DEVICE, generator=gen).to(torch.bfloat16)

    def chain(pdl: bool) -> torch.Tensor:
        x = rmsnorm(src, norm_weight, 1e-6, enable_pdl=pdl)
        return gemv(gemv(x, w1, s1, pdl=pdl), w2, s2, pdl=pdl)

    chain(True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(True)
    for _ in range(3):
        src.copy_(torch.randn(1, 4096, device=DEVICE, generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        expected = chain(False)
        assert torch.equal(out, expected), "PDL changed the result"
        x = rmsnorm(src, norm_weight, 1e-6, enable_pdl=False)
        ref = reference(reference(x, w1, s1).to(torch.bfloat16), w2, s2)
        assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("n,k", [(24576, 4096), (12288, 4096), (1536, 2048), (400, 144), (16, 16)])
def test_gemv_silu_mul_equals_gemv_then_silu_and_mul(n, k, fp8):
    """The SwiGLU epilogue against the GEMV followed by FlashInfer's silu_and_mul (the same formula on
    the same bf16 sums: equal but for the last bit where the two compilations round differently),
    at the token counts it takes, including I = N / 2 not a multiple of a block's outputs or of a 128-row
    scale block; in a CUDA graph too."""
    from tpserve.kernels.flashinfer_ops import silu_and_mul

    w, scale = weights(n, k, fp8, seed=7)
    gen = torch.Generator(device=DEVICE).manual_seed(8)
    for m in range(1, SILU_MUL_MAX_TOKENS + 1):
        x = torch.randn(m, k, device=DEVICE, generator=gen).to(torch.bfloat16)
        got = gemv(x, w, scale, silu_mul=True)
        assert got.shape == (m, n // 2)
        expected = silu_and_mul(gemv(x, w, scale))
        unequal = int((got != expected).sum())
        assert torch.allclose(got.float(), expected.float(), rtol=2**-7, atol=0), f"m={m}: {unequal} outputs differ"
        assert unequal <= got.numel() // 100, f"m={m}: {unequal} of {got.numel()} outputs differ in their last bit"
    x = torch.randn(1, k, device=DEVICE, generator=gen).to(torch.bfloat16)
    gemv(x, w, scale, silu_mul=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv(x, w, scale, silu_mul=True)
    x.copy_(torch.randn(1, k, device=DEVICE, generator=gen))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, gemv(x, w, scale, silu_mul=True))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("n,k", [(6144, 4096), (24576, 4096), (4096, 12288), (2048, 4096), (400, 144), (16, 16)])
def test_gemv_fused_norm_and_add(n, k, fp8):
    """The decoder's add + RMSNorm in the GEMV: ``norm`` (plain and with SiLU-and-mul) against the float32
    reference and against FlashInfer's RMSNorm then the GEMV (which rounds the normed x to bf16);
    ``add_to`` equal to the GEMV's output added in float32 and rounded, in place; 1 and 2 tokens."""
    from tpserve.kernels.flashinfer_ops import rms_norm, silu_and_mul

    w, scale = weights(n, k, fp8, seed=9)
    gen = torch.Generator(device=DEVICE).manual_seed(10)
    norm_weight = (torch.rand(k, device=DEVICE, generator=gen) + 0.5).to(torch.bfloat16)
    for m in range(1, FUSED_MAX_TOKENS + 1):
        x = (3 * torch.randn(m, k, device=DEVICE, generator=gen)).to(torch.bfloat16)
        normed = rms_norm(x, norm_weight, 1e-6)
        got = gemv(x, w, scale, norm=(norm_weight, 1e-6))
        assert rel_err(got, gemv_reference(x, w, scale, norm=(norm_weight, 1e-6)).float()) < 5e-3
        assert rel_err(got, gemv(normed, w, scale).float()) < 1e-2
        assert torch.equal(got, gemv(x, w, scale, norm=(norm_weight, 1e-6))), "not deterministic"
        act = gemv(x, w, scale, silu_mul=True, norm=(norm_weight, 1e-6))
        assert rel_err(act, gemv_reference(x, w, scale, silu_mul=True, norm=(norm_weight, 1e-6)).float()) < 1e-2
        assert rel_err(act, silu_and_mul(gemv(normed, w, scale)).float()) < 2e-2

        residual = torch.randn(m, n, device=DEVICE, generator=gen).to(torch.bfloat16)
        expected = (residual.float() + gemv(x, w, scale).float()).to(torch.bfloat16)
        out = gemv(x, w, scale, add_to=residual)
        assert out is residual and torch.equal(residual, expected), f"m={m}: add_to differs"


def row_scaled(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(FP8 weight, its scales as the layers hold a compressed-tensors per-channel checkpoint's: [N, 1], the weight
    dequantized in float32); rows of scales 1,000x apart, so a row read as another's shows."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    w = 0.02 * torch.randn(n, k, device=DEVICE, generator=gen) * 10 ** (3 * torch.rand(n, 1, device=DEVICE, generator=gen))
    scale = w.abs().amax(dim=1, keepdim=True) / 448
    wq = (w / scale).to(torch.float8_e4m3fn)
    return wq, scale, wq.float() * scale


@pytest.mark.parametrize("n,k", [(6144, 4096), (24576, 4096), (4096, 12288), (400, 144), (404, 144), (16, 16)])
def test_gemv_row_scales(n, k):
    """One scale per weight row (``row_scales``: compressed-tensors' per-channel FP8) at one token, against float32
    on the dequantized weight: plain, with the RMSNorm fused, with SiLU-and-mul (the gate and up rows each their own
    scale), added to a residual stream; deterministic, and in a CUDA graph."""
    wq, scale, w = row_scaled(n, k, seed=11)
    gen = torch.Generator(device=DEVICE).manual_seed(12)
    x = torch.randn(1, k, device=DEVICE, generator=gen).to(torch.bfloat16)
    got = gemv(x, wq, scale, row_scales=True)
    assert rel_err(got, x.float() @ w.T) < 5e-3 and torch.equal(got, gemv(x, wq, scale, row_scales=True))
    norm_weight = (torch.rand(k, device=DEVICE, generator=gen) + 0.5).to(torch.bfloat16)
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weight.float()
    assert rel_err(gemv(x, wq, scale, norm=(norm_weight, 1e-6), row_scales=True), normed @ w.T) < 5e-3
    sums = (normed @ w.T).to(torch.bfloat16).float()
    swiglu = torch.nn.functional.silu(sums[:, : n // 2]) * sums[:, n // 2 :]
    silu_rows = n % 8 == 0  # (404: the last block of rows partial, no SwiGLU pairs)
    if silu_rows:
        assert rel_err(gemv(x, wq, scale, silu_mul=True, norm=(norm_weight, 1e-6), row_scales=True), swiglu) < 1e-2
    residual = torch.randn(1, n, device=DEVICE, generator=gen).to(torch.bfloat16)
    expected = (residual.float() + got.float()).to(torch.bfloat16)
    assert torch.equal(gemv(x, wq, scale, add_to=residual, row_scales=True), expected)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv(x, wq, scale, silu_mul=silu_rows, row_scales=True)
    x.copy_(torch.randn(1, k, device=DEVICE, generator=gen))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, gemv(x, wq, scale, silu_mul=silu_rows, row_scales=True))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gemv_outlier_activations(fp8):
    """Activations as large as real models' outliers (|x| up to ~2e4 in a few dimensions, the rest small), plain,
    normed and added to: the float32 reference's result, nothing overflowed (a kernel that sums in f16, such as
    session 18's FP8_HALF experiment, overflows here)."""
    n, k = 4096, 4096
    w, scale = weights(n, k, fp8, seed=16)
    gen = torch.Generator(device=DEVICE).manual_seed(17)
    norm_weight = (torch.rand(k, device=DEVICE, generator=gen) + 0.5).to(torch.bfloat16)
    for big in (3e2, 3e3, 2e4):
        x = torch.randn(1, k, device=DEVICE, generator=gen)
        x[0, torch.randperm(k, device=DEVICE, generator=gen)[:64]] *= big
        x = x.to(torch.bfloat16)
        got = gemv(x, w, scale)
        assert torch.isfinite(got).all() and rel_err(got, reference(x, w, scale)) < 5e-3, f"|x| ~ {big}"
        normed = gemv(x, w, scale, norm=(norm_weight, 1e-6))
        assert rel_err(normed, gemv_reference(x, w, scale, norm=(norm_weight, 1e-6)).float()) < 5e-3, f"|x| ~ {big}"
        residual = torch.zeros(1, n, device=DEVICE, dtype=torch.bfloat16)
        assert torch.equal(gemv(x, w, scale, add_to=residual), got)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gemv_fused_chain_in_graph(fp8):
    """As a decoder chains them, with PDL in a CUDA graph: o_proj adds to the residual, gate_up_proj
    (SwiGLU) norms it, down_proj adds, qkv_proj norms; replayed on new inputs, the bits equal
    launches without PDL, and the results the float32 reference step by step."""
    wo, so = weights(4096, 4096, fp8, seed=11)
    wgu, sgu = weights(2 * 12288, 4096, fp8, seed=12)
    wd, sd = weights(4096, 12288, fp8, seed=13)
    wqkv, sqkv = weights(6144, 4096, fp8, seed=14)
    gen = torch.Generator(device=DEVICE).manual_seed(15)
    norms = [(torch.rand(4096, device=DEVICE, generator=gen) + 0.5).to(torch.bfloat16) for _ in range(2)]
    attn = torch.empty(1, 4096, device=DEVICE, dtype=torch.bfloat16)
    start = torch.empty(1, 4096, device=DEVICE, dtype=torch.bfloat16)
    residual = torch.empty_like(start)

    def chain(pdl: bool, fn=gemv) -> tuple[torch.Tensor, torch.Tensor]:
        residual.copy_(start)
        fn(attn, wo, so, pdl=pdl, add_to=residual)
        act = fn(residual, wgu, sgu, pdl=pdl, silu_mul=True, norm=(norms[0], 1e-6))
        fn(act, wd, sd, pdl=pdl, add_to=residual)
        return fn(residual, wqkv, sqkv, pdl=pdl, norm=(norms[1], 1e-6)), residual

    chain(True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qkv, _ = chain(True)
    for _ in range(3):
        attn.copy_(torch.randn(1, 4096, device=DEVICE, generator=gen))
        start.copy_(3 * torch.randn(1, 4096, device=DEVICE, generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        got_qkv, got_residual = qkv.clone(), residual.clone()
        expected_qkv, expected_residual = chain(False)
        same = torch.equal(got_qkv, expected_qkv) and torch.equal(got_residual, expected_residual)
        assert same, "PDL changed the result"
        ref_qkv, ref_residual = chain(False, fn=lambda *a, pdl, **kw: gemv_reference(*a, **kw))
        assert rel_err(got_residual, ref_residual.float()) < 5e-3 and rel_err(got_qkv, ref_qkv.float()) < 2e-2


def test_gemv_rejects_what_it_cannot_run():
    w, scale = weights(256, 256, True)
    x = torch.randn(MAX_TOKENS + 1, 256, device=DEVICE, dtype=torch.bfloat16)
    assert supported(x[:MAX_TOKENS], w, scale) and not supported(x, w, scale)
    with pytest.raises(ValueError, match="rows of x"):
        gemv(x, w, scale)
    with pytest.raises(ValueError, match="multiple of 16"):
        gemv(x[:1, :40], w[:, :40].contiguous(), torch.ones(2, 1, device=DEVICE))
    with pytest.raises(ValueError, match="scale_inv"):
        gemv(x[:1], w, scale[:, :1].contiguous())
    with pytest.raises(ValueError, match="bf16"):
        gemv(x[:1].float(), w, scale)
    with pytest.raises(ValueError, match="multiple of 8"):
        gemv(x[:1], w[:12].contiguous(), scale[:1].contiguous(), silu_mul=True)
    with pytest.raises(ValueError, match="rows of x"):
        gemv(x[:SILU_MUL_MAX_TOKENS + 1], w, scale, silu_mul=True)
    norm = (torch.ones(256, device=DEVICE, dtype=torch.bfloat16), 1e-6)
    residual = torch.zeros(1, 256, device=DEVICE, dtype=torch.bfloat16)
    assert supported(x[:FUSED_MAX_TOKENS], w, scale, fused=True) and not supported(x[:3], w, scale, fused=True)
    with pytest.raises(ValueError, match="fused with a norm or add"):
        gemv(x[:FUSED_MAX_TOKENS + 1], w, scale, norm=norm)
    with pytest.raises(ValueError, match="do not combine"):
        gemv(x[:1], w, scale, norm=norm, add_to=residual)
    with pytest.raises(ValueError, match="norm weight"):
        gemv(x[:1], w, scale, norm=(norm[0][:128], 1e-6))
    with pytest.raises(ValueError, match="add_to must be"):
        gemv(x[:1], w, scale, add_to=residual[:, :128])
    with pytest.raises(ValueError, match="add_to must be"):
        gemv(x[:1], w, scale, silu_mul=True, add_to=residual[:, :128])


def test_tiny_model_with_bf16_gemv(tiny_model_factory, monkeypatch):
    """Greedy decode of a tiny bf16 model, CUDA graphs on, the bf16 GEMV on (the default) and off
    (TPSERVE_BF16_GEMV=0)."""
    model = tiny_model_factory("qwen3", **TINY)
    monkeypatch.delenv(BF16_GEMV_ENV, raising=False)
    engine = Engine(EngineConfig(model=model, device="cuda", dtype="bfloat16", max_total_tokens=1024))
    assert engine.model.model.layers[0].mlp.down_proj.bf16_gemv and engine.graph_runner is not None
    assert engine.model.lm_head.bf16_gemv and engine.model.model.layers[0].mlp.gate_up_proj.gemv_silu_mul
    del engine
    prompts = [[1, 2, 3], [7, 8], list(range(10, 150))]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv(BF16_GEMV_ENV, flag)
        with LLM(model, device="cuda", dtype="bfloat16", max_total_tokens=1024) as llm:
            outs[flag] = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    print(f"bf16 GEMV on {outs['1']} off {outs['0']}")
    assert all(len(t) == 12 for t in outs["1"])
    assert sum(a[0] == b[0] for a, b in zip(outs["1"], outs["0"])) >= 2


def single_sequence_logits(engine: Engine, ids: list[int], prefill: int) -> torch.Tensor:
    """Prefill ``ids[:prefill]``, then decode the rest one token a step, one sequence (batch 1)."""
    pages = PageAllocator(engine.num_pages).allocate(-(-len(ids) // engine.page_size))
    # clones: a CUDA graph replay overwrites the logits of the one before
    rows = [engine.forward([SequenceInput(ids[:prefill], 0, pages)])[0].clone()]
    for pos in range(prefill, len(ids) - 1):
        rows.append(engine.forward([SequenceInput([ids[pos]], pos, pages)])[0].clone())
    return torch.stack(rows).float()


TINY_MOE = dict(TINY, num_layers=3, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128)


@pytest.mark.parametrize("fuse", ["0", "1"], ids=["separate_norm", "fused_norm"])
@pytest.mark.parametrize("arch,quantization", [("qwen3", None), ("qwen3", "fp8"), ("qwen3_moe", None)])
def test_tiny_model_graph_with_pdl_equals_eager(tiny_model_factory, monkeypatch, arch, quantization, fuse):
    """Batch-1 decode of a tiny model in CUDA graphs, where PDL lets each kernel start while the one
    before it runs, gives the bits of eager steps launched without PDL (the GEMV's and Triton's): PDL
    changes no arithmetic, only when a kernel may read its input. With x read by __ldg the FP8 model's
    logits were wrong (relative difference 1.3, session 16)."""
    model = tiny_model_factory(arch, **(TINY_MOE if arch == "qwen3_moe" else TINY))
    monkeypatch.delenv(BF16_GEMV_ENV, raising=False)
    monkeypatch.setenv(FUSE_NORM_ENV, fuse)
    ids = list(range(40, 72))
    logits = {}
    for label, pdl, graphs in (("eager, no PDL", "0", 0), ("graphs, PDL", "1", 8)):
        monkeypatch.setenv(PDL_ENV, pdl)
        monkeypatch.setenv(TRITON_PDL_ENV, pdl)
        engine = Engine(EngineConfig(model=model, device="cuda", dtype="bfloat16", max_total_tokens=1024,
                                     quantization=quantization, cuda_graph_max_bs=graphs))
        assert (engine.graph_runner is not None) == bool(graphs)
        logits[label] = single_sequence_logits(engine, ids, prefill=8)
        del engine
    got, expected = logits["graphs, PDL"], logits["eager, no PDL"]
    assert torch.equal(got, expected), f"relative logit difference {rel_err(got, expected):.2e}"


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_tiny_model_with_fused_norm(tiny_model_factory, monkeypatch, tmp_path, quantization):
    """Batch-1 decode of a tiny model in CUDA graphs, the add + RMSNorm in the GEMVs
    (TPSERVE_GEMV_FUSE_NORM=1) and as kernels of their own (the default), against the model in float32
    (FP8: a published-format checkpoint against its dequantized weights). The fusion skips rounding the
    normed x to bf16, so its logits are no further from float32's than the separate kernels' (on the
    CPU, with the GEMV's torch reference: 4.0e-2 against 5.5e-2, and 4.4e-2 apart)."""
    model = reference_model = tiny_model_factory("qwen3", **TINY)
    if quantization:
        model = write_fp8_checkpoint(model, str(tmp_path / "fp8"), BLOCK)
        reference_model = write_dequantized(model, str(tmp_path / "dequantized"))
    monkeypatch.delenv(BF16_GEMV_ENV, raising=False)
    ids = list(range(40, 72))
    logits = {}
    for label, model_dir, dtype, fuse in (("fused", model, "bfloat16", "1"), ("separate", model, "bfloat16", "0"),
                                          ("float32", reference_model, "float32", "0")):
        monkeypatch.setenv(FUSE_NORM_ENV, fuse)
        engine = Engine(EngineConfig(model=model_dir, device="cuda", dtype=dtype, max_total_tokens=1024))
        logits[label] = single_sequence_logits(engine, ids, prefill=8)
        del engine
    fused, separate = rel_err(logits["fused"], logits["float32"]), rel_err(logits["separate"], logits["float32"])
    print(f"{quantization or 'bf16'}: relative logit error to float32: fused {fused:.2e}, separate {separate:.2e}")
    assert not torch.equal(logits["fused"], logits["separate"]), "the fused path did not run"
    assert fused <= 1.25 * separate, f"fused {fused:.2e} against separate kernels' {separate:.2e}"
