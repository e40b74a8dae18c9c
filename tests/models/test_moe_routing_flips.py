"""How two correct bf16 runs of a Qwen3-MoE model differ, on the CPU, and the check the GPU tests
use for them (``assert_routed_logits_close``).

The tiny model is the one of tests/gpu/test_moe.py. Rounding one op differently (RMSNorm rounded
once, as FlashInfer's kernel does) flips some routers near a tie, which moves the logits by ~0.13
per step: the same figure as the GPU test that compared the Triton experts with graphs against an
engine with every fused kernel off (0.136). So the GPU reference keeps the same non-expert kernels
and the check tolerates a few rows moved by routing flips; these tests show it passes the
expert numerics of the Triton kernel and fails broken expert paths.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tpserve.layers.moe as moe_layer
from engine_scenario import LOGITS_RTOL, assert_routed_logits_close, prompts_for, row_errors, run_scenario
from tpserve.engine_config import EngineConfig
from tpserve.engine.engine import Engine
from tpserve.layers.activation import silu_and_mul
from tpserve.layers.norm import RMSNorm

Logits = list[torch.Tensor]
DECODE_STEPS = 6  # fewer than the GPU tests' 16: CPU time


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    from tpserve.tiny import make_tiny_model

    return make_tiny_model(
        str(tmp_path_factory.mktemp("tiny-qwen3-moe")), "qwen3_moe", num_layers=3, hidden_size=256, num_heads=4,
        num_kv_heads=2, head_dim=128, intermediate_size=512, num_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=128, seed=1,
    )


def make_engine(model_dir: str) -> Engine:
    return Engine(EngineConfig(model=model_dir, device="cpu", dtype="bfloat16", attention_backend="torch",
                               max_total_tokens=4096, page_size=16))


@pytest.fixture(scope="module")
def reference(moe_dir) -> tuple[list[list[int]], Logits, list[list[int]]]:
    """(greedy tokens, logits, prompts) of the bf16 torch path."""
    engine = make_engine(moe_dir)
    prompts = prompts_for(8, engine.model_config.vocab_size, seed=7)
    tokens, logits = run_scenario(engine, prompts, decode_steps=DECODE_STEPS)
    return tokens, logits, prompts


def forced_logits(moe_dir: str, reference) -> Logits:
    tokens, _, prompts = reference
    return run_scenario(make_engine(moe_dir), prompts, forced=tokens, decode_steps=DECODE_STEPS)[1]


def experts_rounded_like_triton(x, gate_up, down, weights, ids, scales=None, skip_others=False) -> torch.Tensor:
    """The Triton kernel's rounding: float32 accumulation, gate/up rounded once, the down output
    scaled by the router weight before it is rounded, the k rows summed in float32."""
    tokens, top_k = ids.shape
    out = torch.zeros(tokens * top_k, x.shape[1], dtype=x.dtype)
    flat = ids.flatten()
    for expert in flat.unique().tolist():
        rows = (flat == expert).nonzero().flatten()
        hidden = silu_and_mul(F.linear(x[rows // top_k].float(), gate_up[expert].float()).to(x.dtype))
        scaled = F.linear(hidden.float(), down[expert].float()) * weights.flatten()[rows, None].float()
        out[rows] = scaled.to(x.dtype)
    return out.view(tokens, top_k, -1).float().sum(dim=1).to(x.dtype)


def test_rmsnorm_rounded_once_moves_logits_past_the_dense_bound(moe_dir, reference, monkeypatch):
    """The failure the GPU test met with an all-torch reference, reproduced without a GPU."""

    def norm_rounded_once(self: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (self.weight.float() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    monkeypatch.setattr(RMSNorm, "_norm", norm_rounded_once)
    logits = forced_logits(moe_dir, reference)
    step0 = row_errors(logits[:1], reference[1][:1])
    assert float(step0.norm() / step0.numel() ** 0.5) > LOGITS_RTOL  # not a rounding-sized difference
    with pytest.raises(AssertionError, match="median row error"):
        assert_routed_logits_close(logits, reference[1])


def test_routed_check_passes_triton_rounding(moe_dir, reference, monkeypatch):
    monkeypatch.setattr(moe_layer, "run_experts", experts_rounded_like_triton)
    assert_routed_logits_close(forced_logits(moe_dir, reference), reference[1])


def weights_twice(x, gate_up, down, weights, ids, scales=None, skip_others=False):
    return moe_layer.experts_torch(x, gate_up, down, weights * weights, ids)


def expert_dropped(x, gate_up, down, weights, ids, scales=None, skip_others=False):
    return moe_layer.experts_torch(x, gate_up, down, weights.masked_fill(ids == 5, 0), ids)


@pytest.mark.parametrize("broken", [weights_twice, expert_dropped], ids=lambda f: f.__name__)
def test_routed_check_fails_broken_experts(moe_dir, reference, monkeypatch, broken):
    monkeypatch.setattr(moe_layer, "run_experts", broken)
    with pytest.raises(AssertionError, match="median row error"):
        assert_routed_logits_close(forced_logits(moe_dir, reference), reference[1])
