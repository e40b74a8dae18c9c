"""GPU paths no other tests/gpu file reaches (every other GPU test runs bfloat16, head_dim 128, page size 16
and a vocabulary rounded to 64): the MoE kernels at every grouped-GEMM tile in float32 and float16 (the float32
128 x 256 tile once asked more shared memory than Hopper has: ``kernels.moe.fit_shared_memory``), FP8 experts under float16
and float32 activations, float16 engines (FlashInfer + Triton decode + CUDA graphs), ``--quantization fp8`` with
float16 and float32, an FP8 KV cache under float16 queries in pages of 32 (XQA), head_dim 64 and 256, an odd
vocabulary with tied embeddings (sampler kernels, grammar masks), and a float32 MoE model through chunked prefill
with prompt logprobs against transformers.

References: float64 torch experts for the kernels; for engines the float32 torch path of the same engine on weights
rounded to the dtype under test (as test_fused_kernels.py), or transformers (as test_float32.py). Tolerances are the
other GPU tests'. scripts/gpu_suite.sh stage ``shape_tests``.
"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("triton")
pytest.importorskip("flashinfer")

from engine_scenario import (LOGITS_RTOL, ROUTED_MEDIAN_RTOL, ROUTED_OUTLIERS, assert_same_greedy, prompts_for,
                             row_errors, run_scenario)
from fp8_checkpoint import fp8_experts, write_dequantized, write_fp8_checkpoint
from moe_inputs import expert_inputs
from reference import hf_greedy, hf_logits, rel_err
from tpserve import LLM, SamplingParams, kernels
from tpserve.engine.engine import Engine
from tpserve.engine_config import EngineConfig
from tpserve.kernels.moe import SMALL_BATCH_MAX_ROWS, fused_experts, grouped_experts, tiles_for
from tpserve.kernels.moe_small import RouterLogits, routed_experts, router_topk, small_batch_experts
from tpserve.layers.moe import experts_torch
from tpserve.quant.fp8 import FP8_DTYPE

DEVICE = torch.device("cuda")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Relative L2 error against float64: bf16/fp16 rounding of the intermediates (test_moe.py's RTOL); float32 runs
# IEEE dots (test_moe.py's float32 model bound).
KERNEL_RTOL = {"float16": 1e-2, "float32": 1e-4}
TINY = dict(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=128, intermediate_size=512, seed=1)
TINY_MOE = dict(TINY, num_layers=3, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128)


# ---- the MoE kernels outside bf16 ----

def inputs(tokens: int, dtype: torch.dtype, seed: int):
    """test_moe.py's inputs at this file's shape (16 experts, top 4, hidden 256, width 128) in ``dtype``."""
    return expert_inputs(tokens, 16, 4, 256, 128, seed, dtype)


def float64_experts(x, gate_up, down, weights, ids) -> torch.Tensor:
    return experts_torch(x.double(), gate_up.double(), down.double(), weights.double(), ids)


# top 4: 100 / 400 / 800 / 1,100 tokens are 400 / 1,600 / 3,200 / 4,400 rows, one per TILES_BY_ROWS entry
# (16 x 64; 32 x 64 with SiLU fused; 32 x 128; 128 x 256, whose stages fit_shared_memory cuts at 4-byte elements), the
# last also the counted sort (past ALIGN_ONE_KERNEL_MAX_ROWS)
@pytest.mark.parametrize("tokens", [100, 400, 800, 1100])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_grouped_experts_every_tile(dtype, tokens):
    x, gate_up, down, weights, ids = inputs(tokens, DTYPES[dtype], seed=tokens)
    tile = tiles_for(ids.numel(), itemsize=x.element_size())
    expected = float64_experts(x, gate_up, down, weights, ids)
    got = fused_experts(x, gate_up, down, weights, ids)
    torch_err = rel_err(experts_torch(x, gate_up, down, weights, ids), expected)
    err = rel_err(got, expected)
    print(f"{dtype} {tokens} tokens, {tile}: grouped {err:.2e}, torch {torch_err:.2e}")
    assert err < KERNEL_RTOL[dtype] and err < 2 * torch_err + KERNEL_RTOL[dtype] / 10
    assert torch.equal(got, grouped_experts(x, gate_up, down, weights, ids))


# 16 tokens x top 4 = SMALL_BATCH_MAX_ROWS, the last batch on the small-batch kernels
@pytest.mark.parametrize("tokens", [1, 3, SMALL_BATCH_MAX_ROWS // 4])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_small_batch_and_routed_experts(dtype, tokens):
    x, gate_up, down, weights, ids = inputs(tokens, DTYPES[dtype], seed=20 + tokens)
    logits = torch.randn(tokens, 16, generator=torch.Generator(device=DEVICE).manual_seed(tokens), device=DEVICE)
    expected = float64_experts(x, gate_up, down, weights, ids)
    small = small_batch_experts(x, gate_up, down, weights, ids)
    assert rel_err(small, expected) < KERNEL_RTOL[dtype]
    assert torch.equal(fused_experts(x, gate_up, down, weights, ids), small)
    router = RouterLogits(logits.to(DTYPES[dtype]), 4, True)
    routed = routed_experts(x, gate_up, down, router)
    r_weights, r_ids = router_topk(router.logits, 4, True, DTYPES[dtype])
    assert torch.equal(routed, small_batch_experts(x, gate_up, down, r_weights, r_ids))
    assert rel_err(routed, float64_experts(x, gate_up, down, r_weights, r_ids)) < KERNEL_RTOL[dtype]


# small-batch kernels; FP8_TILES_BY_ROWS 16 x 64 (300 x 4 rows: 64 x 64) and 128 x 128 (1,100 x 4), unfitted by fit_shared_memory
@pytest.mark.parametrize("tokens", [1, 8, 100, 300, 1100])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_fp8_experts_under_float16_and_float32_activations(dtype, tokens):
    x, gate_up, down, weights, ids = inputs(tokens, DTYPES[dtype], seed=30 + tokens)
    gu_q, d_q, scales, gu_deq, d_deq = fp8_experts(gate_up.float(), down.float(), (128, 128))
    expected = float64_experts(x, gu_deq, d_deq, weights, ids)
    got = fused_experts(x, gu_q, d_q, weights, ids, scales)
    same = fused_experts(x, gu_deq.to(x.dtype), d_deq.to(x.dtype), weights, ids)
    err, same_err = rel_err(got, expected), rel_err(same, expected)
    print(f"fp8 experts, {dtype} activations, {tokens} tokens: {err:.2e}; dequantized weights {same_err:.2e}")
    assert got.dtype == x.dtype
    assert err < max(KERNEL_RTOL[dtype], 1e-3) and err < 2 * same_err + 1e-3


# ---- engines ----

def make_engine(model_dir: str, dtype: str, backend: str = "auto", graphs: int = 0, **kwargs) -> Engine:
    return Engine(EngineConfig(model=model_dir, device="cuda", dtype=dtype, attention_backend=backend,
                               cuda_graph_max_bs=graphs, max_total_tokens=kwargs.pop("max_total_tokens", 16384),
                               page_size=kwargs.pop("page_size", 16), **kwargs))


def exact_run(model_dir: str, dtype: str, prompts):
    """Greedy tokens and logits of the float32 torch-attention engine on weights rounded to ``dtype``."""
    exact = make_engine(model_dir, "float32", "torch")
    with torch.no_grad():
        for param in exact.model.parameters():
            if param.dtype == torch.float32:
                param.copy_(param.to(DTYPES[dtype]).float())
    tokens, logits = run_scenario(exact, prompts)
    del exact
    return tokens, logits


def step_errors(actual, exact) -> list[float]:
    errors = []
    for a, e in zip(actual, exact):
        valid = ~torch.isnan(e[:, 0])
        assert torch.equal(valid, ~torch.isnan(a[:, 0])), "different rows ran"
        if valid.any():
            errors.append(rel_err(a[valid], e[valid]))
    return errors


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tpserve.tiny import make_tiny_model

    made = {}

    def make(arch: str, **shape) -> str:
        key = (arch, tuple(sorted(shape.items())))
        if key not in made:
            made[key] = make_tiny_model(str(tmp_path_factory.mktemp(f"tiny-{arch}")), arch, **shape)
        return made[key]

    return make


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_float16_engine_matches_float32(models, arch):
    """float16 end to end on the GPU (FlashInfer prefill, Triton decode under auto on Hopper, small-batch and grouped
    experts, CUDA graphs; the bf16-only GEMVs stand aside) against float32 on fp16-rounded weights. fp16 keeps 3 more
    mantissa bits than bf16, whose torch path is 2-7% off on these models: the dense model within LOGITS_RTOL at
    every step; the MoE model (routers near a tie may flip) row by row, closer than the bf16 engine is."""
    model = models(arch, **(TINY_MOE if arch == "qwen3_moe" else TINY))
    prompts = prompts_for(11, 700, seed=3)
    exact_tokens, exact_logits = exact_run(model, "float16", prompts)
    engine = make_engine(model, "float16", "flashinfer", graphs=16)
    assert engine.graph_runner is not None
    _, logits = run_scenario(engine, prompts, forced=exact_tokens)
    if arch == "qwen3_moe":
        # fp16 against float32 is a stricter comparison than test_moe.py's two bf16 runs, for which
        # ROUTED_OUTLIERS was set: a random tiny model's errors grow along a 700-token prompt, so the rows past
        # LOGITS_RTOL are bounded by those of the bf16 engine against float32 on bf16-rounded weights
        errors = row_errors(logits, exact_logits)
        bf16_tokens, bf16_exact = exact_run(model, "bfloat16", prompts)
        _, bf16_logits = run_scenario(make_engine(model, "bfloat16", "flashinfer", graphs=16), prompts, forced=bf16_tokens)
        bf16_errors = row_errors(bf16_logits, bf16_exact)
        past, bf16_past = (float((e > LOGITS_RTOL).float().mean()) for e in (errors, bf16_errors))
        print(f"MoE row errors: float16 median {float(errors.median()):.2e}, {past:.0%} past {LOGITS_RTOL}; "
              f"bf16 median {float(bf16_errors.median()):.2e}, {bf16_past:.0%}")
        assert float(errors.median()) < ROUTED_MEDIAN_RTOL and float(errors.median()) < float(bf16_errors.median())
        assert past <= max(ROUTED_OUTLIERS, bf16_past)
        return
    errors = step_errors(logits, exact_logits)
    print(f"float16 vs float32 per step: {[f'{e:.1e}' for e in errors]}")
    assert max(errors) < LOGITS_RTOL
    own, _ = run_scenario(engine, prompts)
    assert_same_greedy(own, exact_tokens, exact_logits)


def fp8_step_errors(model: str, dtype: str, backend: str, prompts) -> tuple[list[float], str]:
    """Per-step logit errors of ``--quantization fp8`` against the unquantized engine of the same dtype, and the
    down projection's FP8 backend."""
    ref = make_engine(model, dtype, backend, graphs=8)
    ref_tokens, ref_logits = run_scenario(ref, prompts)
    del ref
    engine = make_engine(model, dtype, backend, graphs=8, quantization="fp8")
    down = engine.model.model.layers[0].mlp.down_proj
    assert down.weight.dtype == FP8_DTYPE
    _, logits = run_scenario(engine, prompts, forced=ref_tokens)
    return step_errors(logits, ref_logits), down.fp8_backend


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_quantization_fp8_outside_bf16(models, dtype):
    """``--quantization fp8`` with float16 (FlashInfer attention) and float32 (torch attention): ``auto`` resolves
    to Triton's W8A8 GEMM, whose output is the compute dtype. FP8 weights and activations move a random tiny
    model's logits far (~0.4 relative in float32 on an H100), so the oracle is the same error in bf16, whose FP8
    GEMMs other tests check against references: a wrong kernel or output dtype would be far past it."""
    model = models("qwen3", **TINY)
    prompts = prompts_for(5, 700, seed=4)
    errors, backend = fp8_step_errors(model, dtype, "flashinfer" if dtype == "float16" else "torch", prompts)
    assert backend == "triton"
    bf16_errors, _ = fp8_step_errors(model, "bfloat16", "torch", prompts)
    assert_no_worse_than_bf16(f"fp8 in {dtype}", errors, bf16_errors)


