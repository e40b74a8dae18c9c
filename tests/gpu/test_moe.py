"""The Triton MoE paths (the grouped GEMMs and the small-batch kernels) against the torch experts,
in bf16, eager and inside a CUDA graph; then a tiny Qwen3-MoE model with the Triton experts against
the same model with the torch experts: in float32 (no graphs: logits equal to float32 rounding) and
in bf16 with CUDA graphs, at batch 1 to 11 (decode on the small-batch kernels, prefill grouped).
Last, the one-token experts through the CUDA GEMV (``gemv.experts``, ``TPSERVE_MOE_GEMV=1``), alone and in the model.

In bf16 the two models are not compared with the dense models' per-step bound: routers near a
tie pick another expert when anything rounds differently, which moves some rows far more than
rounding (tests/models/test_moe_routing_flips.py shows it on the CPU). So the bf16 reference
differs from the engine under test only in the experts (and graphs), and the check is per row
(``assert_routed_logits_close``); float32, where no router flips, is the strict model-level check.

Skipped without CUDA or triton, so CI on CPU stays green.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("triton")
pytest.importorskip("flashinfer")

import tpserve.layers.moe as moe_layer
from fp8_checkpoint import fp8_experts
from moe_inputs import expert_inputs
from engine_scenario import (assert_prefill_never_waits, assert_routed_logits_close, assert_same_greedy, prompts_for,
                             row_errors, run_scenario)
from reference import rel_err
from tpserve.engine_config import EngineConfig
from tpserve.engine.engine import Engine
from tpserve.kernels.moe import SMALL_BATCH_MAX_ROWS, Tile, fused_experts, grouped_experts
from tpserve.kernels import moe_small
from tpserve.kernels.moe_small import router_topk
from tpserve.kernels.moe_small import RouterLogits, routed_experts, small_batch_experts
from tpserve.layers.moe import experts_torch

DEVICE = torch.device("cuda")
DTYPE = torch.bfloat16
RTOL = 1e-2  # relative L2 error against float64; bf16 rounding of the intermediates alone is ~4e-3


def reference(x, gate_up, down, weights, ids) -> torch.Tensor:
    return experts_torch(x.double(), gate_up.double(), down.double(), weights.double(), ids)


# Qwen3-30B-A3B's experts at TP 1 (128 x top-8, hidden 2048, expert intermediate 768) and on a
# TP 2 and a TP 4 rank, the tiny model's below and a small shape.
SHAPES = [(128, 8, 2048, 768), (128, 8, 2048, 384), (128, 8, 2048, 192), (16, 4, 256, 128), (8, 2, 256, 96)]


# 160 tokens at top 8: 1,280 rows, the 32 x 64 tile with SiLU in the first GEMM (kernels.moe.TILES_BY_ROWS)
@pytest.mark.parametrize("tokens", [1, 7, 64, 160, 300, 2048])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fused_experts_match_torch(tokens, shape):
    x, gate_up, down, weights, ids = expert_inputs(tokens, *shape, seed=tokens)
    expected = reference(x, gate_up, down, weights, ids)
    fused_err = rel_err(fused_experts(x, gate_up, down, weights, ids), expected)
    torch_err = rel_err(experts_torch(x, gate_up, down, weights, ids), expected)
    print(f"tokens {tokens} shape {shape}: triton {fused_err:.2e}, torch bf16 {torch_err:.2e}")
    assert fused_err < RTOL and fused_err < 2 * torch_err + 1e-3


@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_small_batch_experts_match_torch_and_grouped(tokens, shape):
    """Decode batches on both paths: each within bf16 rounding of float64, and the small-batch
    kernels give the same bits on every run (no atomics)."""
    x, gate_up, down, weights, ids = expert_inputs(tokens, *shape, seed=10 + tokens)
    expected = reference(x, gate_up, down, weights, ids)
    small = small_batch_experts(x, gate_up, down, weights, ids)
    small_err, grouped_err = rel_err(small, expected), rel_err(grouped_experts(x, gate_up, down, weights, ids), expected)
    print(f"tokens {tokens} shape {shape}: small-batch {small_err:.2e}, grouped {grouped_err:.2e}")
    assert small_err < RTOL and small_err < 2 * grouped_err + 1e-3
    assert torch.equal(small, small_batch_experts(x, gate_up, down, weights, ids))


@pytest.mark.parametrize("tokens", [1, 2, 4, 8, 64])
def test_fused_experts_in_a_cuda_graph(tokens):
    """Captured once, replayed on new inputs (other experts chosen): the same as eager. The
    small-batch path up to SMALL_BATCH_MAX_ROWS / 8 tokens (top 8), the grouped one above."""
    x, gate_up, down, weights, ids = expert_inputs(tokens, *SHAPES[0], seed=1)
    fused_experts(x, gate_up, down, weights, ids)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, gate_up, down, weights, ids)
    for seed in (2, 3):
        new_x, _, _, new_weights, new_ids = expert_inputs(tokens, *SHAPES[0], seed=seed)
        x.copy_(new_x)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fused_experts(x, gate_up, down, weights, ids))
        path = small_batch_experts if ids.numel() <= SMALL_BATCH_MAX_ROWS else grouped_experts
        assert torch.equal(out, path(x, gate_up, down, weights, ids))
        assert rel_err(out, reference(x, gate_up, down, weights, ids)) < RTOL


@pytest.mark.parametrize("tokens", [1, 8, 300])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_expert_parallel_ranks_sum_to_all_experts(tokens, fp8):
    """Qwen3-30B-A3B's experts split whole over 4 ranks (32 each), one GPU playing every rank: each rank's
    router kernel ids local, its experts a view into all of them and other ranks' rows skipped (the global
    router weights passed, so a row not skipped by its id would add the next rank's expert), inside a CUDA
    graph replayed on new logits. The ranks' sum is all experts' output to bf16 rounding."""
    experts, top_k, hidden, inter, ranks = 128, 8, 2048, 768, 4
    x, gate_up, down, _, _ = expert_inputs(tokens, experts, top_k, hidden, inter, seed=40 + tokens)
    scales = None
    if fp8:
        gate_up, down, scales, gu_deq, d_deq = fp8_experts(gate_up.float(), down.float(), (128, 128))
    count = experts // ranks
    logits = torch.randn(tokens, experts, device=DEVICE)

    def rank_outputs() -> list[torch.Tensor]:
        weights, _ = router_topk(logits, top_k, True, DTYPE)
        outs = []
        for rank in range(ranks):
            mine = slice(rank * count, (rank + 1) * count)
            _, local_ids = router_topk(logits, top_k, True, DTYPE, (rank * count, count))
            rank_scales = scales and dataclasses.replace(scales, gate_up=scales.gate_up[mine], down=scales.down[mine])
            outs.append(fused_experts(x, gate_up[mine], down[mine], weights, local_ids, rank_scales, skip_others=True))
        return outs

    rank_outputs()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = rank_outputs()
    for seed in (5, 6):
        logits.copy_(torch.randn(tokens, experts, generator=torch.Generator(device=DEVICE).manual_seed(seed),
                                 device=DEVICE))
        graph.replay()
        torch.cuda.synchronize()
        weights, ids = router_topk(logits, top_k, True, DTYPE)
        expected = reference(x, gu_deq if fp8 else gate_up, d_deq if fp8 else down, weights, ids)
        total = sum(o.double() for o in outs)
        err = rel_err(total, expected)
        print(f"EP 4, {tokens} tokens, {'fp8' if fp8 else 'bf16'}: relative error of the ranks' sum {err:.2e}")
        assert err < RTOL
        assert all(torch.equal(a, b) for a, b in zip(outs, rank_outputs()))  # eager: the same bits


@pytest.mark.parametrize("tokens", [1, 2, 8])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_routed_experts_match_the_router_kernel(tokens, shape):
    """The expert kernels routing from the router's logits themselves (``routed_experts``, the default at
    small batches) against the router kernel then the same kernels: the same bits, eager and replayed in a
    CUDA graph on new logits (other experts chosen)."""
    x, gate_up, down, _, _ = expert_inputs(tokens, *shape, seed=20 + tokens)
    top_k = shape[1]
    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    logits = torch.randn(tokens, shape[0], generator=gen, device=DEVICE).to(DTYPE)

    def unfused() -> torch.Tensor:
        weights, ids = router_topk(logits, top_k, True, DTYPE)
        return small_batch_experts(x, gate_up, down, weights, ids)

    routed = routed_experts(x, gate_up, down, RouterLogits(logits, top_k, True))
    assert torch.equal(routed, unfused())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = routed_experts(x, gate_up, down, RouterLogits(logits, top_k, True))
    for seed in (5, 6):
        logits.copy_(torch.randn(logits.shape, generator=gen.manual_seed(seed), device=DEVICE))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, unfused())
    weights, ids = router_topk(logits, top_k, True, DTYPE)
    assert rel_err(out, reference(x, gate_up, down, weights, ids)) < RTOL


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("tile", [Tile(16, 64, 128, group_m=1, fuse_silu=True), Tile(128, 128, warps=8, group_m=1,
                                                                                         fuse_silu=True)],
                         ids=["decode", "prefill"])
@pytest.mark.parametrize("tokens", [64, 1024])
def test_grouped_experts_with_silu_in_the_first_gemm(tokens, tile, fp8):
    """A tile that fuses SiLU-and-mul into the first grouped GEMM (``Tile.fuse_silu``, which moe_tiles times):
    within bf16 rounding of float64, as close as the unfused launch of the same shape, on Qwen3-30B-A3B's
    experts in bf16 and FP8 (128 x 128 blocks, the up rows' scales the second part's)."""
    x, gate_up, down, weights, ids = expert_inputs(tokens, *SHAPES[0], seed=50 + tokens)
    scales = None
    if fp8:
        gate_up, down, scales, gu_deq, d_deq = fp8_experts(gate_up.float(), down.float(), (128, 128))
        expected = reference(x, gu_deq, d_deq, weights, ids)
    else:
        expected = reference(x, gate_up, down, weights, ids)
    fused = grouped_experts(x, gate_up, down, weights, ids, scales, tile=tile)
    unfused = grouped_experts(x, gate_up, down, weights, ids, scales, tile=dataclasses.replace(tile, fuse_silu=False))
    err, unfused_err = rel_err(fused, expected), rel_err(unfused, expected)
    print(f"tokens {tokens} {tile} fp8 {fp8}: fused {err:.2e}, unfused {unfused_err:.2e}")
    assert err < RTOL and err < 2 * unfused_err + 1e-3


@pytest.mark.parametrize("block", [(128, 128), (8, 32), None], ids=["128x128", "8x32", "row"])
@pytest.mark.parametrize("tokens", [1, 3, 8, 32, 300, 1024])  # 1,024: the prefill tile (8,192 rows at top 8)
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[1], SHAPES[4]], ids=lambda s: "x".join(map(str, s)))
def test_fp8_experts_match_dequantized(tokens, shape, block):
    """FP8 experts (an FP8 checkpoint's: per expert, gate and up scaled apart) through the small-batch kernels
    (routed too) and the grouped GEMMs: within bf16 rounding of float64 on the dequantized weights, as close as
    the same kernels on those weights in bf16; the routed kernels give the router kernel's bits, also replayed in
    a CUDA graph. 8 x 32 blocks are thinner than the kernels' rows (scales gathered per row); ``row``: a scale per
    row, held as compressed-tensors' experts are ((1, max(H, I)) blocks, StackedExperts)."""
    block = block or (1, max(shape[2], shape[3]))
    x, gate_up, down, weights, ids = expert_inputs(tokens, *shape, seed=30 + tokens)
    gu_q, d_q, scales, gu_deq, d_deq = fp8_experts(gate_up.float(), down.float(), block)
    expected = reference(x, gu_deq, d_deq, weights, ids)
    got = fused_experts(x, gu_q, d_q, weights, ids, scales)
    bf16 = fused_experts(x, gu_deq.to(DTYPE), d_deq.to(DTYPE), weights, ids)
    err, bf16_err = rel_err(got, expected), rel_err(bf16, expected)
    print(f"tokens {tokens} shape {shape} block {block}: fp8 {err:.2e}, the same kernels on bf16 dequantized {bf16_err:.2e}")
    assert err < RTOL and err < 2 * bf16_err + 1e-3
    if ids.numel() > SMALL_BATCH_MAX_ROWS:
        return
    logits = torch.randn(tokens, shape[0], generator=torch.Generator(device=DEVICE).manual_seed(tokens), device=DEVICE)
    router = RouterLogits(logits.to(DTYPE), shape[1], True)
    routed = routed_experts(x, gu_q, d_q, router, scales=scales)
    weights, ids = router_topk(router.logits, shape[1], True, DTYPE)
    assert torch.equal(routed, small_batch_experts(x, gu_q, d_q, weights, ids, scales=scales))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = routed_experts(x, gu_q, d_q, router, scales=scales)
    router.logits.copy_(torch.randn(logits.shape, device=DEVICE))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, routed_experts(x, gu_q, d_q, router, scales=scales))


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory) -> str:
    from tpserve.tiny import make_tiny_model

    out = tmp_path_factory.mktemp("tiny-qwen3-moe")
    return make_tiny_model(
        str(out), "qwen3_moe", num_layers=3, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=128,
        intermediate_size=512, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128, seed=1,
    )


