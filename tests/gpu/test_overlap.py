"""On the GPU: overlap scheduling and CUDA graphs change no greedy output (bf16, FlashInfer)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_overlap_and_graphs_do_not_change_outputs(tmp_path):
    pytest.importorskip("flashinfer")
    from tpserve import LLM, SamplingParams
    from tpserve.tiny import make_tiny_model

    model = make_tiny_model(str(tmp_path / "m"), "qwen3", hidden_size=256, num_heads=2, num_kv_heads=1, head_dim=128)
    prompts = [[3 + i, 4 + i, 5 + i] * (1 + i % 5) for i in range(24)]
    params = [SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=8 + i, ignore_eos=True) for i in range(24)]
    results = {}
    for overlap in (False, True):
        for graph_bs in (0, 32):
            llm = LLM(model, device="cuda", dtype="bfloat16", disable_overlap=not overlap, cuda_graph_max_bs=graph_bs)
            results[(overlap, graph_bs)] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            llm.close()
    base = results[(False, 0)]
    for key, tokens in results.items():
        assert [len(t) for t in tokens] == [8 + i for i in range(24)], key
        same = sum(a == b for a, b in zip(tokens, base))
        assert same >= 23, f"{key}: only {same}/24 requests identical to overlap off, graphs off"