def assert_no_worse_than_bf16(what: str, errors, bf16_errors) -> None:
    """The oracle where FP8 (weights, activations or KV pages) moves a random tiny model's logits far (0.2-0.4
    relative): the same error in bf16 on the same model and prompts, whose FP8 kernels other tests check against
    references. A wrong kernel or dtype lands far past it."""
    errors, bf16_errors = [float(e) for e in errors], [float(e) for e in bf16_errors]
    mean, bf16_mean = sum(errors) / len(errors), sum(bf16_errors) / len(bf16_errors)
    print(f"{what}: mean {mean:.3f}, max {max(errors):.3f}; in bf16: mean {bf16_mean:.3f}, max {max(bf16_errors):.3f}")
    assert mean < 1.25 * bf16_mean + 0.02 and max(errors) < 1.25 * max(bf16_errors) + 0.05


def test_fp8_moe_checkpoint_in_float16(models, tmp_path):
    """An FP8 Qwen3-MoE checkpoint served in float16: FP8 GEMMs (Triton W8A8), FP8 experts in the Triton kernels
    with fp16 activations (the expert GEMVs take bf16 only), against float16 on the dequantized weights, no
    further off than the same checkpoint in bf16 (FP8 GEMVs and expert GEMVs at one token) is from bf16."""
    src = models("qwen3_moe", **TINY_MOE)
    fp8_dir = write_fp8_checkpoint(src, str(tmp_path / "fp8"), (128, 128))
    ref_dir = write_dequantized(fp8_dir, str(tmp_path / "ref"))
    prompts = prompts_for(8, 700, seed=5)

    def errors_in(dtype: str) -> torch.Tensor:
        ref_tokens, ref_logits = run_scenario(make_engine(ref_dir, dtype, "flashinfer", graphs=8), prompts)
        engine = make_engine(fp8_dir, dtype, "flashinfer", graphs=8)
        assert engine.model.model.layers[1].mlp.experts.scales() is not None
        _, logits = run_scenario(engine, prompts, forced=ref_tokens)
        return row_errors(logits, ref_logits)

    assert_no_worse_than_bf16("fp8 MoE in float16, rows", errors_in("float16"), errors_in("bfloat16"))


