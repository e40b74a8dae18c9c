"""float32 on a GPU: ``--attention-backend auto`` falls back to torch attention (FlashInfer takes
half precision only), and greedy tokens equal transformers' float32 ones, at TP 1 and 2."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from reference import hf_greedy
from tpserve import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41], list(range(100, 137))]


@pytest.mark.parametrize("tp_size", [1, 2])
def test_float32_on_cuda_matches_transformers(tiny_model_factory, tp_size):
    if torch.cuda.device_count() < tp_size:
        pytest.skip(f"needs {tp_size} GPUs")
    model_dir = tiny_model_factory("qwen3", head_dim=128, hidden_size=256, rope_type="yarn")
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(model_dir, tp_size=tp_size, device="cuda", dtype="float32") as llm:
        outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(model_dir, p, 12) for p in PROMPTS]
