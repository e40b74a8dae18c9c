"""GPU path: FlashInfer attention against the torch reference, CUDA graphs on against off.

Skipped without CUDA or without flashinfer, so CI on CPU stays green. Each scenario drives the
Engine directly through prefills, a chunked prefill mixed with decodes, and 16 decode steps,
in bf16 on tiny models with head_dim 128 (the shape the Qwen3 benchmarks compile for).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("flashinfer")

from engine_scenario import assert_logits_close, assert_prefill_never_waits, assert_same_greedy, prompts_for, run_scenario
from tpserve.engine_config import EngineConfig
from tpserve.engine.engine import Engine
from tpserve.forward import SequenceInput
from tpserve.kvcache.pool import PageAllocator


@pytest.fixture(scope="module", params=[(4, 2), (8, 2)], ids=["gqa2-cuda-cores", "gqa4-tensor-cores"])
def model_dir(request, tmp_path_factory) -> str:
    from tpserve.tiny import make_tiny_model

    heads, kv_heads = request.param
    out = tmp_path_factory.mktemp(f"tiny-h{heads}-kv{kv_heads}")
    return make_tiny_model(
        str(out), "qwen3", num_layers=2, hidden_size=256, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=128, intermediate_size=512, seed=1,
    )


def make_engine(model_dir: str, backend: str, graph_max_bs: int, page_size: int) -> Engine:
    config = EngineConfig(
        model=model_dir, device="cuda", dtype="bfloat16", attention_backend=backend,
        cuda_graph_max_bs=graph_max_bs, max_total_tokens=16384, page_size=page_size,
    )
    return Engine(config)


@pytest.mark.parametrize("page_size", [16, 3])
def test_flashinfer_matches_torch(model_dir, page_size):
    reference = make_engine(model_dir, "torch", 0, page_size)
    vocab = reference.model_config.vocab_size
    prompts = prompts_for(6, vocab, seed=page_size)
    ref_tokens, ref_logits = run_scenario(reference, prompts)
    del reference

    engine = make_engine(model_dir, "flashinfer", 0, page_size)
    assert type(engine.attention).__name__ == "FlashInferAttentionBackend"
    _, forced_logits = run_scenario(engine, prompts, forced=ref_tokens)
    assert_logits_close(forced_logits, ref_logits)
    own_tokens, _ = run_scenario(engine, prompts)
    assert_same_greedy(own_tokens, ref_tokens, ref_logits)


def test_auto_backend_is_flashinfer_on_cuda(model_dir):
    engine = make_engine(model_dir, "auto", 0, 16)
    assert type(engine.attention).__name__ == "FlashInferAttentionBackend"


@pytest.mark.parametrize("batch", [1, 3, 11])
def test_cuda_graphs_match_eager(model_dir, batch):
    eager = make_engine(model_dir, "flashinfer", 0, 16)
    vocab = eager.model_config.vocab_size
    prompts = prompts_for(batch, vocab, seed=100 + batch)
    eager_tokens, eager_logits = run_scenario(eager, prompts)
    del eager

    graphed = make_engine(model_dir, "flashinfer", 16, 16)
    assert graphed.graph_runner is not None and graphed.graph_runner.sizes == [1, 2, 4, 8, 16]
    _, graph_logits = run_scenario(graphed, prompts, forced=eager_tokens)
    assert_logits_close(graph_logits, eager_logits)
    own_tokens, _ = run_scenario(graphed, prompts)
    assert_same_greedy(own_tokens, eager_tokens, eager_logits)


def test_graph_padding_leaves_other_requests_alone(model_dir):
    """A padded replay writes only the scratch page: a second batch's KV stays intact."""
    engine = make_engine(model_dir, "flashinfer", 16, 16)
    before = [k.clone() for k in engine.kv_pool.k]
    allocator = PageAllocator(engine.num_pages)
    page = allocator.allocate(1)
    engine.forward([SequenceInput([5], 0, page)])  # bs 1 graph: no padding
    engine.forward([SequenceInput([6], 1, page), SequenceInput([7], 0, allocator.allocate(1))])
    third = SequenceInput([9], 0, allocator.allocate(1))
    engine.forward([SequenceInput([8], 2, page), third, third])  # bs 3 pads to 4
    torch.cuda.synchronize()
    touched = {0, *range(1, 4)}
    for layer, (old, new) in enumerate(zip(before, engine.kv_pool.k)):
        changed = (old != new).flatten(1).any(dim=1).nonzero().flatten().tolist()
        assert set(changed) <= touched, f"layer {layer}: pages {changed} written"


@pytest.mark.parametrize("tokens", [9, 300, 1001])
def test_prefill_forward_never_waits_for_the_gpu(model_dir, tokens):
    """A dense model's prefill step enqueues without a host sync (one a layer would drain the GPU between its
    layers' launches: session 30 found that in the MoE layers). torch's sync debug mode raises on any."""
    assert_prefill_never_waits(make_engine(model_dir, "flashinfer", 0, 16), tokens)