def test_fp8_kv_cache_float16_pages_of_32(models):
    """An FP8 KV cache under float16 queries in pages of 32: FA2 prefill over FP8 pages and, on Hopper, XQA decode
    (auto's pick over FP8 pages) with fp16 q; against float16 pages of 16 (the Triton decode kernel there), no
    further off than an FP8 cache in bf16 pages of 16 is from bf16 pages (the median row 0.2 there, session 8)."""
    model = models("qwen3", **TINY)
    prompts = prompts_for(6, 700, seed=6)

    def errors_in(dtype: str, page_size: int) -> list[float]:
        ref_tokens, ref_logits = run_scenario(make_engine(model, dtype, "flashinfer", graphs=16), prompts)
        engine = make_engine(model, dtype, "flashinfer", graphs=16, page_size=page_size, kv_cache_dtype="fp8_e4m3")
        assert engine.kv_pool.k[0].dtype == FP8_DTYPE
        if torch.cuda.get_device_capability()[0] == 9:
            assert engine.attention.table_decode is not None and engine.attention.table_decode.name == "XQA"
        _, logits = run_scenario(engine, prompts, forced=ref_tokens)
        return step_errors(logits, ref_logits)

    assert_no_worse_than_bf16("fp8 KV, fp16 pages of 32", errors_in("float16", 32), errors_in("bfloat16", 16))


