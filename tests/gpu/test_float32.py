"""float32 on a GPU: ``--attention-backend auto`` falls back to torch attention (FlashInfer takes
half precision only), and greedy tokens equal transformers' float32 ones. The TP 2 case is in
test_tp2.py (it needs two GPUs)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from reference import hf_greedy
from tpserve import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41], list(range(100, 137))]


def check_float32_matches_transformers(model_factory, tp_size: int) -> None:
    model_dir = model_factory("qwen3", head_dim=128, hidden_size=256, rope_type="yarn")
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(model_dir, tp_size=tp_size, device="cuda", dtype="float32") as llm:
        outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(model_dir, p, 12) for p in PROMPTS]


def test_float32_on_cuda_matches_transformers(tiny_model_factory):
    check_float32_matches_transformers(tiny_model_factory, tp_size=1)
