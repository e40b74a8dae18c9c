"""Speculative decoding with n-gram drafts on a GPU (CPU: tests/scheduler/test_ngram.py): a drafted step is a chunk of
several tokens through FlashInfer's prefill over the paged cache with extra logits rows, between decode steps that
run in CUDA graphs; float32 tokens and log-probabilities equal the plain engine's, while drafts are both accepted and
rejected."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from tpserve import LLM, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPTS = [[i, i + 1, i + 2] for i in range(1, 200, 23)]


@pytest.fixture(scope="module")
def loopy_dir(tiny_model_factory, tmp_path_factory) -> str:
    from loopy_model import loopy_model

    source = tiny_model_factory("qwen3", head_dim=128, hidden_size=256, vocab_size=700)  # FlashInfer's head_dim
    return loopy_model(source, tmp_path_factory.mktemp("loopy") / "model")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_drafts_on_cuda_give_the_plain_engines_tokens(loopy_dir, dtype):
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True, logprobs=0)
    runs = []
    for spec in (None, SPEC):
        kwargs = {} if spec is None else {"speculative_config": spec}
        with LLM(loopy_dir, device="cuda", dtype=dtype, **kwargs) as llm:
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
            stats = llm.replica_stats()[0]
        runs.append((outs, stats))
    (plain, _), (drafted, stats) = runs
    assert 10 < stats.accepted_tokens_total < stats.draft_tokens_total, stats
    if dtype == "float32":
        assert [d.outputs[0].token_ids for d in drafted] == [p.outputs[0].token_ids for p in plain]
        worst = max(abs(a - b) for p, d in zip(plain, drafted) for a, b in zip(p.token_logprobs, d.token_logprobs))
        assert worst < 1e-3, worst
        return
    # bf16: a drafted chunk's logits round otherwise than a graph's decode (6 of 9 texts equal on an H100): each text
    # is the plain one's until a near tie, where the two chosen tokens' log-probabilities are within bf16 noise
    for p, d in zip(plain, drafted):
        ours, theirs = d.outputs[0].token_ids, p.outputs[0].token_ids
        split = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if split is not None:
            gap = abs(d.token_logprobs[split] - p.token_logprobs[split])
            assert split > 0 and gap < 0.1, (split, gap)