@pytest.mark.parametrize("arch,heads,head_dim", [("llama", (8, 2), 64), ("qwen3", (4, 1), 256)],
                         ids=["llama-hd64-gqa4", "qwen3-hd256-gqa4"])
def test_other_head_dims(models, monkeypatch, arch, heads, head_dim):
    """head_dim 64 (Llama 3.2 1B/3B's) and 256 in bf16: FlashInfer prefill, the Triton decode kernel, the fused
    q/k norm + rotary + KV store (power-of-two head_dim), CUDA graphs; as test_fused_kernels.py's whole-model check:
    against float32 on bf16-rounded weights, as close on average as the bf16 torch path and no step far off."""
    model = models(arch, num_layers=2, hidden_size=256, num_heads=heads[0], num_kv_heads=heads[1],
                   head_dim=head_dim, intermediate_size=512, seed=2)
    prompts = prompts_for(5, 700, seed=7)
    exact_tokens, exact_logits = exact_run(model, "bfloat16", prompts)
    engine = make_engine(model, "bfloat16", "flashinfer", graphs=16)
    _, fused_logits = run_scenario(engine, prompts, forced=exact_tokens)
    del engine
    monkeypatch.setattr(kernels, "ENABLED", False)
    _, torch_logits = run_scenario(make_engine(model, "bfloat16", "torch"), prompts, forced=exact_tokens)
    fused_err, torch_err = step_errors(fused_logits, exact_logits), step_errors(torch_logits, exact_logits)
    fused_mean, torch_mean = sum(fused_err) / len(fused_err), sum(torch_err) / len(torch_err)
    print(f"head_dim {head_dim}: fused {fused_mean:.3f}, torch path {torch_mean:.3f}")
    assert max(fused_err) < 0.25 and fused_mean <= max(2e-2, 1.25 * torch_mean)