def make_moe_engine(model_dir: str, dtype: str, backend: str, graph_max_bs: int) -> Engine:
    return Engine(EngineConfig(model=model_dir, device="cuda", dtype=dtype, attention_backend=backend,
                               cuda_graph_max_bs=graph_max_bs, max_total_tokens=16384, page_size=16))


def torch_experts_reference(model_dir: str, dtype: str, backend: str, monkeypatch):
    """(prompts, greedy tokens, logits) of the engine with every kernel as under test but the
    experts on the torch path, eager."""
    with monkeypatch.context() as patch:
        patch.setattr(moe_layer, "use_triton", lambda device: False)
        reference = make_moe_engine(model_dir, dtype, backend, 0)
        prompts = prompts_for(11, reference.model_config.vocab_size, seed=7)
        tokens, logits = run_scenario(reference, prompts)
        del reference
    return prompts, tokens, logits


def test_moe_model_float32_triton_matches_torch_experts(moe_model_dir, monkeypatch):
    """float32 (torch attention, no graphs), the Triton experts with IEEE dots: the two models
    differ by float32 rounding (~1e-6 on the CPU, through the interpreter), far below any
    router's margin, so every token takes the same experts and the logits agree closely."""
    prompts, ref_tokens, ref_logits = torch_experts_reference(moe_model_dir, "float32", "torch", monkeypatch)
    engine = make_moe_engine(moe_model_dir, "float32", "torch", 0)
    _, forced_logits = run_scenario(engine, prompts, forced=ref_tokens)
    errors = row_errors(forced_logits, ref_logits)
    print(f"float32 Triton vs torch experts: row errors median {float(errors.median()):.2e}, max {float(errors.max()):.2e}")
    assert float(errors.max()) < 1e-4
    own_tokens, _ = run_scenario(engine, prompts)
    assert_same_greedy(own_tokens, ref_tokens, ref_logits)


