"""The decoder's residual add + RMSNorm fused into the GEMVs around it (TP 1, 1 or 2 tokens: o_proj and
down_proj add to the residual stream, qkv_proj and gate_up_proj norm a ``PendingNorm``). The CUDA
kernel is replaced by its float32 torch reference, so the plumbing runs on the CPU against
transformers; tests/gpu/test_gemv.py checks the kernel against the same reference."""

from __future__ import annotations

import collections

import pytest
import torch

from gemv_reference import gemv_reference
from reference import hf_greedy, hf_logits
from tpserve import LLM, SamplingParams
from tpserve.engine_config import EngineConfig
from tpserve.engine.engine import Engine
from tpserve.kernels import gemv, moe_small
from tpserve.layers.linear import ParallelLinear
from tpserve.layers.moe import SparseMoeBlock, experts_torch
from tpserve.layers.mlp import MLP
from test_vs_transformers import PROMPTS, teacher_forced_logits


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """Every linear layer takes the 'GEMV' at 1 or 2 tokens; returns the count of fused calls by kind."""
    calls: collections.Counter = collections.Counter()

    def fake_gemv(x, weight, scale_inv=None, module=None, pdl=None, silu_mul=False, norm=None, add_to=None,
                  row_scales=False):
        assert not row_scales, "these models' weights are not FP8"
        calls["norm" if norm is not None else "add" if add_to is not None else "plain"] += 1
        return gemv_reference(x, weight, scale_inv, silu_mul=silu_mul, norm=norm, add_to=add_to)

    monkeypatch.setenv(gemv.FUSE_NORM_ENV, "1")
    monkeypatch.setattr(gemv, "FUSE_NORM_MAX_TOKENS", 2)  # the kernel's limit, so that 2 sequences fuse too
    monkeypatch.setattr(ParallelLinear, "takes_gemv", lambda self, x: x.numel() // x.shape[-1] <= 2)
    monkeypatch.setattr(gemv, "supported", lambda *args, **kwargs: True)
    monkeypatch.setattr(gemv, "gemv", fake_gemv)
    return calls


@pytest.mark.parametrize("arch,kwargs", [("qwen3", {}), ("qwen3_moe", {"num_layers": 3})], ids=["qwen3", "qwen3_moe"])
def test_fused_norm_and_add_match_transformers(tiny_model_factory, fused_on_cpu, monkeypatch, arch, kwargs):
    model_dir = tiny_model_factory(arch, **kwargs)
    moe_normed = collections.Counter()

    def fake_small_batch_experts(x, gate_up, down, weights, ids, config=None, norm=None, scales=None,
                                 skip_others=False):
        """The Triton experts' contract in torch: the experts of RMSNorm(x) * weight, unrounded in between."""
        moe_normed["calls"] += 1
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm[1]) * norm[0].float()).to(x.dtype)
        return experts_torch(normed, gate_up, down, weights, ids)

    # the MoE block norms in its router's GEMV and its first expert kernel (kernels.moe_small) at 1 or 2 tokens
    monkeypatch.setattr(SparseMoeBlock, "fuses_norm", lambda self, r: r.numel() // r.shape[-1] <= 2)
    monkeypatch.setattr(moe_small, "small_batch_experts", fake_small_batch_experts)
    engine = Engine(EngineConfig(model=model_dir, device="cpu", page_size=4))
    ids = list(range(30, 70))
    ours = teacher_forced_logits(engine, ids, prefill=9)  # decode steps of 2 sequences: the fused path
    ref = hf_logits(model_dir, ids)[8 : len(ids) - 1]
    err = (ours - ref).abs().max().item()
    print(f"{arch} fused norm/add: max logit error {err:.2e}, GEMV calls {dict(fused_on_cpu)}")
    assert err < 1e-4, f"max logit error {err}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    dense = [isinstance(layer.mlp, MLP) for layer in engine.model.model.layers]  # the tiny MoE: layer 0
    steps = len(ids) - 1 - 9
    # per decode step: o_proj of every layer and down_proj of a dense layer add to the residual, and the GEMV
    # after each add norms: gate_up_proj, a MoE block's router (its experts norm in their first kernel), and
    # qkv_proj of the next layer (of the first layer too: the embedding needs no add)
    first_qkv = [True] + dense[:-1]
    moe = len(dense) - sum(dense)
    assert fused_on_cpu["add"] == steps * (len(dense) + sum(dense))
    assert fused_on_cpu["norm"] == steps * (len(dense) + sum(first_qkv))
    assert moe_normed["calls"] == steps * moe

    llm = LLM(model_dir, device="cpu", page_size=4)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(model_dir, prompt, 10)


def test_fusion_switch_and_batch_limit(tiny_model_factory, fused_on_cpu, monkeypatch):
    """``TPSERVE_GEMV_FUSE_NORM=0``, 3 tokens (past the kernel's limit) and 2 tokens (past the layers' limit,
    ``FUSE_NORM_MAX_TOKENS``) take the separate add + norm: no fused call; 1 token fuses."""
    engine = Engine(EngineConfig(model=tiny_model_factory("qwen3"), device="cpu", page_size=4))
    monkeypatch.setenv(gemv.FUSE_NORM_ENV, "0")
    teacher_forced_logits(engine, list(range(30, 40)), prefill=5)
    assert fused_on_cpu["norm"] == fused_on_cpu["add"] == 0
    monkeypatch.setenv(gemv.FUSE_NORM_ENV, "1")
    monkeypatch.setattr(ParallelLinear, "takes_gemv", lambda self, x: x.numel() // x.shape[-1] <= 3)
    monkeypatch.setattr(gemv, "supported",
                        lambda x, *args, fused=False, row_scales=False: not fused or x.numel() // x.shape[-1] <= 2)
    from tpserve.forward import SequenceInput
    from tpserve.kvcache.pool import PageAllocator

    pages = [PageAllocator(engine.num_pages).allocate(2) for _ in range(3)]
    engine.forward([SequenceInput([5, 6], 0, p) for p in pages])
    engine.forward([SequenceInput([7], 2, p) for p in pages])
    assert fused_on_cpu["norm"] == fused_on_cpu["add"] == 0
    monkeypatch.setattr(gemv, "FUSE_NORM_MAX_TOKENS", 1)  # the default
    engine.forward([SequenceInput([8], 3, p) for p in pages[:2]])
    assert fused_on_cpu["norm"] == fused_on_cpu["add"] == 0
    engine.forward([SequenceInput([9], 4, pages[0])])
    assert fused_on_cpu["norm"] > 0 and fused_on_cpu["add"] > 0