# test_structured.py's bounds: a random tiny model closes the object well within 120 tokens
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["ok", "n"], "additionalProperties": False}


def test_odd_vocabulary_with_tied_embeddings(models):
    """A vocabulary of 643 (odd: no multiple of 2, 32 or the sampler's chunks) with the LM head tied to the
    embeddings: the LM head GEMV (batch 1), the greedy and filtered sampling kernels, grammar bitmasks of
    ceil(643 / 32) words, CUDA graphs and overlap. Logits against float32 as test_fused_kernels.py; then every
    constrained request valid JSON, and filtered sampling only ever returns in-vocabulary tokens."""
    model = models("qwen3", **dict(TINY, vocab_size=643, tie_word_embeddings=True))
    prompts = prompts_for(5, 643, seed=8)
    exact_tokens, exact_logits = exact_run(model, "bfloat16", prompts)
    engine = make_engine(model, "bfloat16", "flashinfer", graphs=16)
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    _, logits = run_scenario(engine, prompts, forced=exact_tokens)
    errors = step_errors(logits, exact_logits)
    assert max(errors) < 0.25, errors
    del engine
    from tpserve.sampling_params import StructuredOutput

    schema = StructuredOutput("json_schema", json.dumps(SCHEMA))
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=120, structured=schema) if i % 2 else
              SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01, seed=i, max_tokens=16, ignore_eos=True)
              for i in range(12)]
    with LLM(model, device="cuda", dtype="bfloat16", cuda_graph_max_bs=16, max_total_tokens=4096) as llm:
        outs = llm.generate([[3 + i, 4 + i, 5 + i] for i in range(12)], params, use_tqdm=False)
    for i, out in enumerate(outs):
        assert all(0 <= t < 643 for t in out.token_ids)
        if i % 2:
            assert out.finish_reason == "stop", out.text
            value = json.loads(out.text)
            assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool)


@pytest.mark.parametrize("chunk", [0, 512], ids=["whole", "chunked"])
def test_float32_moe_long_prefill_and_prompt_logprobs(models, chunk):
    """float32 Qwen3-MoE through the LLM (torch attention, Triton experts with IEEE dots): a 1,100-token prompt
    prefilled whole (4,400 rows: the 128 x 256 tile whose stages fit_shared_memory cuts, the counted sort) or in chunks of
    512 (2,048 rows: 32 x 64 with SiLU fused, then 304 rows), with prompt logprobs and greedy decode, against
    transformers in float32 (as test_float32.py): the same greedy tokens, prompt logprobs to float32 rounding."""
    model = models("qwen3_moe", **TINY_MOE)
    long_prompt = [(7 * i + 3) % 640 for i in range(1100)]
    prompts = [long_prompt, [5, 6, 7, 8, 9]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    with LLM(model, device="cuda", dtype="float32", cuda_graph_max_bs=4, max_total_tokens=4096,
             chunked_prefill_size=chunk) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(model, prompt, 6)
        expected = torch.log_softmax(hf_logits(model, prompt)[:-1].double(), dim=-1)
        expected = expected.gather(1, torch.tensor(prompt[1:])[:, None]).flatten()
        got = torch.tensor(out.prompt_token_logprobs[1:], dtype=torch.float64)
        assert out.prompt_token_logprobs[0] is None
        assert torch.allclose(got, expected, atol=1e-3, rtol=1e-4), float((got - expected).abs().max())


def test_flashinfer_fp8_gemm_asked_for_float16_is_a_clear_error(models, monkeypatch):
    """FlashInfer's sm90 block-scale GEMM takes bf16 activations only: asked for by name under float16, the engine
    says so at startup (it failed inside FlashInfer at the first large batch)."""
    monkeypatch.setenv("TPSERVE_FP8_GEMM", "flashinfer")
    with pytest.raises(RuntimeError, match=r"TPSERVE_FP8_GEMM=flashinfer does not run here \(activations are torch.float16"):
        make_engine(models("qwen3", **TINY), "float16", "flashinfer", quantization="fp8")