@pytest.fixture(scope="module")
def bf16_engines(moe_model_dir):
    """bf16, FlashInfer attention and the fused norms in both: (the reference, eager, to run with
    the torch experts; the engine under test, with CUDA graphs up to batch 16)."""
    reference = make_moe_engine(moe_model_dir, "bfloat16", "flashinfer", 0)
    small_batch_calls = []

    def counted(*args, **kwargs):
        small_batch_calls.append(args[0].shape)
        return routed_experts(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(moe_small, "routed_experts", counted)
        engine = make_moe_engine(moe_model_dir, "bfloat16", "flashinfer", 16)
    assert engine.graph_runner is not None
    assert small_batch_calls, "no CUDA graph captured the small-batch (routed) experts"
    return reference, engine


@pytest.mark.parametrize("tokens", [300, 4096])
def test_prefill_forward_never_waits_for_the_gpu(bf16_engines, tokens):
    """A prefill step's forward (the grouped experts; from 4,096 tokens x top 4 rows the sort by expert in torch ops)
    enqueues without a host sync: session 30 found one a MoE layer (a Python scalar set into a CUDA tensor),
    48 a Qwen3-30B-A3B prefill step. torch's sync debug mode raises on any."""
    assert_prefill_never_waits(bf16_engines[1], tokens)


@pytest.mark.parametrize("num_prompts", [1, 3, 8, 11])
def test_moe_model_graphs_and_triton_match_torch_experts(bf16_engines, monkeypatch, num_prompts):
    """The Triton experts with CUDA graphs against the torch experts, eager: every decode step
    replays a graph on new routings, on the small-batch kernels while the step's rows (batch
    padded to its graph's size, times top 4) are at most SMALL_BATCH_MAX_ROWS."""
    reference, engine = bf16_engines
    prompts = prompts_for(num_prompts, engine.model_config.vocab_size, seed=7)
    with monkeypatch.context() as patch:
        patch.setattr(moe_layer, "use_triton", lambda device: False)
        ref_tokens, ref_logits = run_scenario(reference, prompts)
    _, forced_logits = run_scenario(engine, prompts, forced=ref_tokens)
    errors = row_errors(forced_logits, ref_logits)
    print(f"bf16 Triton + graphs vs torch experts, {num_prompts} prompts: row errors median "
          f"{float(errors.median()):.2e}, past 2e-2 {float((errors > 2e-2).float().mean()):.0%}")
    assert_routed_logits_close(forced_logits, ref_logits)


def rms_normed(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


GEMV_SHAPES = [SHAPES[0], SHAPES[1], SHAPES[3], SHAPES[4], (128, 16, 256, 128), (60, 6, 256, 128)]


FP8_KINDS = {False: "bf16", True: "fp8", "row": "fp8row"}  # bf16 experts, FP8 in 128 x 128 blocks, FP8 with a scale a row


def fp8_block(fp8: bool | str, shape: tuple[int, int, int, int]) -> tuple[int, int]:
    """The FP8 experts' blocks: 128 x 128, or (``row``) one a row as StackedExperts holds compressed-tensors' scales."""
    return (128, 128) if fp8 is True else (1, max(shape[2], shape[3]))


@pytest.mark.parametrize("norm", [False, True], ids=["plain", "norm"])
@pytest.mark.parametrize("shape,fp8", [(s, fp8) for s in GEMV_SHAPES for fp8 in FP8_KINDS
                                       if fp8 is False or s[3] % (128 if fp8 is True else 16) == 0],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else FP8_KINDS[v])
def test_expert_gemv_matches_torch_and_triton(shape, fp8, norm):
    """The one-token experts through the CUDA GEMV (``gemv.experts``), routing themselves from the router's logits:
    within bf16 rounding of float64 (on the router kernel's experts and weights) as the routed Triton kernels are,
    bf16 and FP8 (128 x 128 blocks, or a scale a row: each row's sum times its scale, down's per slot), with the
    RMSNorm of x fused or not, the same bits every run. The logits are rounded to bf16, so some tie: both take the
    lower id."""
    from tpserve.kernels import gemv

    experts, top_k, hidden, _ = shape
    x, gate_up, down, _, _ = expert_inputs(1, *shape, seed=50)
    scales = None
    if fp8:
        gate_up, down, scales, gu_deq, d_deq = fp8_experts(gate_up.float(), down.float(), fp8_block(fp8, shape))
    gen = torch.Generator(device=DEVICE).manual_seed(51)
    logits = (2 * torch.randn(1, experts, generator=gen, device=DEVICE)).to(DTYPE)
    fused_norm, expected_x = None, x.double()
    if norm:
        norm_weight = (1 + 0.1 * torch.randn(hidden, generator=gen, device=DEVICE)).to(DTYPE)
        fused_norm, expected_x = (norm_weight, 1e-6), rms_normed(x, norm_weight, 1e-6)
    weights, ids = router_topk(logits, top_k, True, DTYPE)
    ref_gu, ref_down = (gu_deq, d_deq) if fp8 else (gate_up, down)
    expected = experts_torch(expected_x, ref_gu.double(), ref_down.double(), weights.double(), ids)
    out = gemv.experts(x, gate_up, down, logits, top_k, True, fused_norm, scales)
    triton = routed_experts(x, gate_up, down, RouterLogits(logits, top_k, True), norm=fused_norm, scales=scales)
    gemv_err, triton_err = rel_err(out, expected), rel_err(triton, expected)
    print(f"shape {shape} norm {norm} fp8 {fp8}: expert gemv {gemv_err:.2e}, triton {triton_err:.2e}")
    assert gemv_err < RTOL and gemv_err < 2 * triton_err + 1e-3
    assert torch.equal(out, gemv.experts(x, gate_up, down, logits, top_k, True, fused_norm, scales))


def one_token_experts(seed: int, fp8: bool | str):
    """One token and Qwen3-30B-A3B's experts (SHAPES[0]), bf16 or FP8 (``fp8_block``): (x, gate_up, down, scales or
    None, and the weights a float64 reference takes: the dequantized ones for FP8)."""
    x, gate_up, down, _, _ = expert_inputs(1, *SHAPES[0], seed=seed)
    if not fp8:
        return x, gate_up, down, None, gate_up, down
    block = fp8_block(fp8, SHAPES[0])
    gate_up_q, down_q, scales, gate_up_deq, down_deq = fp8_experts(gate_up.float(), down.float(), block)
    return x, gate_up_q, down_q, scales, gate_up_deq, down_deq


@pytest.mark.parametrize("fp8", list(FP8_KINDS), ids=list(FP8_KINDS.values()))
def test_expert_gemv_in_a_cuda_graph_after_the_router_gemv(fp8):
    """As a MoE layer runs it: the router's GEMV, then the expert GEMVs routing from its logits (PDL: gate_up waits
    for the logits, down reads them before its own wait), captured once and replayed on new tokens (other experts):
    equal to eager, and near float64 on the router kernel's choice. Not renormalised here (norm_topk_prob off)."""
    from tpserve.kernels import gemv

    experts, top_k, hidden, _ = SHAPES[0]
    x, gate_up, down, scales, ref_gu, ref_down = one_token_experts(40, fp8)
    gen = torch.Generator(device=DEVICE).manual_seed(41)
    router = (torch.randn(experts, hidden, generator=gen, device=DEVICE) / hidden**0.5).to(DTYPE)

    def layer() -> torch.Tensor:
        return gemv.experts(x, gate_up, down, gemv.gemv(x, router), top_k, False, scales=scales)

    layer()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer()
    for seed in (42, 43):
        x.copy_(torch.randn(x.shape, generator=gen.manual_seed(seed), device=DEVICE))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, layer())
        weights, ids = router_topk(gemv.gemv(x, router), top_k, False, DTYPE)
        assert rel_err(out, reference(x, ref_gu, ref_down, weights, ids)) < RTOL


@pytest.mark.parametrize("fp8", list(FP8_KINDS), ids=list(FP8_KINDS.values()))
@pytest.mark.parametrize("path", ["triton", "gemv"])
def test_one_token_experts_add_to_the_residual(path, fp8):
    """A MoE layer at one token and TP 1 has its down kernel add the experts' sum to the residual stream in place
    (``add_to``, as the dense down GEMV does), so no add + RMSNorm kernel runs after it: the residual becomes
    bf16(residual + the sum as returned without ``add_to``), bit for bit, eager and replayed in a CUDA graph on new
    logits (the other experts' weights), through the routed Triton kernels and the expert GEMVs."""
    from tpserve.kernels import gemv

    experts, top_k, hidden, _ = SHAPES[0]
    x, gate_up, down, scales, _, _ = one_token_experts(60, fp8)
    gen = torch.Generator(device=DEVICE).manual_seed(61)
    logits = (2 * torch.randn(1, experts, generator=gen, device=DEVICE)).to(DTYPE)
    residual = torch.randn(1, hidden, generator=gen, device=DEVICE).to(DTYPE)

    def layer(add_to: torch.Tensor | None = None) -> torch.Tensor:
        if path == "gemv":
            return gemv.experts(x, gate_up, down, logits, top_k, True, scales=scales, add_to=add_to)
        return routed_experts(x, gate_up, down, RouterLogits(logits, top_k, True), scales=scales, add_to=add_to)

    def expected(before: torch.Tensor) -> torch.Tensor:
        return (before.float() + layer().float()).to(DTYPE)

    stream = residual.clone()
    want = expected(stream)
    assert layer(add_to=stream) is stream
    assert torch.equal(stream, want) and not torch.equal(stream, residual)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer(add_to=stream)
    for seed in (62, 63):
        logits.copy_((2 * torch.randn(logits.shape, generator=gen.manual_seed(seed), device=DEVICE)).to(DTYPE))
        stream.copy_(residual)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(stream, expected(residual))


def test_moe_model_expert_gemv_matches_torch_experts(moe_model_dir, bf16_engines, monkeypatch):
    """The tiny model with ``TPSERVE_MOE_GEMV=1`` (one-token decode steps in CUDA graphs on the expert GEMVs) against
    the torch experts, eager, as the Triton engine is checked above."""
    from tpserve.kernels import gemv

    reference, _ = bf16_engines
    calls = []
    real_experts = gemv.experts

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real_experts(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setenv(moe_layer.EXPERT_GEMV_ENV, "1")
        patch.setattr(gemv, "experts", counted)
        engine = make_moe_engine(moe_model_dir, "bfloat16", "flashinfer", 16)
    assert calls, "no CUDA graph captured the expert GEMVs"
    prompts = prompts_for(1, engine.model_config.vocab_size, seed=7)
    with monkeypatch.context() as patch:
        patch.setattr(moe_layer, "use_triton", lambda device: False)
        ref_tokens, ref_logits = run_scenario(reference, prompts)
    _, forced_logits = run_scenario(engine, prompts, forced=ref_tokens)
    assert_routed_logits_close(forced_logits, ref_logits)


OTHER_ARCHS = {
    # a gated shared expert (a dense MLP) beside 16 routed experts, q/k/v biases, the top k not renormalised
    "qwen2_moe": {"num_experts": 16, "num_experts_per_tok": 4, "norm_topk_prob": False,
                  "shared_expert_intermediate_size": 256},
    "mixtral": {"num_experts": 8, "num_experts_per_tok": 2},  # every layer sparse, Mixtral's checkpoint names
    # every layer sparse, q/k RMSNorms over the whole projections (not the fused kernels' per-head norm); its heads fill
    # the hidden size
    "olmoe": {"num_experts": 16, "num_experts_per_tok": 4, "norm_topk_prob": False, "hidden_size": 512},
}


@pytest.mark.parametrize("arch", list(OTHER_ARCHS))
def test_other_moe_architectures_triton_and_graphs_match_torch_experts(tmp_path_factory, monkeypatch, arch):
    """Qwen2-MoE, Mixtral and OLMoE through the same kernels, teacher-forced on the float32 torch experts' greedy tokens at
    1 and 11 prompts: the float32 Triton experts within float32 rounding of them; the bf16 engine (Triton experts,
    CUDA graphs, FlashInfer) no further from them than the same bf16 model with the torch experts, eager (its own
    bf16 error is the bound: a tiny Mixtral's median row error is ~1e-2, where a wrong expert path moves every row
    far more)."""
    from tpserve.tiny import make_tiny_model

    shape = dict(num_layers=3, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=128, intermediate_size=512,
                 moe_intermediate_size=128, seed=1)
    model_dir = make_tiny_model(str(tmp_path_factory.mktemp(f"tiny-{arch}")), arch, **(shape | OTHER_ARCHS[arch]))
    routed = []

    def counted(*args, **kwargs):
        routed.append(args[0].shape)
        return routed_experts(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(moe_small, "routed_experts", counted)
        bf16 = make_moe_engine(model_dir, "bfloat16", "flashinfer", 16)
    assert bf16.graph_runner is not None and routed, "no CUDA graph captured the routed small-batch experts"
    float32 = make_moe_engine(model_dir, "float32", "torch", 0)
    with monkeypatch.context() as patch:
        patch.setattr(moe_layer, "use_triton", lambda device: False)
        torch32 = make_moe_engine(model_dir, "float32", "torch", 0)
        torch16 = make_moe_engine(model_dir, "bfloat16", "flashinfer", 0)
    for num_prompts in (1, 11):
        prompts = prompts_for(num_prompts, bf16.model_config.vocab_size, seed=7)
        with monkeypatch.context() as patch:
            patch.setattr(moe_layer, "use_triton", lambda device: False)
            tokens, exact = run_scenario(torch32, prompts)
            _, torch16_logits = run_scenario(torch16, prompts, forced=tokens)
        _, float32_logits = run_scenario(float32, prompts, forced=tokens)
        _, bf16_logits = run_scenario(bf16, prompts, forced=tokens)
        float32_max = float(row_errors(float32_logits, exact).max())
        bound = float(row_errors(torch16_logits, exact).median())
        measured = float(row_errors(bf16_logits, exact).median())
        print(f"{arch}, {num_prompts} prompts: float32 Triton row errors max {float32_max:.2e}; bf16 median row error "
              f"{measured:.2e} (torch experts, eager: {bound:.2e})")
        assert float32_max < 1e-4
        assert measured <= 1.5 * bound, f"bf16 median row error {measured:.2e} against the torch experts' {bound:.2e}"
