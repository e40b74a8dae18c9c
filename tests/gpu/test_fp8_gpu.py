"""FP8 on the GPU: the Triton block-scaled GEMM against its torch reference and against bf16 at
Qwen3-8B's shapes, and whole tiny FP8 models (published-format checkpoint and --quantization
fp8) served with FP8 weights, CUDA graphs on. Skipped without CUDA (compute capability 8.9+)
or triton, so CI on CPU stays green."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs an FP8 GPU (sm89+)"
)
pytest.importorskip("triton")

from tpserve import LLM, SamplingParams
from tpserve.config import EngineConfig
from tpserve.engine.engine import Engine
from tpserve.quant.fp8 import FP8_DTYPE, fp8_linear_reference, quantize_blocks
from tpserve.tiny.fp8 import write_dequantized, write_fp8_checkpoint

DEVICE = torch.device("cuda")
# Qwen3-8B per-layer linears at TP 1: (N, K)
QWEN3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert torch.isfinite(actual).all(), "non-finite output"
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


@pytest.mark.parametrize("m", [1, 16, 300])
@pytest.mark.parametrize("name", list(QWEN3_8B))
def test_fp8_gemm_matches_reference_and_bf16(name, m):
    from tpserve.kernels.fp8_gemm import fp8_linear

    n, k = QWEN3_8B[name]
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(m, k, device=DEVICE, generator=gen).to(torch.bfloat16)
    w = (0.02 * torch.randn(n, k, device=DEVICE, generator=gen)).to(torch.bfloat16)
    wq, scale = quantize_blocks(w, (128, 128))
    got = fp8_linear(x, wq, scale, (128, 128))
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert rel_err(got, fp8_linear_reference(x, wq, scale, (128, 128))) < 1e-2
    exact = x.double() @ w.double().T
    fp8_error, bf16_error = rel_err(got, exact), rel_err(torch.nn.functional.linear(x, w), exact)
    print(f"{name} m={m}: fp8 {fp8_error:.2e}, bf16 {bf16_error:.2e} relative L2 error vs float64")
    assert fp8_error < 0.06


def test_fp8_gemm_in_a_cuda_graph():
    from tpserve.kernels.fp8_gemm import fp8_linear

    x = torch.randn(4, 512, device=DEVICE, dtype=torch.bfloat16)
    wq, scale = quantize_blocks(torch.randn(256, 512, device=DEVICE) * 0.02, (128, 128))
    eager = fp8_linear(x, wq, scale, (128, 128))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear(x, wq, scale, (128, 128))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_fp8_checkpoint_served_with_fp8_weights(tiny_model_factory, tmp_path):
    fp8_dir = write_fp8_checkpoint(tiny_model_factory("qwen3"), str(tmp_path / "fp8"), (16, 16))
    ref_dir = write_dequantized(fp8_dir, str(tmp_path / "ref"))
    engine = Engine(EngineConfig(model=fp8_dir, device="cuda", dtype="bfloat16", max_total_tokens=1024))
    qkv = engine.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8_DTYPE and qkv.weight_scale_inv is not None
    del engine
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41], list(range(100, 137))]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = {}
    for name, model in (("fp8", fp8_dir), ("dequantized", ref_dir)):
        with LLM(model, device="cuda", dtype="bfloat16", max_total_tokens=1024) as llm:
            outs[name] = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    first = sum(a[0] == b[0] for a, b in zip(outs["fp8"], outs["dequantized"]))
    print(f"fp8 GEMM vs bf16 on the dequantized weights: first tokens equal {first}/{len(prompts)}; {outs}")
    assert first >= 2


def test_quantization_fp8_on_gpu(tiny_model_factory):
    model = tiny_model_factory("qwen3")
    engine = Engine(EngineConfig(model=model, device="cuda", dtype="bfloat16", max_total_tokens=1024, quantization="fp8"))
    down = engine.model.model.layers[0].mlp.down_proj
    assert down.weight.dtype == FP8_DTYPE and down.block_size == (128, 128)
    assert engine.graph_runner is not None
    del engine
    with LLM(model, device="cuda", dtype="bfloat16", max_total_tokens=1024, quantization="fp8") as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 8
