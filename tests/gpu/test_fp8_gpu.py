"""FP8 on the GPU: every FP8 GEMM tpserve can run (``TPSERVE_FP8_GEMM``) against its torch reference
and against bf16 at Qwen3-8B's shapes, in a CUDA graph, and whole tiny FP8 models (published-format
checkpoint and --quantization fp8) served with FP8 weights, CUDA graphs on. The tiny models have
head_dim 128 (FlashInfer's attention kernels take no smaller) and hidden 256, so the 128x128
blocks are real blocks; the published-format checkpoint keeps 16x16 blocks, the small-K path.
Skipped without CUDA (compute capability 8.9+) or triton, so CI on CPU stays green."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs an FP8 GPU (sm89+)"
)
pytest.importorskip("triton")

from reference import rel_err
from tpserve import LLM, SamplingParams
from tpserve.engine_config import EngineConfig
from tpserve.engine.engine import Engine
from tpserve.kernels.fp8_linear import FP8_GEMM_ENV, fp8_linear, kernel_for, resolve_backend, warm_up, warm_up_sizes
from tpserve.layers.linear import ParallelLinear
from tpserve.quant.fp8 import FP8_DTYPE, fp8_linear_reference, quantize_blocks, weight_only_reference
from engine_scenario import prompts_for, row_errors, run_scenario
from fp8_checkpoint import write_compressed_tensors_checkpoint, write_dequantized, write_fp8_checkpoint

DEVICE = torch.device("cuda")
BLOCK = (128, 128)
# Qwen3-8B per-layer linears at TP 1: (N, K)
QWEN3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
BACKENDS = ["auto", "triton", "flashinfer", "cuda", "cuda_triton"]
TINY = dict(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=128, intermediate_size=512, seed=1)



def reference(backend: str, m: int, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """The float32 torch reference of what ``backend`` computes at ``m`` tokens: the weights alone
    quantized (the CUDA GEMV) or the activations too (the others)."""
    kernel = kernel_for(resolve_backend(backend, x.device, x.dtype, block, x.shape[1]), m)
    if kernel == "cuda":
        return weight_only_reference(x, weight, scale, block)
    return fp8_linear_reference(x, weight, scale, block)


def test_auto_takes_the_cuda_gemv_on_h200():
    """On an H200 (sm90) with FlashInfer, ``auto`` is the CUDA GEMV for one token and FlashInfer's
    GEMM above; where FlashInfer's GEMM does not take the layer (sm89, K not a multiple of 128) the
    GEMV and Triton's W8A8 GEMM; fp16 or other blocks, Triton's GEMM throughout."""
    resolved = resolve_backend("auto", DEVICE, torch.bfloat16, BLOCK, 4096)
    print(f"auto on {torch.cuda.get_device_name()}: {resolved}")
    if torch.cuda.get_device_capability() == (9, 0):
        assert resolved == "cuda"
        assert resolve_backend("auto", DEVICE, torch.bfloat16, BLOCK, 4096 + 16) == "cuda_triton"
    if torch.cuda.get_device_capability() == (8, 9):
        assert resolved == "cuda_triton"
    assert resolve_backend("auto", DEVICE, torch.float16, BLOCK, 4096) == "triton"
    assert resolve_backend("auto", DEVICE, torch.bfloat16, (16, 16), 4096) == "triton"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m", [1, 16, 300])
@pytest.mark.parametrize("name", list(QWEN3_8B))
def test_fp8_gemm_matches_reference_and_bf16(name, m, backend):
    n, k = QWEN3_8B[name]
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(m, k, device=DEVICE, generator=gen).to(torch.bfloat16)
    w = (0.02 * torch.randn(n, k, device=DEVICE, generator=gen)).to(torch.bfloat16)
    (wq, scale), block = quantize_blocks(w, BLOCK), BLOCK
    got = fp8_linear(x, wq, scale, block, backend)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert rel_err(got, reference(backend, m, x, wq, scale, block)) < 1e-2
    exact = x.double() @ w.double().T
    fp8_error, bf16_error = rel_err(got, exact), rel_err(torch.nn.functional.linear(x, w), exact)
    print(f"{backend} {name} m={m}: fp8 {fp8_error:.2e}, bf16 {bf16_error:.2e} relative L2 error vs float64")
    assert fp8_error < 0.06


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m", [1, 4, 100])
def test_fp8_gemm_in_a_cuda_graph(backend, m):
    x = torch.randn(m, 512, device=DEVICE, dtype=torch.bfloat16)
    (wq, scale), block = quantize_blocks(torch.randn(256, 512, device=DEVICE) * 0.02, BLOCK), BLOCK
    eager = fp8_linear(x, wq, scale, block, backend)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear(x, wq, scale, block, backend)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_small_scale_groups_on_gpu():
    """K groups of 16 (the W8A8 dot in fp16, FP8 dots need K >= 32) and partial tiles."""
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    for m in (1, 7, 90):
        x = torch.randn(m, 80, device=DEVICE, generator=gen).to(torch.bfloat16)
        wq, scale = quantize_blocks(torch.randn(72, 80, device=DEVICE, generator=gen) * 0.05, (16, 16))
        got = fp8_linear(x, wq, scale, (16, 16), "auto")
        assert rel_err(got, reference("auto", m, x, wq, scale, (16, 16))) < 1e-2


@pytest.mark.parametrize("m", [1, 2, 64, 65, 300])
def test_row_scaled_gemm_matches_reference(m):
    """The GEMM of weights scaled per row above one token (``fp8_gemm_rowwise``: Triton up to ROWWISE_MAX_TOKENS,
    torch's ``_scaled_mm`` above on Hopper) at Qwen3-8B's down shape, the scales held as the engine holds them ([N, 1]),
    against the float32 reference with activations quantized per token, plain and in a CUDA graph."""
    from tpserve.kernels.fp8_gemm import ROWWISE_MAX_TOKENS, fp8_gemm_rowwise, scaled_mm_runs

    n, k = QWEN3_8B["down"]
    gen = torch.Generator(device=DEVICE).manual_seed(m)
    weight, scale = quantize_blocks(torch.randn(n, k, device=DEVICE, generator=gen) * 0.02, (1, k))
    held = scale
    assert held.shape == (n, 1)
    x = torch.randn(m, k, device=DEVICE, generator=gen).to(torch.bfloat16)
    got = fp8_gemm_rowwise(x, weight, held)
    err = rel_err(got, fp8_linear_reference(x.float(), weight, scale, (1, k)))
    print(f"m {m}: {'_scaled_mm' if m > ROWWISE_MAX_TOKENS and scaled_mm_runs(0) else 'Triton'}, error {err:.2e}")
    # bf16 rounding of the output gives ~1.7e-3; Hopper's FP8 accumulator left unpromoted gave 3.1e-3 at m = 64
    assert err < 2.5e-3
    if torch.cuda.get_device_capability() == (9, 0):
        assert scaled_mm_runs(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_gemm_rowwise(x, weight, held)
    x.copy_(torch.randn(x.shape, device=DEVICE, generator=gen))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fp8_gemm_rowwise(x, weight, held))


def test_fp8_checkpoint_served_with_fp8_weights(tiny_model_factory, tmp_path):
    fp8_dir = write_fp8_checkpoint(tiny_model_factory("qwen3", **TINY), str(tmp_path / "fp8"), (16, 16))
    ref_dir = write_dequantized(fp8_dir, str(tmp_path / "ref"))
    engine = Engine(EngineConfig(model=fp8_dir, device="cuda", dtype="bfloat16", max_total_tokens=1024))
    qkv = engine.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8_DTYPE and qkv.weight_scale_inv is not None
    assert engine.graph_runner is not None
    del engine
    outs, first = greedy_fp8_and_dequantized(fp8_dir, ref_dir)
    print(f"fp8 GEMMs vs bf16 on the dequantized weights: first tokens equal {first}/3; {outs}")
    assert first >= 2


def greedy_fp8_and_dequantized(fp8_dir: str, ref_dir: str) -> tuple[dict[str, list[list[int]]], int]:
    """16 greedy tokens of three prompts from the FP8 checkpoint and from its dequantized weights in bf16
    (the last prefill takes the W8A8 GEMM), and how many first tokens agree."""
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41], list(range(100, 237))]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = {}
    for name, model in (("fp8", fp8_dir), ("dequantized", ref_dir)):
        with LLM(model, device="cuda", dtype="bfloat16", max_total_tokens=1024) as llm:
            outs[name] = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    return outs, sum(a[0] == b[0] for a, b in zip(outs["fp8"], outs["dequantized"]))


MOE_ARCHS = {"qwen3_moe": {}, "qwen2_moe": {"shared_expert_intermediate_size": 256}, "mixtral": {}}


def tiny_moe_model(tiny_model_factory, arch: str) -> str:
    return tiny_model_factory(arch, **dict(TINY, num_layers=3, moe_intermediate_size=128, **MOE_ARCHS[arch]))


def count_expert_gemvs(monkeypatch) -> list[int]:
    """A list that grows by one at each call of the CUDA expert GEMVs (which still run)."""
    from tpserve.kernels import gemv

    calls: list[int] = []
    real_experts = gemv.experts
    monkeypatch.setattr(gemv, "experts", lambda *args, **kwargs: calls.append(1) or real_experts(*args, **kwargs))
    return calls


@pytest.mark.parametrize("arch", list(MOE_ARCHS))
@pytest.mark.parametrize("block", [(16, 16), (128, 128)], ids=["16x16", "128x128"])
def test_fp8_moe_checkpoint_on_gpu(tiny_model_factory, tmp_path, monkeypatch, block, arch):
    """A MoE FP8 checkpoint (per-expert FP8 weights and scales; Qwen2-MoE's shared expert FP8 too, Mixtral's experts
    under its own names): attention in FP8 GEMMs, the experts FP8 in the Triton expert kernels, and at one token in
    128 x 128 blocks in the CUDA expert GEMVs (which the CUDA graphs capture). Teacher-forced on float32's greedy
    tokens over the dequantized weights, its logits are compared with the same weights' bf16 engine's error."""
    fp8_dir = write_fp8_checkpoint(tiny_moe_model(tiny_model_factory, arch), str(tmp_path / "fp8"), block)
    ref_dir = write_dequantized(fp8_dir, str(tmp_path / "ref"))
    calls = count_expert_gemvs(monkeypatch)
    engine = Engine(EngineConfig(model=fp8_dir, device="cuda", dtype="bfloat16", max_total_tokens=1024))
    assert bool(calls) == (block == (128, 128)), "the expert GEMVs take 128 x 128 blocks, Triton the rest"
    assert engine.model.model.layers[0].self_attn.qkv_proj.weight.dtype == FP8_DTYPE
    experts = engine.model.model.layers[1].mlp.experts
    assert experts.gate_up_proj.dtype == FP8_DTYPE and experts.scales() is not None
    assert "experts FP8" in engine._quantization_note()
    assert engine.graph_runner is not None
    assert_fp8_near_dequantized(engine, ref_dir, f"{arch} fp8 MoE checkpoint ({block[0]}x{block[1]})")


def assert_fp8_near_dequantized(engine: Engine, ref_dir: str, label: str) -> None:
    """Teacher-forced on float32's greedy tokens over the dequantized weights, the FP8 engine's median row error
    against the same weights' bf16 engine's. The tiny models amplify every rounding (bf16 alone: 4-11% a row); the W8A8
    GEMMs' FP8 activations add 5-8x that (H100, session 43: 0.29-0.58 for the MoE models). A wrong scale, expert or
    shared expert gives unrelated rows (~1.4)."""
    reference = Engine(EngineConfig(model=ref_dir, device="cuda", dtype="float32", attention_backend="torch",
                                    cuda_graph_max_bs=0, max_total_tokens=1024))
    bf16 = Engine(EngineConfig(model=ref_dir, device="cuda", dtype="bfloat16", max_total_tokens=1024))
    prompts = prompts_for(6, engine.model_config.vocab_size, seed=3)
    tokens, exact = run_scenario(reference, prompts)
    fp8_error = float(row_errors(run_scenario(engine, prompts, forced=tokens)[1], exact).median())
    bf16_error = float(row_errors(run_scenario(bf16, prompts, forced=tokens)[1], exact).median())
    print(f"{label}, teacher-forced against float32 on the dequantized weights: median row error {fp8_error:.2e} "
          f"(the same weights in bf16: {bf16_error:.2e})")
    assert fp8_error < min(0.8, 10 * bf16_error)


@pytest.mark.parametrize("arch", list(MOE_ARCHS))
def test_quantization_fp8_moe_on_gpu(tiny_model_factory, tmp_path, monkeypatch, arch):
    """--quantization fp8 on a bf16 MoE checkpoint: each expert's projections quantized as they load into 128 x 128
    blocks (Qwen's FP8 checkpoints' layout), so one token's experts take the CUDA expert GEMVs and more tokens' the
    Triton expert kernels, in CUDA graphs. Compared with the bf16 error of the weights round-tripped as the
    published-format writer quantizes each tensor: the experts' are the same (on the CPU, bit for bit); the dense
    layers' differ a little, since the engine quantizes their bf16 copies (H100, session 45: median row error 0.36-0.64
    against the checkpoint's 0.32-0.57)."""
    model = tiny_moe_model(tiny_model_factory, arch)
    ref_dir = write_dequantized(write_fp8_checkpoint(model, str(tmp_path / "fp8"), BLOCK), str(tmp_path / "ref"))
    calls = count_expert_gemvs(monkeypatch)
    engine = Engine(EngineConfig(model=model, device="cuda", dtype="bfloat16", max_total_tokens=1024, quantization="fp8"))
    experts = engine.model.model.layers[1].mlp.experts
    assert experts.gate_up_proj.dtype == experts.down_proj.dtype == FP8_DTYPE and experts.scales().block == BLOCK
    assert calls and "quantized at load" in engine._quantization_note() and "experts FP8" in engine._quantization_note()
    assert engine.graph_runner is not None
    assert_fp8_near_dequantized(engine, ref_dir, f"{arch} --quantization fp8 MoE")


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_compressed_tensors_checkpoint_on_gpu(tiny_model_factory, tmp_path, strategy):
    """llm-compressor's FP8 checkpoints (a weight_scale per output channel or per tensor) on the GPU: the weights stay
    FP8 with one scale a row ([rows, 1]), a decoding token's in the CUDA GEMV (its norm, SwiGLU and residual add
    fused), more tokens' in Triton's W8A8 GEMM, in CUDA graphs."""
    from tpserve.kernels import gemv

    fp8_dir = write_compressed_tensors_checkpoint(tiny_model_factory("qwen3", **TINY), str(tmp_path / "fp8"), strategy)
    ref_dir = write_dequantized(fp8_dir, str(tmp_path / "ref"))
    engine = Engine(EngineConfig(model=fp8_dir, device="cuda", dtype="bfloat16", max_total_tokens=1024))
    down = engine.model.model.layers[0].mlp.down_proj
    assert down.weight.dtype == FP8_DTYPE and down.block_size == (1, down.in_features) and down.fp8_backend == "cuda_triton"
    assert down.weight_scale_inv.shape == (down.out_features, 1)
    x = torch.randn(1, down.in_features, device="cuda", dtype=torch.bfloat16)
    assert down.takes_gemv(x) and gemv.supported(x, down.weight, down.weight_scale_inv, row_scales=True)
    assert engine.graph_runner is not None
    assert_fp8_near_dequantized(engine, ref_dir, f"compressed-tensors {strategy}")


@pytest.mark.parametrize("arch,strategy", [("qwen3_moe", "channel"), ("qwen2_moe", "tensor"), ("mixtral", "channel")])
def test_compressed_tensors_moe_checkpoint_on_gpu(tiny_model_factory, tmp_path, monkeypatch, arch, strategy):
    """llm-compressor's FP8 MoE checkpoints (RedHatAI's Qwen3-30B-A3B-FP8-dynamic layout: a scale per expert row or
    projection): the experts stay FP8 with one scale a row, one token's in the CUDA expert GEMVs (since session 45)
    and more tokens' in the Triton expert kernels, in CUDA graphs, near the dequantized weights' bf16 error."""
    fp8_dir = write_compressed_tensors_checkpoint(tiny_moe_model(tiny_model_factory, arch), str(tmp_path / "fp8"),
                                                  strategy)
    ref_dir = write_dequantized(fp8_dir, str(tmp_path / "ref"))
    calls = count_expert_gemvs(monkeypatch)
    engine = Engine(EngineConfig(model=fp8_dir, device="cuda", dtype="bfloat16", max_total_tokens=1024))
    experts = engine.model.model.layers[1].mlp.experts
    assert experts.gate_up_proj.dtype == experts.down_proj.dtype == FP8_DTYPE and not experts.dequantized
    assert experts.scales() is not None and experts.scales().block[0] == 1
    assert engine.graph_runner is not None
    assert_fp8_near_dequantized(engine, ref_dir, f"{arch} compressed-tensors {strategy} MoE")
    assert calls, "one token's row-scaled experts take the expert GEMVs"


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantization_fp8_on_gpu(tiny_model_factory, monkeypatch, backend):
    model = tiny_model_factory("qwen3", **TINY)
    monkeypatch.setenv(FP8_GEMM_ENV, backend)
    engine = Engine(EngineConfig(model=model, device="cuda", dtype="bfloat16", max_total_tokens=1024, quantization="fp8"))
    down = engine.model.model.layers[0].mlp.down_proj
    assert down.weight.dtype == FP8_DTYPE and down.fp8_backend == resolve_backend(backend, DEVICE, torch.bfloat16, BLOCK, 512)
    assert down.block_size == BLOCK
    assert engine.graph_runner is not None
    # The engine warmed FlashInfer's GEMM at startup: per distinct weight shape (TINY: qkv and gate_up
    # are both [1024, 256], o and down [256, 512]), every size above one token; others warm nothing.
    layers = [m for m in engine.model.modules() if isinstance(m, ParallelLinear)]
    shapes = {tuple(m.weight.shape) for m in layers}
    expected = len(shapes) * len([m for m in warm_up_sizes(512) if m > 1]) if kernel_for(down.fp8_backend, 2) == "flashinfer" else 0
    assert warm_up(layers, 512) == expected
    del engine
    prompts = [[1, 2, 3], list(range(10, 150))]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(model, device="cuda", dtype="bfloat16", max_total_tokens=1024, quantization="fp8") as llm:
        fp8 = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    with LLM(model, device="cuda", dtype="bfloat16", max_total_tokens=1024) as llm:
        bf16 = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    print(f"{backend}: fp8 {fp8} bf16 {bf16}")
    assert all(len(t) == 8 for t in fp8)
    assert sum(a[0] == b[0] for a, b in zip(fp8, bf16)) >= 1


def test_fp8_kv_cache_on_gpu(tiny_model_factory):
    """``kv_cache_dtype="fp8_e4m3"`` with FlashInfer's attention (FP8 KV pages under bf16 queries)
    and CUDA graphs, against the bf16 cache: teacher-forced argmaxes and first tokens mostly agree."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))
    from test_vs_transformers import teacher_forced_logits

    from tpserve.attention.flashinfer_backend import FlashInferAttentionBackend

    model = tiny_model_factory("qwen3", **TINY)
    ids = list(range(30, 90))
    logits = {}
    for dtype in ("auto", "fp8_e4m3"):
        engine = Engine(EngineConfig(model=model, device="cuda", dtype="bfloat16", max_total_tokens=1024, kv_cache_dtype=dtype))
        assert isinstance(engine.attention, FlashInferAttentionBackend) and engine.graph_runner is not None
        assert engine.kv_pool.k[0].dtype == (FP8_DTYPE if dtype == "fp8_e4m3" else torch.bfloat16)
        logits[dtype] = teacher_forced_logits(engine, ids, prefill=9).float()
        del engine
    same = (logits["auto"].argmax(-1) == logits["fp8_e4m3"].argmax(-1)).float().mean().item()
    prompts = [[i, i + 1, i + 2, i + 5] for i in range(20, 300, 28)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = []
    for dtype in ("auto", "fp8_e4m3"):
        with LLM(model, device="cuda", dtype="bfloat16", max_total_tokens=1024, kv_cache_dtype=dtype) as llm:
            outs.append([o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)])
    first = sum(a[0] == b[0] for a, b in zip(*outs)) / len(prompts)
    print(f"fp8 KV vs bf16 KV on the GPU: teacher-forced argmax equal {same:.0%}, first tokens {first:.0%}")
    assert same >= 0.7 and first >= 0.7
