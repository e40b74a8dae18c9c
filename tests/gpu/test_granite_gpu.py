"""Granite on a GPU (CPU correctness against transformers: tests/models/test_granite.py): in bf16 its prefills run
FlashInfer, its decodes the Triton kernel inside CUDA graphs, each of which must take attention_multiplier as its
softmax scale, and the fused GEMVs the o/down weights that carry residual_multiplier. Their logits against the torch
backend's, eager, on the same weights (the engine_scenario comparison test_flashinfer_and_graphs makes for Qwen3);
a scale of head_dim ** -0.5 would be far outside it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("flashinfer")

from engine_scenario import assert_logits_close, assert_same_greedy, prompts_for, run_scenario
from tpserve.engine_config import EngineConfig
from tpserve.engine.engine import Engine


def make_engine(model_dir: str, backend: str, graph_max_bs: int) -> Engine:
    return Engine(EngineConfig(model=model_dir, device="cuda", dtype="bfloat16", attention_backend=backend,
                               cuda_graph_max_bs=graph_max_bs, max_total_tokens=16384, page_size=16))


def test_flashinfer_and_graphs_take_granites_scalars(tiny_model_factory, tmp_path):
    # Granite 3's own scalars leave this tiny random model's logits to its embedding (attention near uniform at
    # 1/128, sublayers x 0.22, logits / 16): these make the attention scale and the residual multiplier weigh
    source = tiny_model_factory("granite", head_dim=128, hidden_size=256, num_heads=4, num_kv_heads=2,
                                intermediate_size=512)
    model_dir = tmp_path / "granite"
    shutil.copytree(source, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(embedding_multiplier=2.0, residual_multiplier=1.5, attention_multiplier=0.25, logits_scaling=2.0)
    (model_dir / "config.json").write_text(json.dumps(config))
    model_dir = str(model_dir)

    reference = make_engine(model_dir, "torch", 0)
    assert reference.attention.scale == 0.25
    prompts = prompts_for(6, reference.model_config.vocab_size, seed=7)
    ref_tokens, ref_logits = run_scenario(reference, prompts)
    del reference
    engine = make_engine(model_dir, "flashinfer", 16)
    assert engine.graph_runner is not None and engine.attention.scale == 0.25
    _, forced_logits = run_scenario(engine, prompts, forced=ref_tokens)
    assert_logits_close(forced_logits, ref_logits)
    own_tokens, _ = run_scenario(engine, prompts)
    assert_same_greedy(own_tokens, ref_tokens, ref_logits)
